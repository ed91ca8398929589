"""Benchmarks (``make bench``); results are written under bench/results/."""
