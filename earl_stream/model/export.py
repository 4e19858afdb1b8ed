"""`earl-stream model export`: the latest checkpoint of a run as a model directory a Hugging Face user loads.

A LoRA run's checkpoint leaves as its PEFT adapter directory or, with merge, as a whole model (base + the
adapters); a full fine-tuning run's checkpoint is already a model directory and is copied. What a checkpoint
holds is `earl_stream.workers.checkpoint`'s (and, for the adapters, `earl_stream.model.lora_export`'s).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from earl_stream.errors import ModelError
from earl_stream.model.lora_export import ADAPTER_CONFIG, ADAPTER_DIR
from earl_stream.progress import Report
from earl_stream.workers.checkpoint import latest_checkpoint

__all__ = ["export_model"]

log = logging.getLogger(__name__)


def export_model(run_dir: str | Path, out: str | Path, *, merge: bool = False, base: str = "",
                 overwrite: bool = False, progress: Report | None = None) -> Path:
    """The latest checkpoint of `run_dir` as a PEFT adapter directory, or (merge) a whole Hugging Face
    model directory: base + alpha / r x B A in every adapted layer, plus the tokenizer. A full
    fine-tuning run's checkpoint is already a model directory: it is copied (merge or not). `progress`
    gets each file copied, or each stage of a merge (load the base, merge, save, tokenizer)."""
    step = progress or (lambda done, total, note: None)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ModelError(f"{run_dir} has no checkpoint (no checkpoints/latest)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ModelError(f"{out} exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(out)
    adapter = ckpt / ADAPTER_DIR
    if not adapter.is_dir():
        _copy_tree(ckpt, out, step, shutil.ignore_patterns("dcp", "run_state.pt", "*.tmp"))
        log.info("%s is a full model checkpoint: copied its Hugging Face export to %s", ckpt, out)
        return out
    if not merge:
        _copy_tree(adapter, out, step)
        return out
    return _merge(adapter, out, base or _base_of(adapter), ckpt, step)


def _copy_tree(src: Path, dst: Path, step: Report, ignore: Callable[[str, list[str]], set[str]] | None = None) -> None:
    """shutil.copytree, reporting each file copied."""
    total = 0
    for folder, dirs, files in os.walk(src):
        skipped = ignore(folder, dirs + files) if ignore else set()
        dirs[:] = [d for d in dirs if d not in skipped]
        total += sum(f not in skipped for f in files)
    done = 0

    def copy(a: str, b: str) -> str:
        nonlocal done
        shutil.copy2(a, b)
        done += 1
        step(done, total, Path(a).name)
        return b

    step(0, total, "")
    shutil.copytree(src, dst, ignore=ignore, copy_function=copy, dirs_exist_ok=True)


def _base_of(adapter: Path) -> str:
    base = str(json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    if not base or not Path(base).is_dir():
        raise ModelError(f"{adapter / ADAPTER_CONFIG} names the base model {base!r}, which is not a directory here: "
                         "pass --base DIR")
    return base


def _merge(adapter: Path, out: Path, base: str, ckpt: Path, step: Report) -> Path:
    from peft import PeftModel

    from earl_stream.model.loading import load_model, load_tokenizer

    step(0, 4, f"loading the base {Path(base).name}")
    model, _ = load_model(base)
    step(1, 4, "merging the adapter")
    merged: Any = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    step(2, 4, "saving the merged model")
    merged.save_pretrained(str(out))
    step(3, 4, "saving the tokenizer")
    tokenizer_dir = ckpt if (ckpt / "tokenizer_config.json").exists() else Path(base)
    load_tokenizer(str(tokenizer_dir)).save_pretrained(str(out))
    step(4, 4, "merged")
    log.info("merged the adapter of %s into %s: %s", ckpt, base, out)
    return out
