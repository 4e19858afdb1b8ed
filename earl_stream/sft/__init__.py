"""Supervised fine-tuning on the trainer pool's machinery.

`data` turns chat transcripts (JSONL of OpenAI-style messages) into token ids and an assistant-only
loss mask through the tokenizer's chat template; `step` runs one SFT optimizer step of one rank under
any trainer plan (dp / fsdp / tp / sp, packed micro-batches), with the same partition, attention,
vocab-parallel log-probs and gradient reduction as an RL step; `loop` is the training loop shared by
`earl-stream sft` (`earl_stream.cli.sft`) and the embedded model's warm start
(`earl_stream.model.warmstart`).
"""

from typing import Any

_HOMES = {"Example": "data", "TranscriptError": "data", "load_transcripts": "data", "tokenize_chat": "data",
          "SFTConfig": "config", "SFTReport": "loop", "run_sft": "loop", "SFTStepResult": "step", "sft_step": "step"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """The package's names, each imported from its module on first use: the command line imports
    `sft.config` without torch and transformers (every `earl-stream` command built its parser with them)."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
