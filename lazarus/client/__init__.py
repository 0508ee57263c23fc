"""What a script or an operator's tool uses to reach Lazarus: the settings of where Temporal is
(config.py, tls.py), starting and reading runs (runs.py, reading.py), and their histories
(history.py)."""
