"""The chaos matrix: faults broken on purpose into real runs, and what survived (bench/chaos.py)."""
