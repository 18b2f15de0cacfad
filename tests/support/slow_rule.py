"""The rule that keeps ``make test-fast`` fast: a test that starts a process, or loads
the model, is ``slow``.

* **Marked by what it calls.**  At collection, each test's function and the fixtures it
  uses are read (their syntax tree, following calls to functions of the same module): a
  call to one of :data:`PROCESS_CALLS` starts a process, one to :data:`MODEL_CALLS`
  loads the model.  Such a test is marked ``slow`` (and ``model``) without anyone
  remembering to.
* **Enforced when it runs.**  In a run that deselects slow tests (``-m "not slow"``), a
  test that starts a process anyway fails at once, naming itself: the rule cannot rot.
"""

from __future__ import annotations

import ast
import inspect
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import pytest

#: Calls that start a process (ours: servers, upstreams, Redis; or anyone's).
PROCESS_CALLS = frozenset(
    {
        "start_server",
        "start_server_with_args",
        "start_upstream",
        "start_gateway",
        "start_redis",
        "Popen",
        "check_output",
        "check_call",
        "sync_playwright",
        "async_playwright",
        "fork",
        "create_subprocess_exec",
        "create_subprocess_shell",
    }
)
#: Calls that load SmolLM2 (seconds each, and hundreds of MB).
MODEL_CALLS = frozenset({"TorchEngine", "load_model", "_smollm2_engine"})
#: ``subprocess.run``: a call named ``run`` counts only on the ``subprocess`` module.
_QUALIFIED = {("subprocess", "run"), ("subprocess", "call")}
#: Calls named like a process start that serve a socket in the test's own process.
_IN_PROCESS = {("asyncio", "start_server"), ("asyncio", "start_unix_server")}


def slow_module(path: Path) -> bool:
    """Whether ``path`` is a test module marked ``slow`` as a whole (a module-level
    ``pytestmark`` naming ``pytest.mark.slow``), read from its text without importing
    it."""
    if not (path.name.startswith("test_") and path.suffix == ".py"):
        return False
    if b"pytestmark" not in _source(str(path)):
        return False
    tree = _tree(str(path))
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "pytestmark" in names and node.value is not None:
                return any(
                    isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node.value)
                )
    return False


def mark(items: list[pytest.Item]) -> None:
    """Mark every collected test that starts a process or loads the model."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        calls: set[str] = set()
        for function in _functions_of(item):
            calls |= _calls(function)
            if _returns_an_engine(function):
                calls.add("TorchEngine")
        if calls & MODEL_CALLS:
            item.add_marker(pytest.mark.model)
        if calls & (PROCESS_CALLS | MODEL_CALLS):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("model") is not None:
            item.add_marker(pytest.mark.slow)


def unmarked_slow_modules(items: list[pytest.Item], config: pytest.Config) -> list[str]:
    """The test modules whose every test is slow but that are not marked ``slow`` as a
    whole: a fast run imports each of them (the clients' libraries, torch: seconds a
    worker) to deselect all its tests.  Only known when whole files were collected (no
    ``-k``, no ``file::test``)."""
    if config.option.keyword or any("::" in arg for arg in config.args):
        return []
    slow: dict[str, bool] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow[path] = slow.get(path, True) and item.get_closest_marker("slow") is not None
    return sorted(
        path
        for path, all_slow in slow.items()
        if all_slow and not slow_module(config.rootpath / path)
    )


def _returns_an_engine(function: Callable[..., Any]) -> bool:
    """A fixture that hands out a loaded torch engine (however it gets it: some pick one
    of several by name with ``request.getfixturevalue``)."""
    returns = getattr(inspect.unwrap(function), "__annotations__", {}).get("return", "")
    return "TorchEngine" in str(returns)


def _functions_of(item: pytest.Function) -> Iterator[Callable[..., Any]]:
    yield item.function
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for definitions in info.name2fixturedefs.values():
        for definition in definitions:
            yield definition.func


@cache
def _calls(function: Callable[..., Any], depth: int = 0) -> frozenset[str]:
    """The names ``function`` calls, and those its module's functions it calls call."""
    function = inspect.unwrap(function)
    if not isinstance(function, FunctionType) or depth > 4:
        return frozenset()
    code = function.__code__
    tree = _definitions(code.co_filename).get(code.co_firstlineno)
    if tree is None:
        return frozenset()
    module = sys.modules.get(function.__module__)
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        if isinstance(target, ast.Attribute):
            owner = target.value.id if isinstance(target.value, ast.Name) else ""
            name = target.attr
            if (owner, name) in _QUALIFIED:
                names.add("Popen")
                continue
            if (owner, name) in _IN_PROCESS:
                continue
        elif isinstance(target, ast.Name):
            name = target.id
        else:
            continue
        names.add(name)
        helper = _module_function(module, name)
        if helper is not None and helper is not function:
            names |= _calls(helper, depth + 1)
    return frozenset(names)


@cache
def _definitions(filename: str) -> dict[int, ast.AST]:
    """Each function defined in ``filename`` by the first line of its code (its first
    decorator's, or its ``def``'s): the file is parsed once, not each function's source
    read and tokenized on its own."""
    tree = _tree(filename)
    found: dict[int, ast.AST] = {}
    body = tree.body if tree is not None else []
    nodes = [*body, *(n for c in body if isinstance(c, ast.ClassDef) for n in c.body)]
    for node in nodes:  # a module's and its classes' functions: those a test can name
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.lineno] = node
            for decorator in node.decorator_list:
                found.setdefault(decorator.lineno, node)
    return found


@cache
def _source(filename: str) -> bytes:
    """``filename``'s text, read once a run (b"" when it cannot be read)."""
    try:
        return Path(filename).read_bytes()
    except OSError:
        return b""


@cache
def _tree(filename: str) -> ast.Module | None:
    """``filename``'s syntax tree, parsed once a run."""
    try:
        return ast.parse(_source(filename), filename)
    except (SyntaxError, ValueError):
        return None


def _module_function(module: ModuleType | None, name: str) -> Callable[..., Any] | None:
    value = getattr(module, name, None) if module is not None else None
    if isinstance(value, FunctionType) and value.__module__.startswith("tests"):
        return value
    return None


class ProcessGuard:
    """While a test runs, starting a process fails it (``-m "not slow"`` runs only):
    with ``subprocess``, ``os.fork`` or ``multiprocessing`` (whose fork server forks
    servers, tests/support/forked.py, where this process starts none itself)."""

    def __init__(self) -> None:
        self.test: str | None = None
        self._popen_init = subprocess.Popen.__init__
        self._fork = os.fork
        self._process_start = multiprocessing.process.BaseProcess.start

    def install(self) -> None:
        guard = self
        original = self._popen_init

        def popen_init(popen: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
            guard.refuse(args[0] if args else kwargs.get("args"))
            original(popen, *args, **kwargs)

        def fork() -> int:
            guard.refuse("os.fork()")
            return guard._fork()

        def process_start(process: multiprocessing.process.BaseProcess) -> None:
            guard.refuse(f"multiprocessing: {process.name}")
            guard._process_start(process)

        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        os.fork = fork
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._popen_init  # type: ignore[method-assign]
        os.fork = self._fork
        multiprocessing.process.BaseProcess.start = self._process_start  # type: ignore[method-assign,assignment]

    def refuse(self, what: object) -> None:
        if self.test is not None:
            pytest.fail(
                f"{self.test} starts a process ({what!r}) but is not marked slow: "
                "tests/support/slow_rule.py did not see it; mark it @pytest.mark.slow "
                "or add the call that starts it to PROCESS_CALLS",
                pytrace=False,
            )
