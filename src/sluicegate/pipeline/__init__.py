"""Pipelines: retrieval before generation, and output stages (guard, format) joined by
bounded channels between the engine's output and the client's stream."""
