"""Deterministic Temporal workflow code and the pure recovery policy."""
