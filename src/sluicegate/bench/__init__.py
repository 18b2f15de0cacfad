"""Measurement: load generation against a running server (slow readers, disconnects,
overload), and micro-benchmarks and profiles of single stages (engine timing and per-step
profile, admission latency).  Stages never import this package; it imports them."""
