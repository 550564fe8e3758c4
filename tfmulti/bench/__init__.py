"""Benchmarks: python -m tfmulti.bench.<name>."""
