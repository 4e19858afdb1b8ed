"""The model an evaluation runs, from whatever the user points at: a Hugging Face model directory, a run
directory (its latest checkpoint), or one trainer checkpoint of any run (`workers.checkpoint`).

- A full fine-tuning checkpoint, dense or sharded (FSDP, tensor parallel), holds a Hugging Face export of
  the whole model (rank 0 gathers a sharded one when it writes it): it loads as a model directory.
- A LoRA checkpoint holds `adapter/`, a PEFT adapter over a base named in its config (`model.lora_export`):
  the adapters are merged into the base in memory (the base's directory must exist here, or `base` names
  it), with the checkpoint's tokenizer where it holds one.
- A PEFT adapter directory (`earl-stream model export` without --merge) loads the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from earl_stream.errors import ModelError
from earl_stream.model.lora_export import ADAPTER_CONFIG, ADAPTER_DIR


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    kind: str  # "model", "checkpoint", "lora checkpoint", "adapter"
    path: Path  # the directory the weights came from


def _checkpoint_of(path: Path) -> Path:
    """A run directory's latest checkpoint; any other directory as it is."""
    if (path / "checkpoints" / "latest").exists():
        from earl_stream.workers.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(path)
        assert ckpt is not None
        return ckpt
    return path


def _merged(adapter: Path, tokenizer_dir: Path | None, base: str) -> tuple[Any, Any]:
    from peft import PeftModel

    from earl_stream.model.loading import load_model, load_tokenizer

    base = base or str(json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    if not base or not Path(base).is_dir():
        raise ModelError(f"{adapter / ADAPTER_CONFIG} names the base model {base!r}, which is not a directory here: "
                         "pass --base DIR")
    model, tokenizer = load_model(base)
    merged: Any = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(tokenizer_dir)
    return merged.eval(), tokenizer


def load_for_eval(path: str | Path, *, base: str = "") -> LoadedModel:
    """The model and tokenizer at `path` (see the module docstring). ModelError says what is missing."""
    from earl_stream.model.loading import check_model_dir, load_model

    p = _checkpoint_of(check_model_dir(path))
    if (p / ADAPTER_DIR / ADAPTER_CONFIG).is_file():
        model, tokenizer = _merged(p / ADAPTER_DIR, p, base)
        return LoadedModel(model, tokenizer, "lora checkpoint", p)
    if (p / ADAPTER_CONFIG).is_file():
        model, tokenizer = _merged(p, p, base)
        return LoadedModel(model, tokenizer, "adapter", p)
    if not (p / "config.json").is_file() and (p / "dcp").is_dir():
        raise ModelError(f"{p} is a trainer checkpoint without a Hugging Face export (it was written without a "
                         "tokenizer); evaluate a checkpoint written by `up` or a worker, or its run directory")
    model, tokenizer = load_model(p)
    return LoadedModel(model, tokenizer, "checkpoint" if (p / "dcp").is_dir() else "model", p)
