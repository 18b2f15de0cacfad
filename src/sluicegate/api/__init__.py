"""HTTP and WebSocket: the OpenAI-compatible routes, request validation, errors in OpenAI's
shape, health and stats, and the app's life cycle.  Knows nothing of tensors."""
