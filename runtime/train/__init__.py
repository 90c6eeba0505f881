"""Training a compiled plan: the program, the launcher, checkpoints, precision, recompute, profiling
and token data."""
