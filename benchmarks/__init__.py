"""Benchmarks: scripts run as `.venv/bin/python benchmarks/NAME.py`, importable for the tests that check them."""
