"""The request parameters of the OpenAI API that are plain values: numbers in a range, integers, stop strings;
a value out of range is a `BadRequest` naming the parameter (answered 400)."""

from __future__ import annotations

from typing import Any

from earl_stream.openai_api.messages import BadRequest


def number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise BadRequest(f"{key} must be an integer {bound}, got {value!r}", param=key)
    return value


def stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    return stops
