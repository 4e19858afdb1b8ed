"""`rollout.batch_invariant` in the built-in engine: a seeded request samples bitwise the same tokens and
log-probs whichever requests share its batch, in what order, and whether it joined a batch already
decoding; multi-turn requests reusing kept KV included; through the fast decoder and through the HF
forward. Without it the same compositions differ in the last float bits (the reason the mode exists)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.workers.engines import GenerateRequest, TorchEngine

torch.set_num_threads(1)


def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def requests(turn: int = 0, keep: bool = False) -> list[GenerateRequest]:
    """Nine seeded requests of 3-29 prompt tokens; `keep`: each keeps its KV for a next turn (cache_key)."""
    rnd = random.Random(turn)
    return [GenerateRequest([rnd.randrange(1, 256) for _ in range(rnd.randrange(3, 30))], 12, temperature=1.0,
                            seed=100 + i, cache_key=f"episode-{i}" if keep else None) for i in range(9)]


Outcome = dict[int, tuple[list[int], list[float]]]


def play(engine: TorchEngine, reqs: list[GenerateRequest], groups: list[list[int]]) -> Outcome:
    out: Outcome = {}
    for group in groups:
        for i, result in zip(group, engine.generate([reqs[i] for i in group])):
            out[i] = (list(result.token_ids), list(result.logprobs))
    return out


def joined_mid_batch(engine: TorchEngine, reqs: list[GenerateRequest]) -> Outcome:
    rows = engine.submit(reqs[:4])
    with engine._lock:  # noqa: SLF001 - drive a few decode steps by hand, then let the others join
        for _ in range(4):
            engine.step()
    rows += engine.submit(reqs[4:])
    engine.drive()
    return {i: (list(r.result.token_ids), list(r.result.logprobs)) for i, r in enumerate(rows)}


COMPOSITIONS = {"one batch": [list(range(9))], "two batches": [[0, 1, 2, 3], [4, 5, 6, 7, 8]],
                "one by one": [[i] for i in range(9)], "reversed": [list(range(8, -1, -1))],
                "odd sizes": [[8, 2, 5], [0, 7], [1, 3, 4, 6]]}


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decoder", "hf-forward"])
def test_a_row_samples_the_same_whatever_its_batch(fast: bool) -> None:
    engine = TorchEngine(model(), fast_forward=fast, batch_invariant=True)
    reqs = requests()
    reference = play(engine, reqs, COMPOSITIONS["one batch"])
    for name, groups in COMPOSITIONS.items():
        assert play(engine, reqs, groups) == reference, name
    if fast:  # the HF path runs batch to completion: nothing joins a running batch there
        assert joined_mid_batch(engine, reqs) == reference


def test_a_second_turn_reusing_kept_kv_samples_the_same_whatever_its_batch() -> None:
    """Turn 2 extends turn 1's context: its kept KV is reused (prefill of the new tokens only), in batches of
    other shapes than turn 1's and each other's."""
    outcomes = []
    for first, second in [(COMPOSITIONS["one batch"], COMPOSITIONS["odd sizes"]),
                          (COMPOSITIONS["one by one"], COMPOSITIONS["two batches"])]:
        engine = TorchEngine(model(), batch_invariant=True)
        reqs = requests(keep=True)
        turn1 = play(engine, reqs, first)
        follow = requests(turn=1)
        reqs2 = [GenerateRequest([*r.prompt_ids, *turn1[i][0], *f.prompt_ids[:5]], 8, temperature=1.0, seed=200 + i,
                                 cache_key=r.cache_key) for i, (r, f) in enumerate(zip(reqs, follow))]
        turn2 = play(engine, reqs2, second)
        assert engine.stats.reused_tokens > 0  # the kept KV was used, not prefilled again
        outcomes.append((turn1, turn2))
    assert outcomes[0] == outcomes[1]


def test_without_it_batching_moves_log_probs() -> None:
    """The premise: the default engine's log-probs depend on the batch (the last float bits), which is what
    makes a seeded sample depend on timing at all."""
    engine = TorchEngine(model())
    reqs = requests()
    reference = play(engine, reqs, COMPOSITIONS["one batch"])
    alone = play(engine, reqs, COMPOSITIONS["one by one"])
    assert any(alone[i][1] != reference[i][1] for i in range(9))


def test_the_config_resolves_and_refuses_it() -> None:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    assert load_config(None, ["trainer.max_staleness=0"]).rollout.invariant_batches(0)
    assert not load_config(None, []).rollout.invariant_batches(1)  # auto: off where staleness is allowed
    assert load_config(None, ["rollout.batch_invariant=always"]).rollout.invariant_batches(1)
    assert not load_config(None, ["rollout.batch_invariant=never"]).rollout.invariant_batches(0)
    auto_vllm = load_config(None, ["rollout.engine=sglang", "trainer.max_staleness=0"]).rollout
    assert not auto_vllm.invariant_batches(0)  # auto never asks a backend that cannot
    with pytest.raises(ConfigError, match="rollout.batch_invariant=always is not available with rollout.engine=sglang"):
        load_config(None, ["rollout.engine=sglang", "rollout.batch_invariant=always"])
