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

import pytest

#: Files of more than ~5 s of tests each in one ``make test``, longest first.
LONGEST_FIRST = (
    "tests/engine/torch/test_smollm2.py",
    "tests/engine/torch/test_compiled.py",
    "tests/tools/test_model.py",
    "tests/clients/test_embedded_model.py",
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

_RANK = {path: rank for rank, path in enumerate(LONGEST_FIRST)}


def longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of :data:`LONGEST_FIRST` first, in its order,
    then the rest as collected; the tests of a file keep their order."""
    unlisted = len(LONGEST_FIRST)
    items.sort(key=lambda item: _RANK.get(item.nodeid.split("::", 1)[0], unlisted))
