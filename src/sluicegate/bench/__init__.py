"""Every benchmark and profiler: load generation (overload, slow readers, disconnects),
capacity search, side-by-side comparisons, and the engine's speed measurements."""
