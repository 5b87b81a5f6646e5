"""Helpers for tests and benchmarks that need a model but not real weights."""
