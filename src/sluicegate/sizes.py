"""Memory sizes as people write them (``512MiB``, ``2GiB``) and read them (``1.41 GiB``)."""

from __future__ import annotations

import re

#: Units of a memory size, in bytes: decimal (kB, MB, GB, TB) and binary (KiB, MiB, ...).
_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")
MEMORY_SIZE_FORMS = "a size like 512MiB, 2GiB, 1.5GB or 800000000 (bytes), or auto"


def parse_memory_size(text: str) -> int | None:
    """Bytes of a size like ``512MiB``, ``2GiB``, ``1.5GB`` or ``800000000``; None for
    ``auto``.  Units are case-insensitive; raises ValueError for anything else."""
    spec = text.strip().lower()
    if spec == "auto":
        return None
    match = _MEMORY_SIZE.fullmatch(spec)
    unit = _MEMORY_UNITS.get(match.group(2)) if match else None
    if match is None or unit is None:
        raise ValueError(f"must be {MEMORY_SIZE_FORMS}; got {text!r}")
    number = match.group(1)
    size = int(float(number) * unit) if "." in number else int(number) * unit
    if size < 1:
        raise ValueError(f"must be at least 1 byte ({MEMORY_SIZE_FORMS}); got {text!r}")
    return size


def format_memory_size(num_bytes: int) -> str:
    """``num_bytes`` for people, to two decimals: ``1.41 GiB``, ``22.5 MiB``, ``512 B``."""
    size, unit = float(num_bytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
