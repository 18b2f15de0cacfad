"""Choosing and loading 4-bit weights (``--weights``; what they are: :mod:`.q4`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sluicegate.engine.files import atomic_path, one_at_a_time
from sluicegate.engine.torch.convert import unpermute_rotary_rows
from sluicegate.engine.torch.gguf_reader import PERMUTED_ARCHS, read_gguf
from sluicegate.engine.torch.loader import cache_entry
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.packed_linear import Linear
from sluicegate.engine.torch.q4 import Q4Parts, Q4Weight, gguf_parts, quantize, supported

log = logging.getLogger(__name__)

WEIGHTS_CHOICES = ("auto", "full", "q4")

#: Bumped whenever the cached parts are laid out differently.
CACHE_VERSION = 1

#: GGUF tensor names of a layer's projections, by the module that fuses them.
_GGUF_PROJECTIONS = {
    "attention.wqkv": ("attn_q", "attn_k", "attn_v"),
    "attention.wo": ("attn_output",),
    "feed_forward.w_gate_up": ("ffn_gate", "ffn_up"),
    "feed_forward.w_down": ("ffn_down",),
}


def load_q4(
    model: Transformer,
    weights: str,
    model_path: str,
    cache_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Give ``model``'s projections 4-bit weights if ``weights`` asks for them here:
    ``q4`` always (a clear error if they cannot run), ``auto`` when the source is a
    GGUF whose projections are 4-bit and they can run; ``full`` never.  Returns the
    bytes they take (0: none)."""
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHTS_CHOICES}, not {weights!r}")
    if weights == "full":
        return 0
    if not supported():
        if weights == "auto":
            return 0
        raise ValueError(
            "4-bit weights run on PyTorch's int4 CPU kernel, which this PyTorch lacks: "
            "use --weights full"
        )
    path = Path(model_path)
    exact = gguf_q4_parts(path, model, cache_dir) if path.suffix.lower() == ".gguf" else {}
    if weights == "auto" and not _covers(exact, model):
        return 0
    return attach_q4(model, exact)


def _covers(exact: dict[str, Q4Parts], model: Transformer) -> bool:
    """Whether every layer projection has its 4-bit blocks in the file."""
    return all(
        f"layers.{i}.{name}" in exact
        for i in range(model.args.n_layers)
        for name in _GGUF_PROJECTIONS
    )


def attach_q4(model: Transformer, exact: dict[str, Q4Parts]) -> int:
    """Give every layer projection of ``model`` 4-bit weights: the ``exact`` parts (a
    GGUF's own blocks) where given, else the loaded weight quantised; the output
    projection only from its own blocks.  Returns the bytes they take."""
    start = time.perf_counter()
    total = 0
    for i, layer in enumerate(model.layers):
        for name in _GGUF_PROJECTIONS:
            module = layer.get_submodule(name)
            assert isinstance(module, Linear)
            parts = exact.get(f"layers.{i}.{name}")
            packed = Q4Weight.pack(quantize(module.weight) if parts is None else parts)
            module.q4 = packed
            total += packed.nbytes
    # The output projection only from a file's own 4-bit blocks: SmolLM2's (8-bit in its
    # GGUF) rounded to 4 bits took the perplexity of bench/texts/rivers.txt from 32.6 to
    # 34.9 (bench perplexity), the projections' own blocks left it at 32.6.
    parts = exact.get("output")
    if parts is not None:
        model.output_q4 = Q4Weight.pack(parts)
        total += model.output_q4.nbytes
    log.info(
        "4-bit weights: %.0f MB (%d of %d projections from the file's own blocks), in %.1f s",
        total / 1e6,
        len(exact),
        len(model.layers) * len(_GGUF_PROJECTIONS) + 1,
        time.perf_counter() - start,
    )
    return total


def gguf_q4_parts(
    path: Path, model: Transformer, cache_dir: str | os.PathLike[str] | None
) -> dict[str, Q4Parts]:
    """A GGUF's 4-bit projections by module name, in this package's layout (Llama's query
    and key rows un-permuted, projections fused), cached beside the converted weights:
    reading the file's header takes seconds."""
    entry = cache_entry(path, cache_dir, "torch-q4", f"v{CACHE_VERSION}")
    parts_file = entry / "parts.safetensors"
    cached = _read_cached(parts_file)
    if cached is not None:
        return cached
    with one_at_a_time(parts_file.with_suffix(".lock")):
        cached = _read_cached(parts_file)
        if cached is not None:
            return cached
        found = _read_gguf_parts(path, model)
        try:
            with atomic_path(parts_file) as tmp:
                save_file(_flatten(found), str(tmp))
        except OSError:
            pass  # a read-only cache only costs speed
        return found


def _read_gguf_parts(path: Path, model: Transformer) -> dict[str, Q4Parts]:
    gguf = read_gguf(path, with_tensors=True)
    permuted = gguf.metadata.get("general.architecture") in PERMUTED_ARCHS
    args = model.args
    heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}
    found: dict[str, Q4Parts] = {}
    for i in range(args.n_layers):
        for name, sources in _GGUF_PROJECTIONS.items():
            pieces: list[Q4Parts] = []
            for source in sources:
                parts = gguf_parts(gguf.tensors[f"blk.{i}.{source}.weight"])
                if parts is None:
                    break
                if permuted and source in heads:
                    parts = _unpermuted(parts, heads[source])
                pieces.append(parts)
            else:
                found[f"layers.{i}.{name}"] = Q4Parts.cat(pieces)
    output = gguf.tensors.get("output.weight")
    parts = gguf_parts(gguf.tensors["token_embd.weight"] if output is None else output)
    if parts is not None:
        found["output"] = parts
    return found


def _unpermuted(parts: Q4Parts, num_heads: int) -> Q4Parts:
    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return unpermute_rotary_rows(tensor, num_heads)

    return parts.map_rows(rows)


def _flatten(found: dict[str, Q4Parts]) -> dict[str, torch.Tensor]:
    """Two codes a byte (even inputs low), and the scales and minima as they are."""
    flat: dict[str, torch.Tensor] = {}
    for name, parts in found.items():
        codes = parts.codes
        flat[f"{name}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        flat[f"{name}.scale"] = parts.scale.contiguous()
        flat[f"{name}.minimum"] = parts.minimum.contiguous()
    return flat


def _read_cached(parts_file: Path) -> dict[str, Q4Parts] | None:
    if not parts_file.is_file():
        return None
    try:
        flat = load_file(str(parts_file))
    except Exception:  # a corrupt cache file: read the GGUF again
        return None
    names = {key.rpartition(".")[0] for key in flat}
    found: dict[str, Q4Parts] = {}
    for name in names:
        packed = flat[f"{name}.codes"]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        found[name] = Q4Parts(codes, flat[f"{name}.scale"], flat[f"{name}.minimum"])
    return found
