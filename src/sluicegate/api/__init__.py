"""The HTTP layer: OpenAI schemas, SSE, errors, health.  Knows nothing of tensors."""
