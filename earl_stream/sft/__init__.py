"""Supervised fine-tuning on the trainer pool's machinery.

`data` turns chat transcripts (JSONL of OpenAI-style messages) into token ids and an assistant-only
loss mask through the tokenizer's chat template; `step` runs one SFT optimizer step of one rank under
any trainer plan (dp / fsdp / tp / sp, packed micro-batches), with the same partition, attention,
vocab-parallel log-probs and gradient reduction as an RL step; `loop` is the training loop shared by
`earl-stream sft` (`earl_stream.cli.sft`) and the embedded model's warm start
(`earl_stream.model.warmstart`).
"""

from earl_stream.sft.data import Example, TranscriptError, load_transcripts, tokenize_chat
from earl_stream.sft.loop import SFTConfig, SFTReport, run_sft
from earl_stream.sft.step import SFTStepResult, sft_step

__all__ = ["Example", "SFTConfig", "SFTReport", "SFTStepResult", "TranscriptError", "load_transcripts", "run_sft",
           "sft_step", "tokenize_chat"]
