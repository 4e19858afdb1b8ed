"""Algorithms (advantages, losses), kept apart from the loops that call them."""
