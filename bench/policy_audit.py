"""Exact audit of a Tic-Tac-Toe policy against the random opponent: its expected outcomes and where it loses.

    python bench/policy_audit.py CHECKPOINT_DIR [CHECKPOINT_DIR ...] [--temperature 1.0] [--worst 10] \
        [--json bench/results/policy_audit.json --note "what the checkpoints are"]

A learning curve's window of 512 games has a standard error of ~0.01; this is the policy's own rate. It
walks every game the policy can play against `envs/tictactoe.py`'s uniformly random O (the model's turns
rendered exactly as the agent loop renders them, so the policy sees the whole conversation), branching on
each legal move by its probability at `--temperature` and on each O reply by 1 / empty cells, and sums
win / draw / loss / illegal. Probability on anything but a legal cell's digit counts as illegal (the digit's
end-of-turn token is taken as given). A branch below `--min-reach` is finished with optimal play's win
probability, the rest of it counted as a loss (so `draw` can read low when many branches are finished).

Where the lost value is: for each position the policy reaches, value lost = reach x sum over moves of
p(move) x (V*(position) - Q*(position, move)), V*/Q* being optimal play's win probability against the
random opponent (0.9948 from the empty board). It is split into positions whose most likely move is not
optimal (a "deterministic" mistake: no sampled game ever tries the better move) and the rest ("diffuse").
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from earl_stream_envs.tictactoe import TicTacToe, render_board, winner  # noqa: E402

from earl_stream.model.chat import ChatFormat  # noqa: E402
from earl_stream.model.loading import load_model  # noqa: E402

Board = tuple[str, ...]


def _put(b: Board, i: int, mark: str) -> Board:
    return b[:i] + (mark,) + b[i + 1:]


@functools.cache
def v_star(b: Board) -> float:
    """Optimal X's win probability against the random O, X to move."""
    return max(q_star(b, m) for m in range(9) if not b[m])


@functools.cache
def q_star(b: Board, m: int) -> float:
    """X plays cell m (0-based), then optimally: its win probability."""
    b = _put(b, m, "X")
    if winner(b):
        return 1.0
    empty = [i for i in range(9) if not b[i]]
    if not empty:
        return 0.0
    total = 0.0
    for o in empty:
        b2 = _put(b, o, "O")
        if not winner(b2) and not all(b2):
            total += v_star(b2)
    return total / len(empty)


@dataclass
class Position:
    reach: float
    board: str
    value_lost: float  # reach x expected loss of value at this position
    plays: int  # most likely cell, 1..9
    p_suboptimal: float
    q: list[float | None]  # Q* of each cell, None when occupied


@dataclass
class Audit:
    checkpoint: str
    temperature: float
    min_reach: float
    outcomes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("win", "draw", "loss", "illegal"), 0.0))
    value_lost: float = 0.0
    value_lost_deterministic: float = 0.0
    positions: int = 0
    worst: list[Position] = field(default_factory=list)


class Policy:
    """A checkpoint as the agent loop drives it: the token ids of a game so far, and its move probabilities."""

    def __init__(self, checkpoint: str, temperature: float = 1.0) -> None:
        self.model, tok = load_model(checkpoint)
        self.model.eval()
        self.fmt = ChatFormat(tok)
        self.temperature = temperature
        digits = [tok.encode(str(d), add_special_tokens=False) for d in range(1, 10)]
        if any(len(d) != 1 for d in digits):
            raise SystemExit(f"{checkpoint}: the tokenizer splits a digit into several tokens; this audit reads one")
        self.digit_ids = [d[0] for d in digits]

    def start(self) -> list[int]:
        """The ids of the first turn (the empty board)."""
        return self.fmt.first_turn(TicTacToe.system_prompt, render_board(("",) * 9))

    def then(self, ids: list[int], move: int, board: Board) -> list[int]:
        """`ids` followed by the model's reply `move` (cell 0..8) and the next turn showing `board`."""
        return ids + [self.digit_ids[move], self.fmt.end_token_id] + self.fmt.next_turn(render_board(board))

    @torch.no_grad()
    def probs(self, ids: list[int]) -> list[float]:
        """The probability of each cell's digit (0..8) as the next token, at the temperature."""
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float() / self.temperature
        p = torch.softmax(logits, -1)
        return [float(p[i]) for i in self.digit_ids]


@dataclass
class Reply:
    """The policy's most likely third move after one line of play: X's most likely legal first and second moves."""
    x_first: int  # cells 1..9
    o_first: int
    x_second: int
    o_second: int
    x_third: int
    p_third: float
    q: float  # Q* of x_third
    v: float  # V* of the position (q < v: a mistake)


def replies(checkpoint: str, temperature: float = 1.0) -> list[Reply]:
    """For every first O reply to the policy's most likely opening, and every second O reply after its most
    likely legal answer to that, the policy's most likely third move (an occupied cell scores Q* 0), with
    optimal play's values: shows whether it reads O's threats or plays a fixed order (a position with a line
    already won is skipped)."""
    pol = Policy(checkpoint, temperature)
    out: list[Reply] = []
    ids, board = pol.start(), ("",) * 9
    first = _top(pol.probs(ids))
    for o1 in (i for i in range(9) if i != first):
        b1 = _put(_put(board, first, "X"), o1, "O")
        ids1 = pol.then(ids, first, b1)
        second = _top(pol.probs(ids1), [i for i in range(9) if not b1[i]])
        b2x = _put(b1, second, "X")
        for o2 in (i for i in range(9) if not b2x[i]):
            b2 = _put(b2x, o2, "O")
            if winner(b2x) or winner(b2):
                continue
            p = pol.probs(pol.then(ids1, second, b2))
            third = _top(p)
            out.append(Reply(first + 1, o1 + 1, second + 1, o2 + 1, third + 1, round(p[third], 3),
                             round(q_star(b2, third), 3) if not b2[third] else 0.0, round(v_star(b2), 3)))
    return out


