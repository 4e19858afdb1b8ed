"""ChatFormat: token-level multi-turn rendering equals the chat template's own rendering."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from earl_stream.errors import ModelError
from earl_stream.model import CHAT_TEMPLATE, init_model, load_tokenizer
from earl_stream.model.chat import ChatFormat

SYSTEM = "Play Tic-Tac-Toe as X. Reply with the number of an empty cell."
B0 = "1 2 3\n4 5 6\n7 8 9"
B1 = "X 2 3\n4 O 6\n7 8 9"
B2 = "X X 3\n4 O 6\n7 O 9"

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path: Path = init_model(tmp_path_factory.mktemp("chat_model"), hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, intermediate_size=64)
    return load_tokenizer(path)


def encode_render(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], gen: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    return list(tok.encode(text, add_special_tokens=False))


def check_multi_turn(tok: PreTrainedTokenizerBase, system: str | None) -> None:
    fmt = ChatFormat(tok)
    replies = ["5", "3"]
    ids = fmt.first_turn(system, B0)
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": B0})
    assert ids == encode_render(tok, messages, gen=True)
    for reply, board in zip(replies, (B1, B2)):
        ids += list(tok.encode(reply, add_special_tokens=False)) + [fmt.end_token_id]
        messages.append({"role": "assistant", "content": reply})
        full = encode_render(tok, messages, gen=False)
        # The rendering of a conversation that ends with the reply is our tokens, then only what
        # the template puts after an end marker, which for us opens the next turn.
        assert full[: len(ids)] == ids
        nxt = fmt.next_turn(board)
        assert nxt[: len(full) - len(ids)] == full[len(ids):]
        ids += nxt
        messages.append({"role": "user", "content": board})
        assert ids == encode_render(tok, messages, gen=True)


def test_our_template_token_for_token(tokenizer: PreTrainedTokenizerBase) -> None:
    check_multi_turn(tokenizer, SYSTEM)
    check_multi_turn(tokenizer, None)
    fmt = ChatFormat(tokenizer)
    assert fmt.end_token_id == tokenizer.convert_tokens_to_ids("<|end|>")
    assert fmt.stop_token_ids == frozenset({fmt.end_token_id, tokenizer.eos_token_id})
    assert tokenizer.decode(fmt.next_turn(B1)) == f"\n<|user|>\n{B1}<|end|>\n<|assistant|>\n"


def test_exact_sequence_spelled_out(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = ChatFormat(tokenizer)
    ids = fmt.first_turn(SYSTEM, B0) + tokenizer.encode("5", add_special_tokens=False) + [fmt.end_token_id]
    ids += fmt.next_turn(B1) + tokenizer.encode("3", add_special_tokens=False) + [fmt.end_token_id]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": B0},
         {"role": "assistant", "content": "5"}, {"role": "user", "content": B1},
         {"role": "assistant", "content": "3"}], tokenize=False)
    assert text == (f"<|system|>\n{SYSTEM}<|end|>\n<|user|>\n{B0}<|end|>\n<|assistant|>\n5<|end|>\n"
                    f"<|user|>\n{B1}<|end|>\n<|assistant|>\n3<|end|>\n")
    assert ids + tokenizer.encode("\n", add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("template,tokens,end", [
    (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
])
def test_other_templates(tokenizer: PreTrainedTokenizerBase, template: str, tokens: list[str], end: str) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = template
    assert ChatFormat(tok).end_token_id == tok.convert_tokens_to_ids(end)
    check_multi_turn(tok, SYSTEM)
    check_multi_turn(tok, None)


def test_round_trip_and_one_token_per_cell(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(0)
    for _ in range(200):
        cells = [str(i + 1) for i in range(9)]
        for n, i in enumerate(rng.sample(range(9), rng.randint(0, 9))):
            cells[i] = "XO"[n % 2]
        board = "\n".join(" ".join(cells[r * 3: r * 3 + 3]) for r in range(3))
        ids = tokenizer.encode(board, add_special_tokens=False)
        assert tokenizer.decode(ids) == board
        pieces = [tokenizer.decode([i]).strip() for i in ids]
        assert [p for p in pieces if p] == cells  # every cell is exactly one token
    for text in ["What is 12 + 7? The answer is 19.", "  spaces  and\n\nnewlines ", "ünïcode ✓"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for digit in "0123456789":
        assert len(tokenizer.encode(digit, add_special_tokens=False)) == 1


def test_reply_text_cache_and_errors(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = ChatFormat(tokenizer)
    five = tokenizer.encode("5", add_special_tokens=False)
    assert fmt.reply_text(five + [fmt.end_token_id]) == "5"
    assert fmt.reply_text(five + [tokenizer.eos_token_id]) == "5"
    first = fmt.next_turn(B1)
    first.append(-1)
    assert fmt.next_turn(B1)[-1] != -1  # cached tuples are never handed out to be mutated
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ModelError, match="chat_template"):
        ChatFormat(bare)
    assert CHAT_TEMPLATE == tokenizer.chat_template
