"""Benchmarks of mooncake-server: what the scripts under scripts/ share (paper figures, cache
simulation)."""
