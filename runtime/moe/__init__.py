"""Mixture-of-experts: routing, stacked experts and expert parallelism."""
