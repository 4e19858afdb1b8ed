"""What the trainer lays out in any dense family (`workers.tensor_parallel`), and the per-row attention
core honouring sliding windows (`workers.packed_attention.segment_attention`), on one process.

Every family of `model.tiny_families` has its decoder layers found, a tensor-parallel plan derived from
its own `base_model_tp_plan` and no refusal; a model whose config the trainer cannot honour is refused
with the reason. The multi-rank math is `tests/test_families_parallel.py`'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from earl_stream.errors import ConfigError
from earl_stream.model.tiny_families import FAMILIES, init_family_model
from earl_stream.workers.packed_attention import segment_attention
from earl_stream.workers.tensor_parallel import HeadwiseReplicate, decoder_layers, family_problems, tp_plan


def test_every_family_has_its_layers_found_and_a_tp_plan_from_its_own(tmp_path: Path) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for family in FAMILIES:
        model = transformers.AutoModelForCausalLM.from_pretrained(init_family_model(tmp_path / family, family=family,
                                                                                    num_layers=3))
        layers = decoder_layers(model)
        assert len(layers) == 3 and {type(m).__name__ for m in layers} <= set(model._no_split_modules), family
        assert family_problems(model.config, tp=2, sp=2, packing=True) == [], family
        plan = tp_plan(model)
        assert isinstance(plan["model.embed_tokens"], RowwiseParallel) and isinstance(plan["lm_head"], ColwiseParallel)
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
        assert linears <= set(plan), f"{family}: {sorted(linears - set(plan))} left whole under tp"
        norms = {n for n, s in plan.items() if isinstance(s, HeadwiseReplicate)}
        assert bool(norms) == (family in ("qwen3", "gemma3_text")), (family, norms)


def test_a_model_the_trainer_cannot_lay_out_is_refused_with_the_reason() -> None:
    bloom = transformers.BloomConfig()
    problems = family_problems(bloom, tp=2, sp=2)
    assert any("no tensor-parallel plan" in p for p in problems), problems
    assert any("attention interface" in p for p in problems), problems
    assert any("soft-caps" in p for p in family_problems(transformers.Gemma2Config(), packing=True))
    odd = transformers.Qwen3Config()
    odd.base_model_tp_plan = {"layers.*.self_attn.q_proj": "local_colwise"}
    assert any("'local_colwise'" in p for p in family_problems(odd, tp=2))
    assert family_problems(odd, tp=1) == []
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, head_dim=16))
    model.config.base_model_tp_plan = {"layers.*.self_attn.qkv_proj": "colwise"}
    with pytest.raises(ConfigError, match="qkv_proj"):
        tp_plan(model)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], window: int | None
               ) -> torch.Tensor:
    """Each segment alone, scores masked causally and to `window` positions back (transformers' rule)."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        s = (q[:, :, a:b] @ k[:, :, a:b].transpose(-1, -2)) * q.shape[-1] ** -0.5
        i = torch.arange(b - a)
        d = i[:, None] - i[None, :]
        keep = (d >= 0) & (d < window) if window else d >= 0
        out.append((s.masked_fill(~keep, float("-inf")).softmax(-1) @ v[:, :, a:b]).transpose(1, 2))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("base", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 4])
def test_segment_attention_keeps_rows_apart_and_honours_a_sliding_window(base: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=gen) for _ in range(3))
    bounds = [0, 11, 17, 30]
    module = type("M", (), {"num_key_value_groups": 1, "training": False, "is_causal": True})()
    got = segment_attention(module, q, k, v, bounds, base=base, sliding_window=window)
    torch.testing.assert_close(got, _reference(q, k, v, bounds, window), rtol=1e-5, atol=1e-6)
    if window:
        assert not torch.allclose(got, _reference(q, k, v, bounds, None), atol=1e-3), "the window changed nothing"
