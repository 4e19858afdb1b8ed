"""Sandboxes for code nobody reviewed (environments, tools, agent programs): `spec` says what a sandbox may use,
`launch` starts a program in one and tells which limit it went past."""

from earl_stream.sandbox.launch import (
    Launch,
    Sandboxed,
    SandboxResult,
    bwrap_problem,
    prepare,
    resolve_mode,
    run,
    sandbox_environment,
    start,
)
from earl_stream.sandbox.spec import Breach, Limits, SandboxMode, SandboxSpec

__all__ = ["Breach", "Launch", "Limits", "SandboxMode", "SandboxResult", "SandboxSpec", "Sandboxed", "bwrap_problem",
           "prepare", "resolve_mode", "run", "sandbox_environment", "start"]
