"""Fixtures for the embedded torch engine: the SmolLM2 GGUF engine, loaded once per session.

The converted-weights cache goes to a session temporary directory, so every run also
exercises the cold GGUF path (a few seconds) and never touches ``~/.cache``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from sluicegate.engine.torch import TorchEngine


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run each engine test on the process's torch thread, where the engines compute: a
    second OpenMP team in the process throttles both (see ``TorchEngine``)."""
    from sluicegate.engine.torch.torch_thread import run_on_torch_thread

    if pyfuncitem.get_closest_marker("caller_thread"):
        return None  # the test is about calling from other threads: run it as usual
    function = pyfuncitem.obj
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_on_torch_thread(lambda: function(**kwargs))
    return True


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from sluicegate.engine.torch import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


#: Torch threads of the engines these tests build in process: as many as servers get
#: (``SLUICEGATE_TORCH_THREADS``, one per pytest-xdist worker under ``make test``), else
#: the engine's default.
TEST_THREADS = int(os.environ.get("SLUICEGATE_TORCH_THREADS", "0")) or None


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 itself (``--dtype auto`` picks it): elsewhere
    bfloat16 is emulated and its roundings fall otherwise at near ties, such as the first
    token of the capital-of-France answer ("The" 25.33, "L" 25.24 in float32)."""
    import torch

    from sluicegate.engine.torch import loader
    from sluicegate.engine.torch.packed_linear import packing_supported

    return loader.native_bfloat16() and packing_supported(torch.bfloat16)


def _smollm2_engine(
    path: str, cache_dir: Path, dtype: str, weights: str = "full"
) -> Iterator[TorchEngine]:
    """SmolLM2 in ``dtype``, 8 slots of 512 positions."""
    from sluicegate.engine.torch import TorchEngine

    engine = TorchEngine(
        path,
        dtype=dtype,
        max_num_seqs=8,
        max_model_len=512,
        cache_dir=str(cache_dir),
        num_threads=TEST_THREADS,
        weights=weights,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def engine_f32(smollm2_path: str, torch_cache_dir: Path) -> Iterator[TorchEngine]:
    """SmolLM2 in float32 (exact comparisons against transformers)."""
    yield from _smollm2_engine(smollm2_path, torch_cache_dir, "float32")


@pytest.fixture(scope="session")
def engine_bf16(smollm2_path: str, torch_cache_dir: Path) -> Iterator[TorchEngine]:
    """SmolLM2 in bfloat16 (the fast dtype)."""
    yield from _smollm2_engine(smollm2_path, torch_cache_dir, "bfloat16")


@pytest.fixture(scope="session")
def engine_q4(smollm2_path: str, torch_cache_dir: Path) -> Iterator[TorchEngine]:
    """SmolLM2 with 4-bit weights for answers (the GGUF's own blocks), in the dtype
    ``--dtype auto`` picks here (:func:`q4_dtype`): bfloat16 where this CPU multiplies it,
    float32 elsewhere (its prompts are several times faster there)."""
    from sluicegate.engine.torch.q4 import supported

    if not supported():
        pytest.skip("no int4 CPU kernel in this torch")
    yield from _smollm2_engine(smollm2_path, torch_cache_dir, q4_dtype(), weights="q4")


def q4_dtype() -> str:
    """The dtype of :func:`engine_q4`."""
    return "bfloat16" if native_bfloat16() else "float32"


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest) -> TorchEngine:
    """Each dtype in turn: for the properties both must have bit for bit."""
    name = "engine_f32" if request.param == "float32" else "engine_bf16"
    result: TorchEngine = request.getfixturevalue(name)
    return result


@pytest.fixture(scope="session")
def smollm2_hf_dir(
    smollm2_path: str, torch_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """SmolLM2 as a Hugging Face directory (``sluicegate export-hf``'s), made once a
    session; read it, never write it (tests that need another model take its
    tokenizer's files or its weights into a directory of their own)."""
    from sluicegate.engine.torch.export import export_hf_directory

    return export_hf_directory(
        smollm2_path, tmp_path_factory.mktemp("smollm2-hf"), cache_dir=torch_cache_dir
    )
