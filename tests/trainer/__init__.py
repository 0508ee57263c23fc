"""The trainer's own tests with real torch ranks: checkpoints resharded across layouts, warm standbys."""
