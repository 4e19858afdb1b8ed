"""Only what pyproject.toml cannot say: the repository's envs/ folder installs as the package `earl_stream_envs`
(a package-dir mapping next to the discovered earl_stream packages). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["earl_stream", "earl_stream.*"]), "earl_stream_envs"],
      package_dir={"earl_stream_envs": "envs"})
