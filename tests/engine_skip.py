"""The module-level skip of a test module that needs an optional engine backend (vllm, sglang): the reason the
engine registry gives (`unavailable_reason`), so that a skip says what to install (`make test-vllm`)."""

from __future__ import annotations

import pytest

from earl_stream.workers.engines.registry import unavailable_reason


def require_engine(name: str) -> None:
    """Skip the whole module being imported unless engine backend `name` can start here."""
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
