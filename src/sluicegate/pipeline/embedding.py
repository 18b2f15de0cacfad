"""A small static embedding model for semantic guard checks, shipped inside a PyPI package.

WordLlama (``pip install --no-deps wordllama==0.4.0.post1``, MIT) ships a 256-dimension
token-embedding table (32,000 tokens, float16, 16 MB) and its tokenizer inside the
package.  The package is located, never imported (its own dependencies are not wanted):
a text's embedding is the mean of its tokens' rows, normalised, so embedding a window of
output costs a tokenisation and a 256-wide mean (microseconds), not a forward pass.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load_file
from tokenizers import Tokenizer

EMBEDDING_PACKAGE = "wordllama"
WEIGHTS = "weights/l2_supercat_256.safetensors"
TOKENIZER = "tokenizers/l2_supercat_tokenizer_config.json"
INSTALL = "pip install --no-deps wordllama==0.4.0.post1"
#: Its name as an embedding model (``POST /v1/embeddings``, ``GET /v1/models``).
EMBEDDING_MODEL = "wordllama-l2-supercat"

Vectors = npt.NDArray[np.float32]


class EmbeddingModelNotFound(FileNotFoundError):
    """The package that ships the embedding table is not installed."""


def package_dir() -> Path:
    """Where the embedding package's files are (found, not imported)."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / WEIGHTS).is_file():
            return Path(location)
    raise EmbeddingModelNotFound(f"semantic checks need the WordLlama embedding table: `{INSTALL}`")


class StaticEmbedding:
    """Mean-pooled, normalised token embeddings."""

    def __init__(self, directory: Path) -> None:
        table = load_file(str(directory / WEIGHTS))["embedding.weight"]
        self.table: Vectors = np.asarray(table, dtype=np.float32)
        self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.dim = int(self.table.shape[1])

    def embed(self, texts: list[str]) -> Vectors:
        """One unit vector per text (zeros for a text without tokens)."""
        return self.pool(self.encode(texts))

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids (those the table has a row for)."""
        rows = len(self.table)
        return [
            [i for i in encoding.ids if 0 <= i < rows]
            for encoding in self.tokenizer.encode_batch(texts)
        ]

    def pool(self, token_ids: list[list[int]], dimensions: int | None = None) -> Vectors:
        """One unit vector per list of token ids: the mean of their rows, cut to its first
        ``dimensions`` components (the table is trained so that a prefix is an embedding
        too) and normalised; zeros for an empty list."""
        dim = self.dim if dimensions is None else dimensions
        out = np.zeros((len(token_ids), dim), dtype=np.float32)
        for row, ids in enumerate(token_ids):
            if not ids:
                continue
            vector = self.table[ids, :dim].mean(axis=0)
            norm = float(np.linalg.norm(vector))
            if norm > 0:
                out[row] = vector / norm
        return out


@functools.cache
def embedding_available() -> bool:
    """Whether the embedding package is installed (``make install`` installs it); looked
    up once per process, not at every ``GET /v1/models``."""
    try:
        package_dir()
    except EmbeddingModelNotFound:
        return False
    return True


@functools.cache
def default_embedding() -> StaticEmbedding:
    """The shipped model, loaded once per process."""
    return StaticEmbedding(package_dir())
