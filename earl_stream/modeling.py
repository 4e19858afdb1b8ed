"""Tiny Hugging Face models that load exactly like real ones, and the default model's cache.

This module owns: building a small Qwen2 causal LM plus a byte-level BPE tokenizer with a chat
template entirely offline (`init_model`), loading any local causal-LM directory with clear errors
(`load_model`, `load_tokenizer`), and the once-per-machine default model (`ensure_default_model`:
init + supervised warm start, built under a file lock). The warm start itself is in
`earl_stream.warmstart`; token-level chat rendering is in `earl_stream.chat`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from earl_stream.errors import ModelError

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_NAME",
    "SPECIAL_TOKENS",
    "default_model_dir",
    "ensure_default_model",
    "init_model",
    "load_model",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

PAD, EOS, SYSTEM, USER, ASSISTANT, END = (
    "<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
)
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, SYSTEM, USER, ASSISTANT, END)

# <|role|>\n{content}<|end|>\n per message; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# Bump the version whenever the build recipe changes: a cached older build is never reused.
DEFAULT_MODEL_NAME = "tictactoe-warm-v3"
_TICTACTOE_PROMPT = "Play Tic-Tac-Toe as X. Reply with the number of an empty cell."
# Copied from transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (5.19).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# ------------------------------------------------------------------------------------ tokenizer

_WORDS = (
    "the a an is are was were be to of and or not in on at for with as by from this that it you "
    "your we they he she I my our what which who when where why how yes no number numbers answer "
    "question reply replies move moves game games play player win wins lose loses draw board cell "
    "cells empty row column first second next last turn turns guess higher lower correct wrong "
    "try again tool call result value sum plus minus times equals count word words letter letters "
    "step steps goal reward done start end left right up down one two three four five six seven "
    "eight nine ten hundred small large good bad please think then so because only each every "
    "X O Tic Tac Toe Reply Play The You What Answer Guess Question Move Your Is"
).split()


def _board_text(rng: random.Random) -> str:
    marks = rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 8, 9))
    cells = [str(i + 1) for i in range(9)]
    for n, i in enumerate(rng.sample(range(9), marks)):
        cells[i] = "XO"[n % 2]
    return "\n".join(" ".join(cells[r * 3:r * 3 + 3]) for r in range(3))


def _corpus(n_lines: int = 6000) -> Iterator[str]:
    """Deterministic training text: boards, digits, the game prompt, simple English and arithmetic."""
    rng = random.Random(0)
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            yield _board_text(rng)
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op, val = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
            yield f"What is {a} {op} {b}? The answer is {val}."
        elif kind == 2:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            yield " ".join(words).capitalize() + rng.choice((".", "?", "!", ",", ":"))
        else:
            yield _TICTACTOE_PROMPT + " " + str(rng.randint(1, 9))
    yield '{"name": "calculator", "arguments": {"expression": "1 + 2"}} [ ] ( ) < > = _ - # @ % & ; \' "'


def _train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # transformers 5 loads every model_type=qwen2 directory with Qwen2Tokenizer, which replaces the
    # saved normalizer and pre-tokenizer with these; training with the very same ones keeps the
    # tokenizer identical at init time, after AutoTokenizer, and in vLLM. `\p{N}` alone splits every
    # digit (so every board cell) into its own pre-token, as Digits(individual_digits=True) would.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_model(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    seed: int = 0,
    initializer_range: float = 0.1,
) -> Path:
    """Write a randomly initialised Qwen2 causal LM and its tokenizer to `out_dir`; return the path.

    The tokenizer is a byte-level BPE (`vocab_size` entries incl. 6 special tokens) in which every
    digit is its own token. Weights are float32, untied embeddings; the same `seed` gives the same
    bytes on disk. The defaults give ~1.1M parameters.

    `initializer_range` is the std of the normal init of every linear and embedding weight. The
    default 0.1 (~1/sqrt(hidden_size) at 128) instead of Qwen2's 0.02: at 0.02 the tiny model sits
    on a long plateau before it learns to read the board in the warm start (legal moves ~0.78 after
    200 steps vs ~0.95 after 300 steps at 0.1).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise ModelError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("initialised %s (%d params, vocab %d) in %s", type(model).__name__,
                model.num_parameters(), len(tokenizer), out)
    return out


# ------------------------------------------------------------------------------------- loading

def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, so a ModelError stays one line however chatty the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}"


def _check_model_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model directory {p} does not exist (create one with earl_stream.modeling.init_model)")
    if not p.is_dir():
        raise ModelError(f"model path {p} is not a directory")
    return p


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in the local directory `path` (never from a hub)."""
    p = _check_model_dir(path)
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"model directory {p} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer in {p}: {_one_line(exc)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the causal LM and tokenizer in the local directory `path`, model in eval mode.

    Raises ModelError (one line) for a missing directory, a directory without config.json, a
    config that is not a causal LM, a missing tokenizer, or unreadable weights.
    """
    p = _check_model_dir(path)
    if not (p / "config.json").is_file():
        raise ModelError(f"model directory {p} has no config.json; it is not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot read {p / 'config.json'}: {_one_line(exc)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"model in {p} has model_type {config.model_type!r}, which is not a causal language model"
        )
    tokenizer = load_tokenizer(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise ModelError(f"cannot load the model weights in {p}: {_one_line(exc)}") from None
    model.eval()
    return model, tokenizer


# ------------------------------------------------------------------------------- default model

def default_model_dir() -> Path:
    """`$EARL_STREAM_CACHE/models/tictactoe-warm-v3` (cache default `~/.cache/earl_stream`)."""
    root = os.environ.get("EARL_STREAM_CACHE") or Path.home() / ".cache" / "earl_stream"
    return Path(root).expanduser() / "models" / DEFAULT_MODEL_NAME


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_default_model(*, warm_start_steps: int = 450, warm_start_seconds: float = 900) -> Path:
    """Return `default_model_dir()`, building it first (init + warm start) if it does not exist.

    Built in a temporary sibling directory and renamed into place under an fcntl lock, so
    concurrent callers wait for one build and no one ever sees a half-written model.
    """
    final = default_model_dir()
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / "config.json").is_file():
            return final
        from earl_stream.warmstart import warm_start  # warmstart imports this module

        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
        try:
            started = time.monotonic()
            init_model(tmp)
            # a fixed number of steps (not a time budget): the same model on a busy or an idle machine
            report = warm_start(tmp, seconds=warm_start_seconds, max_steps=warm_start_steps, batch_size=16)
            meta: dict[str, Any] = {"name": DEFAULT_MODEL_NAME, "warm_start": report.as_dict(),
                                    "build_seconds": round(time.monotonic() - started, 1)}
            (tmp / "earl_stream_model.json").write_text(json.dumps(meta, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cached model is meant to be shared
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("built the default model in %s", final)
    return final


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of `model` (all of them, trainable or not)."""
    return sum(p.numel() for p in model.parameters())

