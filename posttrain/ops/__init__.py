"""Kernels, fla-style: each op has `naive.py` (the spec) and optimised twins tested against it."""
