"""The long-recall environment: scoring, episode length, the curriculum (per-seed levels, replay within
a process, same episode for every member of a group) and what a context grows to with the tiny
model's tokenizer; it resolves by its registered name."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from earl_stream_envs.long_recall import LongRecall

from earl_stream.env import env_options, env_reset, env_step, make_env
from earl_stream.errors import EnvError


async def _play(env: LongRecall, seed: int, answer: str | None = None) -> tuple[list[str], object]:
    """Acknowledge every fact turn, then reply `answer` (default: the right value, read off the facts)."""
    pages = [await env_reset(env, seed)]
    while True:
        result = await env_step(env, "ok")
        pages.append(result.observation)
        if result.observation.startswith("What is"):
            break
    key = re.match(r"What is (\w+)\?", pages[-1]).group(1)
    facts = dict(f.split("=") for page in pages[:-1] for f in page.removeprefix("Facts: ").split())
    final = await env_step(env, answer if answer is not None else facts[key])
    return pages, final


def test_right_answer_scores_one_and_wrong_or_missing_zero() -> None:
    async def go() -> None:
        env = LongRecall(turns=3)
        pages, final = await _play(env, 11)
        assert len(pages) == 4 and all(p.startswith("Facts: ") and len(p.split()) == 5 for p in pages[:3])
        assert final.done and final.reward == 1.0 and final.info["outcome"] == "correct"
        assert final.info["turns"] == 3 and final.info["level"] == 0
        json.dumps(final.info)
        expected = final.info["expected"]
        _, wrong = await _play(env, 11, str(expected % 9 + 1))
        assert wrong.reward == 0.0 and wrong.info["outcome"] == "wrong"
        _, none = await _play(env, 11, "no idea")
        assert none.reward == 0.0 and none.info["outcome"] == "no_answer"
        with pytest.raises(EnvError):
            await env_step(env, "1")

    asyncio.run(go())


def test_curriculum_grows_per_new_seed_and_replays_a_seen_seed() -> None:
    async def go() -> None:
        params = {"turns": 2, "max_turns": 5, "grow_every": 2, "facts_per_turn": 3}
        seeds = [1000 + i for i in range(10)]
        levels = []
        for seed in seeds:
            members = [LongRecall(**params) for _ in range(4)]  # a GRPO group: same seed, same episode
            firsts = {await env_reset(m, seed) for m in members}
            assert len(firsts) == 1
            _, final = await _play(members[0], seed)
            levels.append(final.info["level"])
            assert final.info["turns"] == min(5, 2 + final.info["level"])
        assert levels == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
        replay, _ = await _play(LongRecall(**params), seeds[3])
        again, _ = await _play(LongRecall(**params), seeds[3])
        assert replay == again and len(replay) == 1 + 3  # 3 fact turns at level 1, then the question

    asyncio.run(go())


def test_default_is_a_pure_function_of_the_seed_and_registered() -> None:
    async def go() -> None:
        env = make_env("earl_stream_envs.long_recall:LongRecall", {"turns": "4"})  # --param passes strings
        assert env_options(env).max_turn_tokens == 3
        a, _ = await _play(env, 5)
        b, _ = await _play(LongRecall(turns=4), 5)
        assert a == b and len(a) == 5

    asyncio.run(go())
    for bad in ({"turns": 0}, {"turns": 9, "max_turns": 8}, {"max_turns": 80, "facts_per_turn": 4},
                {"grow_every": -1}):
        with pytest.raises(EnvError, match="LongRecall needs"):
            LongRecall(**bad)


def test_context_grows_from_about_100_to_about_900_tokens(tiny_model_dir) -> None:
    from earl_stream.model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)

    async def tokens(turns: int) -> int:
        env = LongRecall(turns=turns)
        msgs = [{"role": "system", "content": env.system_prompt}]
        pages, _ = await _play(env, 3)
        for page in pages:
            msgs += [{"role": "user", "content": page}, {"role": "assistant", "content": "7"}]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    short, long = asyncio.run(tokens(2)), asyncio.run(tokens(24))
    assert 80 <= short <= 160 and 750 <= long <= 1000, (short, long)


def test_a_context_limit_is_an_episode_option() -> None:
    assert env_options(LongRecall()).max_episode_tokens is None
    assert env_options(LongRecall(max_episode_tokens="300")).max_episode_tokens == 300  # `--param k=v` gives strings
    with pytest.raises(EnvError, match="max_episode_tokens must be >= 1"):
        LongRecall(max_episode_tokens=0)


def test_filler_grows_geometrically_with_the_level_and_keeps_the_facts() -> None:
    async def go() -> None:
        params = {"turns": 1, "max_turns": 1, "facts_per_turn": 2, "grow_every": 1, "filler_words": 100,
                  "filler_factor": "2"}  # --param passes strings
        env = LongRecall(**params)
        assert [env.page_filler_words(level) for level in range(4)] == [100, 200, 400, 800]
        sizes = []
        for seed in (7000, 7001, 7002):
            page = await env_reset(env, seed)
            facts, notes = page.split("\nNotes: ")
            assert re.fullmatch(r"Facts: [A-Z]\d=\d [A-Z]\d=\d", facts)
            sizes.append(len(notes.split()))
            question = (await env_step(env, "ok")).observation
            key = re.match(r"What is (\w+)\?", question).group(1)
            value = dict(f.split("=") for f in facts.removeprefix("Facts: ").split())[key]
            final = await env_step(env, value)
            assert final.done and final.reward == 1.0
        assert sizes == [100, 200, 400]
        assert LongRecall(filler_words=50, filler_factor=3, max_filler_words=120).page_filler_words(2) == 120
        # a long run's level (one per prompt group) goes far past where the growth overflows a float: capped
        grown = LongRecall(filler_words=430, filler_factor=2.12)
        assert [grown.page_filler_words(level) for level in (5, 6, 7, 940, 10**6)] == [18414, 20000, 20000, 20000, 20000]

    asyncio.run(go())
    for bad in ({"filler_words": -1}, {"filler_factor": 0.5}, {"filler_words": 10, "max_filler_words": 5}):
        with pytest.raises(EnvError, match="filler"):
            LongRecall(**bad)


def test_facts_last_puts_the_question_with_the_facts_after_the_document() -> None:
    async def go() -> None:
        env = LongRecall(turns=1, max_turns=1, facts_per_turn=2, filler_words=30, facts_last="true")
        assert env_options(env).max_turn_tokens == 8
        page = await env_reset(env, 12)
        notes, facts, question = page.split("\n")
        assert notes.startswith("Notes: ") and len(notes.split()) == 31
        assert re.fullmatch(r"Facts: [A-Z]\d=\d [A-Z]\d=\d", facts)
        key = re.fullmatch(r"What is the value of (\w+)\? Reply with the digit only\.", question).group(1)
        value = dict(f.split("=") for f in facts.removeprefix("Facts: ").split())[key]
        final = await env_step(env, f"The value of {key} is {value}")  # one reply; the key's digit is no answer
        assert final.done and final.reward == 1.0
        await env_reset(env, 12)
        assert (await env_step(env, f"{key} is")).info["outcome"] == "no_answer"

    asyncio.run(go())
    with pytest.raises(EnvError, match="facts_last"):
        LongRecall(facts_last=True)


def test_level_groups_schedule_and_held_out_items_at_every_level() -> None:
    async def go() -> None:
        params = {"turns": 1, "max_turns": 1, "facts_per_turn": 2, "filler_words": 10, "filler_factor": 2,
                  "facts_last": True, "level_groups": [3, 2, 1]}
        levels = []
        for seed in range(8800, 8808):
            env = LongRecall(**params)
            await env_reset(env, seed)
            await env_reset(env, seed)  # a group member: same seed, same level, not counted again
            levels.append((await env_step(env, "1")).info["level"])
        assert levels == [0, 0, 0, 1, 1, 2, 2, 2]  # past the schedule the last level stays
        held, seeds = LongRecall.held_out(params, 6)
        assert seeds == [(1 << 30) + i for i in range(6)] and held["fixed_levels"] == 3
        env = LongRecall(**held)
        got = []
        for seed in seeds:
            await env_reset(env, seed)
            got.append((await env_step(env, "1")).info["level"])
        assert got == [0, 1, 2, 0, 1, 2]

    asyncio.run(go())
    with pytest.raises(EnvError, match="level_groups"):
        LongRecall(level_groups="3|0")


@pytest.mark.real_model
def test_real_scale_episodes_grow_at_least_8x_in_smollm2_tokens() -> None:
    """The environment of configs/smollm2_real_scale.yaml (bench/real_scale.py's full run), with SmolLM2-135M's
    tokenizer and chat template and a reply of the most tokens the environment allows, at its first and
    last level."""
    from pathlib import Path

    from earl_stream.config import load_config
    from earl_stream.model import cache_dir, load_tokenizer

    model_dir = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (model_dir / "config.json").exists():
        pytest.skip("SmolLM2-135M-Instruct not imported (make real-model)")
    tok = load_tokenizer(str(model_dir))
    config = Path(__file__).resolve().parents[2] / "configs" / "smollm2_real_scale.yaml"
    params = dict(load_config(config).envs[0].params)
    held, seeds = LongRecall.held_out(params, 4)  # seed i at level i

    async def tokens(level: int) -> int:
        env = LongRecall(**held)
        page = await env_reset(env, seeds[level])
        msgs = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": page},
                {"role": "assistant", "content": "The value of A1 is 7"}]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    first, last = asyncio.run(tokens(0)), asyncio.run(tokens(3))
    assert first <= 128 and last >= 700 and last / first >= 8, (first, last)
