"""The upstream engine: Sluicegate's front door, queue and streams in front of a pool of
OpenAI-compatible servers (vLLM, SGLang, TGI, llama.cpp's ``llama-server``, Ollama, or
another Sluicegate).  See ``docs/upstream.md``."""
