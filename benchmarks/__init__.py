"""Benchmarks run on a GPU machine (not tests): see docs/benchmarks.md and gpu.sh."""
