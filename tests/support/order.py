"""The order in which ``make test`` hands files to its workers: the longest first.

Under ``--dist loadfile`` a file runs whole on one worker, and files are handed out in
collection order (``--no-loadscope-reorder``; pytest-xdist's own reordering puts the
files with the most tests first, so the long files of one or two tests, the peers,
the replicas, the speculation test, came last, and one of them could run alone at the
end while the other worker idled). Starting the long ones first leaves only short files
for the end, where they even out the workers.

The list is measured, not guessed: the files' summed test times in one ``make test``
(``--durations=0``), longest first; a file not listed follows them in collection order.
It only orders: a stale list costs time, never a result.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Files of more than ~5 s of tests each in one ``make test``, longest first.
LONGEST_FIRST = (
    "tests/engine/torch/test_smollm2.py",
    "tests/engine/torch/test_compiled.py",
    "tests/tools/test_model.py",
    "tests/clients/test_embedded_model.py",
    "tests/engine/torch/test_families.py",
    "tests/engine/torch/test_q4_server.py",
    "tests/upstream/test_peers.py",
    "tests/web/test_playground.py",
    "tests/resume/test_responses_resume.py",
    "tests/api/test_concurrency.py",
    "tests/clients/test_openai_tools.py",
    "tests/engine/torch/test_sampling_surface_model.py",
    "tests/test_server.py",
    "tests/api/test_idle_refusals.py",
    "tests/resume/test_replicas.py",
    "tests/engine/torch/test_grammar.py",
    "tests/reliability/test_hostile_upstream.py",
    "tests/upstream/test_gateway.py",
    "tests/bench/test_startup.py",
    "tests/api/test_request_objective.py",
    "tests/stream/test_flow_e2e.py",
    "tests/bench/test_compare.py",
    "tests/web/test_dashboard.py",
    "tests/engine/torch/test_server.py",
    "tests/test_wheel.py",
    "tests/bench/test_burst_retry.py",
    "tests/resume/test_resume.py",
    "tests/upstream/test_stalls.py",
    "tests/upstream/test_replicas.py",
    "tests/api/test_slo_admission.py",
    "tests/upstream/test_failover.py",
    "tests/reliability/test_schema_fuzz.py",
    "tests/clients/test_openai_sampling.py",
    "tests/api/test_admission_before_parsing.py",
    "tests/bench/test_run_counters.py",
    "tests/api/test_batches.py",
    "tests/upstream/test_silence.py",
    "tests/reliability/test_store_outage.py",
    "tests/api/test_front_door.py",
    "tests/engine/torch/test_speculation.py",
    "tests/api/test_jobs.py",
    "tests/clients/test_litellm.py",
    "tests/reliability/test_disconnect_storm.py",
    "tests/service/test_choices.py",
    "tests/engine/torch/test_prefix_cache.py",
    "tests/resume/test_access.py",
    "tests/bench/test_capacity.py",
    "tests/engine/torch/test_tokenizer.py",
    "tests/api/test_drain.py",
    "tests/tools/test_openai_sim.py",
)

#: Session fixtures that cost seconds of CPU each to make (a SmolLM2 server: torch, the
#: weights, the calibration; SmolLM2 in process), and the group of files that share each.
#: A group runs whole on one worker, its files one after another, as one file would: the
#: run makes each fixture once, not once on every worker that happens to run a file that
#: uses it (three SmolLM2 servers a run, each ~12 s of CPU to start, and the in-process
#: engines likewise).
SHARED_FIXTURES = {
    "model_server": "smollm2-server",
    "engine_f32": "smollm2-in-process",
    "engine_bf16": "smollm2-in-process",
    "engine_q4": "smollm2-in-process",
}

#: The files of each group; :func:`check_groups` fails a run where a file uses a shared
#: fixture and is not listed under its group (the list is what the controller, which
#: collects nothing, schedules by).
GROUPS = {
    "smollm2-server": (
        "tests/tools/test_model.py",
        "tests/clients/test_embedded_model.py",
        "tests/service/test_choices.py",
        "tests/api/test_logprobs_model.py",
        "tests/engine/torch/test_server.py",
    ),
    "smollm2-in-process": (
        "tests/engine/torch/test_smollm2.py",
        "tests/engine/torch/test_grammar.py",
        "tests/engine/torch/test_speculation.py",
        "tests/engine/torch/test_prefix_cache.py",
        "tests/engine/torch/test_sampling_surface_model.py",
    ),
}

_GROUP_OF = {path: group for group, paths in GROUPS.items() for path in paths}


def scope(nodeid: str) -> str:
    """The unit a test is scheduled in: its file's group, or its file."""
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(path, path)


def _ranks() -> dict[str, tuple[int, int]]:
    """Each file's place: a group's files together, where the group's longest file is,
    in the group's order."""
    rank = {path: (i, 0) for i, path in enumerate(LONGEST_FIRST)}
    for paths in GROUPS.values():
        first = min(rank.get(path, (len(LONGEST_FIRST), 0))[0] for path in paths)
        rank.update({path: (first, j) for j, path in enumerate(paths)})
    return rank


_RANK = _ranks()


def longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of :data:`LONGEST_FIRST` first, in its order
    (a group's files together where its longest is), then the rest as collected; the
    tests of a file keep their order."""
    unlisted = (len(LONGEST_FIRST), 0)
    items.sort(key=lambda item: _RANK.get(item.nodeid.split("::", 1)[0], unlisted))


def check_groups(items: list[pytest.Item]) -> None:
    """Fail the run when a file uses a shared fixture outside the group that shares it."""
    wrong = {
        f"{path} uses {name}: list it in tests/support/order.py GROUPS[{group!r}]"
        for item in items
        for name, group in SHARED_FIXTURES.items()
        if name in getattr(item, "fixturenames", ())
        and _GROUP_OF.get(path := item.nodeid.split("::", 1)[0]) != group
    }
    if wrong:
        raise pytest.UsageError("\n".join(sorted(wrong)))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with :data:`GROUPS` as units (pytest-xdist's own scheduler,
    the unit of a test changed), or None for any other ``--dist``."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return GroupScheduling(config, log)
