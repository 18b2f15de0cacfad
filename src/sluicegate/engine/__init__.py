"""Engines and the engine loop: the thread that runs the scheduler's steps on an engine
(embedded torch, or simulated), detokenises, and hands each request's output back."""
