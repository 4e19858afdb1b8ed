"""Environments shipped with earl_stream (one module per game or task).

Each module holds one class that implements `earl_stream.env.Environment`: `tictactoe`,
`connect_four`, `calculator` (tool use), and adapters for third-party suites, `reasoning_gym_env`
and `textarena_env` (their packages are imported only when those classes are built). They are
registered as entry points in the `earl_stream.envs` group (see pyproject.toml) and documented in
envs/README.md. The protocol, the registry, tool calling and the agent loop that drives them live in
`earl_stream`, not here.
"""
