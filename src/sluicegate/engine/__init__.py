"""Engines: run one step for a planned batch and return sampled tokens."""
