"""Checkpoints: publishing them safely (publish.py) and reading them in any layout (convert.py)."""
