"""The tree reads as the chain: layers import downwards only, no cycles, small modules.

Counts every import, including those inside functions and under ``TYPE_CHECKING``: a
cycle hidden that way is still a cycle in the design.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "sluicegate"

#: Top to bottom: each may import only what is below it (and its own modules).
LAYERS = [
    ("__main__",),
    ("cli",),
    ("serve_flags",),
    ("server", "bench"),
    ("connections",),
    ("api",),
    ("stream",),
    ("service",),
    ("pipeline",),
    ("queue",),
    ("engine",),
    ("tools",),
    ("config",),
    (
        "upstream_settings",
        "flow_settings",
        "pipeline_settings",
        "prefill_settings",
        "torch_settings",
    ),
    ("admission",),
    ("scheduler", "store", "metrics"),
    ("errors", "types", "sizes"),
]
MAX_MODULE_LINES = 500


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {
        name: {t for t in imports(name, path) if t in mods and t != name}
        for name, path in mods.items()
    }


def stage(module: str) -> str:
    """``sluicegate.api.app`` -> ``api``; ``sluicegate.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(name: str) -> int:
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_architecture.py")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_another_in_a_cycle() -> None:
    assert cycles(graph()) == []


def test_every_stage_imports_only_stages_below_it() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in graph().items()
        if source != PACKAGE
        for target in targets
        if target != PACKAGE
        and stage(target) != stage(source)
        and layer_of(stage(target)) <= layer_of(stage(source))
    ]
    assert upward == []


def test_the_scheduler_never_imports_torch_and_the_api_no_engine_internals() -> None:
    for name, path in modules().items():
        found = imports(name, path)
        if stage(name) == "scheduler":
            assert not any(t == "torch" or t.startswith("torch.") for t in found), name
        if stage(name) in ("api", "stream", "service", "queue"):
            assert not any(t.startswith("sluicegate.engine.torch") for t in found), name


def test_the_api_process_loads_without_torch() -> None:
    """A server on the sim engine or an upstream never needs torch, and importing it costs
    over a second at every start (it once crept in through a module the API imports)."""
    code = "import sys, sluicegate.api.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "sluicegate.api.app imports torch"


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name: str) -> None:
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines; split it by concept"


def test_a_request_holds_only_the_schedulers_state() -> None:
    """The scheduler's :class:`Request` carries its progress; pause, pace and reuse are
    parts with owners of their own, and what a planner tracks about it (a long prompt
    passed over) stays in the planner: a field added for each feature made it 27 once."""
    from sluicegate.scheduler.request import Request

    assert len(dataclasses.fields(Request)) <= 15
