"""Plays one episode of an agent environment against the worker's OpenAI endpoint and makes it a sample.

The agent gets an `openai.AsyncOpenAI` client whose every request carries the episode's id
(`X-Episode-Id`) and the episode's agent key (never the cluster secret), so the endpoint files its tokens
under that episode and refuses the key for anything else. When `run` returns, the
endpoint's trace (prompt tokens, generated tokens with their log-probs and policy versions, loss mask
on generated tokens only) and the reward become a `SampleRecord` like the built-in loop's; an episode
whose agent rewrote its history (a non-append request accepted under `rollout.non_append=split`) becomes
one record per segment, all with the episode's id, group and reward. An agent that raises, times out or
never calls the model fails its own episode (`EpisodeFailed`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from earl_stream.env.api import DEFAULT_AGENT_TIMEOUT_S
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.records import SampleRecord
from earl_stream.workers.agent_loop import EpisodeFailed, trace_record
from earl_stream.workers.agent_runner import GRACE_S, AgentRunners, run_agent


async def play_agent_episode(env: Any, endpoint: OpenAIEndpoint, *, env_name: str, seed: int, prompt_ordinal: int,
                             group_id: str, runner: AgentRunners | None = None,
                             spec: tuple[str, dict[str, Any]] | None = None,
                             api_key: str | None = None, limits: Mapping[str, float] | None = None,
                             network: Sequence[str] = ()) -> list[SampleRecord]:
    """Run `env.run(client, env.task(seed))` to its end and return the episode's samples (one per segment,
    in order; one unless the agent rewrote its history): in this event loop,
    or with `runner` in an agent process, which makes the environment again from `spec` (registry spec,
    params; `limits` and `network`: its sandbox's, `EnvSpec.limits`/`network`). The agent's `api_key` is the
    episode's own agent key (openai_api/auth.py), valid only for this episode's requests while it runs; a given
    `api_key` is used instead (tests, benchmarks)."""
    episode_id = uuid.uuid4().hex[:16]
    key = f"{group_id}-{episode_id}"
    timeout_s = float(getattr(env, "timeout_s", DEFAULT_AGENT_TIMEOUT_S))
    if api_key is None:
        api_key = endpoint.agent_key(key, timeout_s + GRACE_S)
    endpoint.expect(key)
    try:
        if runner is not None:
            if spec is None:
                raise ValueError("an agent process makes the environment from its spec: pass spec=(name, params)")
            reward = await runner.run(spec[0], spec[1], seed, url=endpoint.local_url, api_key=api_key,
                                      episode_key=key, timeout_s=timeout_s, ca_pem=endpoint.ca_pem, limits=limits,
                                      network=network)
        else:
            reward = await run_agent(env, seed, endpoint.local_url, api_key, key, timeout_s, endpoint.ca_pem)
    finally:
        episode = endpoint.take_episode(key)
    if episode is None:
        raise EpisodeFailed("the agent finished without a successful request to the model")
    segments = episode.segments()
    records = []
    for k, seg in enumerate(segments):
        info = {"turns": episode.turns, "segment_turns": seg.turns, "prefix_mismatches": episode.mismatches}
        record = trace_record(seg.trace, episode_id=episode_id, group_id=group_id, prompt_ordinal=prompt_ordinal,
                              env_name=env_name, turns=seg.turns, prompt_tokens=seg.prompt_tokens, reward=reward,
                              info=info)
        if len(segments) > 1:  # segment 0 keeps the one-sample episode's id; the others get their own
            record = dataclasses.replace(record, segment=k, segments=len(segments),
                                         sample_id=record.sample_id + (f"-s{k}" if k else ""))
        records.append(record)
    return records
