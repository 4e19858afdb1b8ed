"""The tiny, fully offline Hugging Face model of tests and of the embedded default run.

This module owns building a small Qwen2 causal LM plus a byte-level BPE tokenizer with a chat
template (`init_model`), with no download: the tokenizer is trained here on generated text. Loading
any model directory is `earl_stream.model.loading`'s job; teaching the tiny model a game before RL
is `earl_stream.model.warmstart`'s.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from earl_stream.errors import ModelError

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "init_model"]

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

# The corpus the tokenizer is trained on includes the Tic-Tac-Toe prompt and boards (the embedded
# default's game); changing any of it changes the tokenizer, so bump the default model's name.
_TICTACTOE_PROMPT = "Play Tic-Tac-Toe as X. Reply with the number of an empty cell."
# Copied from transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (5.19).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


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
