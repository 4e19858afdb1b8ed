"""Typed exceptions of earl_stream.

Every error a user can cause (bad config, bad model directory, unreachable peer, a broken
environment) is one of these, with a message that says what to do. The CLI turns them into one
clear line and a non-zero exit; nothing else should reach the user as a traceback.
"""

from __future__ import annotations


class EarlError(Exception):
    """Base class of every error earl_stream raises on purpose."""


class ConfigError(EarlError):
    """The configuration is invalid; the message lists every problem found."""


class ModelError(EarlError):
    """A model or tokenizer directory cannot be used (missing, not a causal LM, ...)."""


class StoreError(EarlError):
    """The experience store could not serve, find, or verify a shard."""


class ProtocolError(EarlError):
    """A control-plane or data-plane peer sent something that is not our protocol."""


class EnvError(EarlError):
    """An environment could not be found, imported, or misbehaved."""


class EngineError(EarlError):
    """An inference engine failed to generate or to load weights."""


class ControlPlaneTimeout(EarlError):
    """A wait on the control plane ran out of time; the message names what was awaited."""


class ChildProcessFailed(EarlError):
    """A process started by `earl-stream up` exited unexpectedly."""


class SlurmError(EarlError):
    """Slurm refused a job (or is not there); the message gives sbatch's reason."""
