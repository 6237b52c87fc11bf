"""Command-line programs (console scripts declared in setup.py)."""
