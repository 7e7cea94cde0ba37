"""Executors that need only their backend's runtime library (no torch)."""
