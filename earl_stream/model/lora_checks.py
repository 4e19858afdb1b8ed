"""Load-time checks of `model.lora`: what cannot work with the model and the rest of the config.

`earl_stream.config.validate` calls `lora_problems` when `model.lora.enabled` and reports its lines with every
other problem in one `ConfigError`. The model's architecture is built on the meta device from its
`config.json` (no weights read, no memory), so a target that matches none of its linear layers is
named before any process starts. How adapters are made and moved is `model.lora`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from earl_stream.errors import ModelError

if TYPE_CHECKING:
    from earl_stream.config.run import RunConfig

# engines that apply a published adapter version: the built-in one merges it into its copy of the base; vLLM
# serves it as a LoRA adapter or merges and reloads (workers.engines.vllm_lora)
ADAPTER_ENGINES = ("torch", "vllm")
# why the others cannot (SGLang's LoRA path would be written blind: it cannot start without CUDA here)
_NO_ADAPTERS = {"sglang": "its LoRA path (load_lora_adapter, or merge and reload) is not built: SGLang cannot run "
                          "on the CPU machines this project is tested on, so it would ship untested"}
# the projections of the Llama / Qwen2 / Mistral decoder layer, which the embedded tiny model (Qwen2) has
_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_problems(cfg: RunConfig) -> list[str]:
    """One line per problem of `cfg.model.lora` with this model and engine ([] when all is well)."""
    lora = cfg.model.lora
    out: list[str] = []
    if lora.rank is None or lora.alpha is None or lora.target_modules is None:
        return out  # a field already failed to parse: that error says it
    if lora.rank <= 0:
        out.append(f"model.lora.rank={lora.rank} must be >= 1")
    if lora.dropout is not None and not 0 <= lora.dropout < 1:
        out.append(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        out.append("model.lora.target_modules is empty: name at least one linear layer")
    if cfg.rollout.engine not in ADAPTER_ENGINES:
        why = _NO_ADAPTERS.get(cfg.rollout.engine, "it has no way to apply adapter versions")
        out.append(f"model.lora: rollout.engine={cfg.rollout.engine} cannot apply LoRA adapters in this version: {why} "
                   f"(engines that can: {', '.join(ADAPTER_ENGINES)})")
    try:
        from earl_stream.model.hub import local_model_dir

        folder = local_model_dir(cfg.model)
        linears = linear_module_names(str(folder) if folder else "")
    except (OSError, ValueError, KeyError, ModelError) as exc:
        out.append(f"model.lora: cannot read the architecture of model.path={cfg.model.path!r}: {exc}")
        return out
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in linears})
        out.append(f"model.lora.target_modules: {', '.join(missing)} match no linear layer of the model; its "
                   f"linear layers are {', '.join(known)}")
    return out


def linear_module_names(path: str) -> list[str]:
    """Dotted names of the `nn.Linear` modules of the model at `path` (the embedded model: the Llama
    family's projections), from its config alone."""
    if not path:
        return [f"model.layers.0.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}"
                for n in _LLAMA_LINEARS] + ["lm_head"]
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise OSError(f"{config_file} does not exist")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    json.loads(config_file.read_text())  # a readable error for a broken file before transformers'
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
