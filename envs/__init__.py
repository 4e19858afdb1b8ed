"""Environments shipped with earl_stream (one module per game or task).

Each module holds one class that implements `earl_stream.env.Environment`; they are registered as
entry points in the `earl_stream.envs` group (see pyproject.toml). The protocol, the registry and the
agent loop that drives them live in `earl_stream`, not here.
"""
