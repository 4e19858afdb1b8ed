"""The OpenAI-compatible endpoint every rollout worker serves (see `server`), its HTTP layer (`http`),
the chat messages of the API (`messages`) and the per-episode token accounting (`episodes`)."""

from earl_stream.openai_api.episodes import Episode, EpisodeBook
from earl_stream.openai_api.server import EPISODE_HEADER, OpenAIEndpoint

__all__ = ["EPISODE_HEADER", "Episode", "EpisodeBook", "OpenAIEndpoint"]
