"""The process's one OS thread for tensor work.

OpenMP (which torch and oneDNN parallelise with) keeps a team of worker threads per
calling thread; with two teams on a machine with as many cores as one team, libgomp
throttles its spin-waiting and every operator pays a wake-up (measured here: a decode
step took 4x longer on a second thread than on the thread that had loaded the model).
So every engine loads, steps and is driven by benchmarks on this one thread
(:class:`~sluicegate.engine.torch.runner.TorchEngine`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")

_torch_executor: ThreadPoolExecutor | None = None
_torch_thread_ident: int | None = None
_executor_lock = threading.Lock()


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 256 << 20) -> bool:
    """Serve buffers below ``mmap_threshold`` from malloc's heap and stop returning freed
    heap memory to the OS (glibc only; returns whether it applied).

    A decode step allocates and frees the same multi-megabyte temporaries (the gathered
    KV of every layer, scores, logits) again and again.  glibc hands each one to a fresh
    ``mmap`` and unmaps it on free, so every step pays page faults to zero-fill them:
    measured here, gathering 64 sequences' keys took 0.89 ms with fresh pages and 0.26 ms
    with reused ones, and that gather runs 60 times a step.  Memory stays at the
    working set's high-water mark instead, which a server reaches anyway.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return ok and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1)


def _init_torch_thread() -> None:
    global _torch_thread_ident
    _torch_thread_ident = threading.get_ident()
    keep_freed_memory()


def torch_thread() -> ThreadPoolExecutor:
    """The process's one thread for tensor work (see the module docstring), started lazily."""
    global _torch_executor
    with _executor_lock:
        if _torch_executor is None:
            _torch_executor = ThreadPoolExecutor(
                1, thread_name_prefix="sluicegate-torch", initializer=_init_torch_thread
            )
        return _torch_executor


def run_on_torch_thread(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` on the torch thread (directly when already there)."""
    if threading.get_ident() == _torch_thread_ident:
        return fn(*args)
    return torch_thread().submit(fn, *args).result()
