"""Every benchmark and profiler: load generation against a running server (overload, slow
readers, disconnects), capacity search and side-by-side comparisons, and micro-benchmarks
and profiles of single stages (engine timing and per-step profile, admission latency).
Stages never import this package; it imports them."""
