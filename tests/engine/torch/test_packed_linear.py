"""Prepacked projections: a row's result does not depend on how many rows share the call."""

from __future__ import annotations

import pytest
import torch

from sluicegate.engine.torch.packed_linear import (
    AMX_MAX_ROWS,
    linear_packed,
    max_rows_per_call,
    pack_weight,
    packing_supported,
)

pytestmark = pytest.mark.slow

#: SmolLM2-135M's fused QKV, down and output projections (out, in): every width of input
#: the model has, and the widest output.
SHAPES = [(960, 576), (576, 1536), (49152, 576)]


#: Most rows tested.
MAX_ROWS = 80


def row_counts(dtype: torch.dtype) -> list[int]:
    """Every row count from 2 to :data:`MAX_ROWS`: each is one oneDNN call.  Where rows go
    at most ``limit`` to a call (:func:`max_rows_per_call`), more rows are computed as
    calls of at most ``limit``: there every count up to ``limit + 1`` (a full call and a
    single row), then a full call and a part, two full calls, two and a single row, and
    the most."""
    limit = max_rows_per_call(dtype)
    if limit is None:
        return list(range(2, MAX_ROWS + 1))
    return [*range(2, limit + 2), limit + limit // 2, 2 * limit, 2 * limit + 1, MAX_ROWS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_rows_result_does_not_depend_on_the_row_count(
    dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    """Up to 80 rows, past AMX's 32 (where oneDNN's own result changes, see
    :func:`max_rows_per_call`): at each count of :func:`row_counts`, each row's bits are
    those it gets alone."""
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} here")
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) / 24).to(dtype)
    packed = pack_weight(weight)
    x = torch.randn(MAX_ROWS, in_features, generator=generator).to(dtype)
    alone = torch.cat([linear_packed(row, packed) for row in torch.split(x, 1)])  # [80, out]
    for rows in row_counts(dtype):
        assert torch.equal(linear_packed(x[:rows], packed), alone[:rows]), rows


def test_only_bfloat16_on_amx_is_computed_in_parts() -> None:
    amx = bool(torch.cpu.get_capabilities().get("amx_bf16", False))
    assert max_rows_per_call(torch.bfloat16) == (AMX_MAX_ROWS if amx else None)
    assert max_rows_per_call(torch.float32) is None