def _top(p: list[float], among: list[int] | None = None) -> int:
    """The most likely cell (0..8), or the most likely of `among`."""
    return max(range(len(p)) if among is None else among, key=p.__getitem__)


def audit(checkpoint: str, *, temperature: float = 1.0, min_reach: float = 1e-5, worst: int = 10) -> Audit:
    pol = Policy(checkpoint, temperature)
    probs = pol.probs
    out = Audit(checkpoint, temperature, min_reach)
    seen: list[Position] = []

    def walk(ids: list[int], b: Board, reach: float) -> None:
        p = probs(ids)
        legal = [i for i in range(9) if not b[i]]
        illegal = 1.0 - sum(p[i] for i in legal)
        out.outcomes["illegal"] += reach * illegal
        v = v_star(b)
        lost = reach * (sum(p[i] * (v - q_star(b, i)) for i in legal) + illegal * v)
        top = _top(p)
        deterministic = top not in legal or q_star(b, top) < v - 1e-9
        out.value_lost += lost
        out.value_lost_deterministic += lost if deterministic else 0.0
        seen.append(Position(round(reach, 5), render_board(b).replace("\n", " | "), round(lost, 5), top + 1,
                             round(sum(p[i] for i in legal if q_star(b, i) < v - 1e-9), 4),
                             [round(q_star(b, i), 3) if i in legal else None for i in range(9)]))
        for i in legal:
            r = reach * p[i]
            if r < min_reach:  # finish the thin tail with optimal play
                out.outcomes["win"] += r * q_star(b, i)
                out.outcomes["loss"] += r * (1 - q_star(b, i))
                continue
            bx = _put(b, i, "X")
            if winner(bx):
                out.outcomes["win"] += r
                continue
            empty = [k for k in range(9) if not bx[k]]
            if not empty:
                out.outcomes["draw"] += r
                continue
            for o in empty:
                bo = _put(bx, o, "O")
                ro = r / len(empty)
                if winner(bo):
                    out.outcomes["loss"] += ro
                elif all(bo):
                    out.outcomes["draw"] += ro
                else:
                    walk(pol.then(ids, i, bo), bo, ro)

    empty: Board = ("",) * 9
    walk(pol.start(), empty, 1.0)
    out.outcomes = {k: round(v, 4) for k, v in out.outcomes.items()}
    out.value_lost, out.value_lost_deterministic = round(out.value_lost, 4), round(out.value_lost_deterministic, 4)
    out.positions = len(seen)
    out.worst = sorted(seen, key=lambda s: -s.value_lost)[:worst]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="model directories (a run's checkpoints/step_N)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the rollout's sampling temperature")
    ap.add_argument("--min-reach", type=float, default=1e-5, help="finish branches below this with optimal play")
    ap.add_argument("--worst", type=int, default=10, help="positions to list, by value lost")
    ap.add_argument("--json", default="", help="write the audits here ({audits: [...], note})")
    ap.add_argument("--note", default="", help="what the checkpoints are (stored with the audits)")
    ap.add_argument("--replies", action="store_true", help="instead of auditing, print each checkpoint's most "
                    "likely third move after every O reply along its own most likely first two moves, marking a "
                    "mistake (does it read O's threats, or play a fixed order?); with --json, add them to that "
                    "file's `replies` (by checkpoint), keeping its audits")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.replies:
        found = {}
        for ckpt in args.checkpoints:
            print(f"{ckpt}: third move after X's top first two moves (cells 1..9)")
            found[ckpt] = replies(ckpt, args.temperature)
            for r in found[ckpt]:
                mark = "" if r.q >= r.v - 1e-9 else f"   MISTAKE: Q* {r.q} < V* {r.v}"
                print(f"  X {r.x_first}, O {r.o_first}, X {r.x_second}, O {r.o_second} -> X {r.x_third} (p {r.p_third}){mark}")
        if args.json:  # kept beside the audits already in the file
            path = Path(args.json)
            d = json.loads(path.read_text()) if path.exists() else {}
            d.setdefault("replies", {}).update({k: [asdict(r) for r in v] for k, v in found.items()})
            path.write_text(json.dumps(d, indent=1) + "\n")
        return 0
    audits = []
    for ckpt in args.checkpoints:
        a = audit(ckpt, temperature=args.temperature, min_reach=args.min_reach, worst=args.worst)
        audits.append(a)
        print(f"{ckpt}: {a.outcomes}  value lost {a.value_lost} (deterministic mistakes {a.value_lost_deterministic}; "
              f"optimal play wins {v_star(('',) * 9):.4f}; {a.positions} positions)")
        for s in a.worst:
            print(f"  lost {s.value_lost:.4f} reach {s.reach:.4f} plays {s.plays} p(suboptimal) {s.p_suboptimal:.3f}  "
                  f"{s.board}  Q* {s.q}")
    if args.json:
        Path(args.json).write_text(json.dumps({"audits": [asdict(a) for a in audits], "note": args.note,
                                               "optimal_win_rate": round(v_star(("",) * 9), 4)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
