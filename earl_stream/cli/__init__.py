"""The `earl-stream` command line, one module per command: `main` (parser and dispatch), `up` (a whole
run, placed by a launcher from `launchers`), `worker`, `env`, `episodes`, and what `up` shows
(`live`) and starts (`procs`). Nothing outside this package imports from it: the supervisor and the
workers run the same under every launcher and never depend on how they were started.
"""
