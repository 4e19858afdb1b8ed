"""bench/policy_audit.py: optimal play's values by hand, and an audit that accounts for every game."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from policy_audit import audit, q_star, replies, v_star  # noqa: E402


def _board(text: str) -> tuple[str, ...]:
    return tuple("" if c == "." else c for c in text)


def test_optimal_values_by_hand() -> None:
    # X . O / . X . / . . O, X to move. Blocking at 6 threatens 4-5-6: O misses 4 with 3/4 (X wins), else X
    # threatens 2-5-8 and O misses 1 time in 2: 3/4 + 1/4 * 1/2 = 0.875
    b = _board("X.O.X...O")
    assert q_star(b, 5) == pytest.approx(0.875)
    # X at 7 instead threatens 1-4-7: O takes 2 or 8 (1/2, X wins), 6 (1/4, O wins) or 4 (1/4: X must block 6
    # and the game is drawn): 0.5
    assert q_star(b, 6) == pytest.approx(0.5)
    assert v_star(b) == pytest.approx(0.875)
    assert q_star(_board("XX..O.O.."), 2) == 1.0  # a win in one
    # from the empty board, against a uniformly random O
    assert v_star(("",) * 9) == pytest.approx(0.9948, abs=1e-4)


def test_audit_accounts_for_every_game(tiny_model_dir: Path) -> None:
    a = audit(str(tiny_model_dir), min_reach=2e-3, worst=3)
    assert sum(a.outcomes.values()) == pytest.approx(1.0, abs=1e-3)
    assert 0.0 <= a.value_lost_deterministic <= a.value_lost + 1e-9
    assert len(a.worst) == 3 and a.worst[0].value_lost >= a.worst[-1].value_lost


def test_replies_follow_the_policys_own_line(tiny_model_dir: Path) -> None:
    got = replies(str(tiny_model_dir))
    assert {r.o_first for r in got} == set(range(1, 10)) - {got[0].x_first}  # every first O reply
    for r in got:
        assert len({r.x_first, r.o_first, r.x_second, r.o_second}) == 4 and 0 < r.p_third <= 1
        board = ["X" if c in (r.x_first, r.x_second) else "O" if c in (r.o_first, r.o_second) else ""
                 for c in range(1, 10)]
        assert r.v == pytest.approx(v_star(tuple(board)), abs=1e-3)
        want = 0.0 if board[r.x_third - 1] else q_star(tuple(board), r.x_third - 1)
        assert r.q == pytest.approx(want, abs=1e-3)
