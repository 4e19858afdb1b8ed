"""Models: loading a local Hugging Face directory, importing one (GGUF or HF), the tiny model, the warm start.

- `loading`: `load_model` / `load_tokenizer` / `load_vision_model` / `load_policy` (either) of a directory, one clear error per problem;
- `importing`: `import_model` (`earl-stream model import SRC OUT_DIR`), from a GGUF file or an HF directory;
- `tiny`: `init_model`, a small Qwen2 + byte-level BPE tokenizer built offline (tests, the default run);
- `warmstart`: supervised warm start of the tiny model on legal play of a game given as a parameter;
- `default`: the embedded default run's model, built once per machine under a file lock;
- `commands`: the `earl-stream model ...` subcommands; `export`: `model export` (a run's checkpoint as a model);
- `chat`: `ChatFormat`, rendering a conversation to the tokens a model sees (the agent loop, SFT, the endpoint);
- `vision`: `VisionChat`, the same with images (a vision-language model's processor); `tiny_vlm`: tiny ones;
- `lora`, `lora_export`, `lora_checks`, `moe*`: LoRA adapters and mixture-of-experts models.

Engines and the trainer use these; neither lives here. The names below are
imported on first use, so that `earl_stream.model.commands` (read by every CLI start) stays free of
torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from earl_stream.model.default import DEFAULT_GAME, DEFAULT_MODEL_NAME, cache_dir, default_model_dir, ensure_default_model
    from earl_stream.model.importing import ImportReport, import_model
    from earl_stream.model.loading import (
        check_model_dir,
        count_parameters,
        load_model,
        load_policy,
        load_tokenizer,
        load_vision_model,
        torch_dtype,
    )
    from earl_stream.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, init_model
    from earl_stream.model.warmstart import WarmStartReport, evaluate_game, warm_start

_WHERE = {
    "DEFAULT_GAME": "default", "DEFAULT_MODEL_NAME": "default", "cache_dir": "default",
    "default_model_dir": "default", "ensure_default_model": "default",
    "ImportReport": "importing", "import_model": "importing",
    "check_model_dir": "loading", "count_parameters": "loading", "load_model": "loading", "load_tokenizer": "loading",
    "load_policy": "loading", "load_vision_model": "loading", "torch_dtype": "loading",
    "CHAT_TEMPLATE": "tiny", "SPECIAL_TOKENS": "tiny", "init_model": "tiny",
    "WarmStartReport": "warmstart", "evaluate_game": "warmstart", "warm_start": "warmstart",
}

__all__ = [
    "CHAT_TEMPLATE", "DEFAULT_GAME", "DEFAULT_MODEL_NAME", "SPECIAL_TOKENS", "ImportReport", "WarmStartReport",
    "cache_dir", "check_model_dir", "count_parameters", "default_model_dir", "ensure_default_model", "evaluate_game",
    "import_model", "init_model", "load_model", "load_policy", "load_tokenizer", "load_vision_model", "torch_dtype", "warm_start",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
