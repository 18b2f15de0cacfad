"""The model families the embedded engine runs, and a model's family read from its files
at a glance (without torch): the start-up check that refuses an unsupported model in one
line, before the server listens."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

#: Hugging Face ``model_type`` values the engine runs (``engine/torch/convert.py``).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
)
#: GGUF ``general.architecture`` values it runs (``engine/torch/gguf_reader.py``).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

#: Bytes of GGUF's scalar value types, by type number (8 is a string, 9 an array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING = 8
#: Key-value pairs read before giving up (llama.cpp writes the architecture first).
_MAX_KEYS = 64


def model_architecture(path: Path) -> tuple[str, tuple[str, ...]] | None:
    """A model's family and the families the engine runs for its kind of file (a
    directory's ``config.json`` ``model_type``, a GGUF file's ``general.architecture``);
    None when its files do not say at a glance."""
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        model_type = config.get("model_type") if isinstance(config, dict) else None
        return (str(model_type), SUPPORTED_MODEL_TYPES) if model_type else None
    try:
        with path.open("rb") as file:
            architecture = _gguf_architecture(file)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return (architecture, SUPPORTED_GGUF_ARCHITECTURES) if architecture else None


def _gguf_architecture(file: BinaryIO) -> str | None:
    """``general.architecture`` from a GGUF header (versions 2 and 3), reading key-value
    pairs until it (None if an array or too many keys come first)."""
    if file.read(4) != b"GGUF":
        return None
    (version,) = struct.unpack("<I", file.read(4))
    if version not in (2, 3):
        return None
    _, num_keys = struct.unpack("<QQ", file.read(16))
    for _ in range(min(num_keys, _MAX_KEYS)):
        key = _string(file)
        (kind,) = struct.unpack("<I", file.read(4))
        if kind == _STRING:
            value = _string(file)
            if key == "general.architecture":
                return value
        elif kind in _SCALAR_BYTES:
            file.read(_SCALAR_BYTES[kind])
        else:
            return None  # an array before the architecture: not worth walking
    return None


def _string(file: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    if length > 1 << 20:
        raise ValueError("implausible GGUF string")
    return file.read(length).decode("utf-8")
