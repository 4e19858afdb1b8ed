"""Algorithms, kept apart from the loops that call them: advantage estimators (`advantages`, numpy
only, a registry by `algo.advantage`), the policy loss (`losses`) and the learning-rate schedule
(`schedule`). This package imports nothing heavy itself, so config validation can use `advantages`."""
