"""Projection time per decode step by weight format: ``python -m sluicegate.bench.weight_kernels``.

For each row count, the model's projections (every layer's and the output head) are timed
as one decode step would run them: bfloat16 with the weight prepacked for oneDNN (what the
engine and the compiled decode step use), int8 weight-only (``torch._weight_int8pack_mm``)
and int4 weight-only (``torch._weight_int4pack_mm_for_cpu``, groups of 32).  Random
weights of the model's shapes: the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from sluicegate.engine.torch.packed_linear import linear_packed, pack_weight


def _seconds(fn: Callable[[], object], repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


FORMATS = ("bfloat16 prepacked", "int8", "int4")


def step_ms(rows: int, shapes: list[tuple[int, int, int]]) -> dict[str, float]:
    """Milliseconds per step for ``shapes`` (out, in, how many per step) at ``rows``."""
    totals = dict.fromkeys(FORMATS, 0.0)
    for out_features, in_features, count in shapes:
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        packed = pack_weight(torch.randn(out_features, in_features, dtype=torch.bfloat16))
        w8 = torch.randint(-127, 127, (out_features, in_features), dtype=torch.int8)
        scales = torch.rand(out_features, dtype=torch.bfloat16)
        w4 = torch._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (out_features, in_features), dtype=torch.int32), 8
        )
        zeros = torch.rand(in_features // 32, out_features, 2, dtype=torch.bfloat16)
        calls = {
            "bfloat16 prepacked": partial(linear_packed, x, packed),
            "int8": partial(torch._weight_int8pack_mm, x, w8, scales),
            "int4": partial(torch._weight_int4pack_mm_for_cpu, x, w4, 32, zeros),
        }
        for name, call in calls.items():
            totals[name] += count * _seconds(call)
    return {name: seconds * 1000 for name, seconds in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    # SmolLM2-135M: 30 layers of qkv (960x576), o (576x576), gate/up (3072x576),
    # down (576x1536), and the 49,152-row output head.
    layers = 30
    shapes = [
        (960, 576, layers),
        (576, 576, layers),
        (3072, 576, layers),
        (576, 1536, layers),
        (49152, 576, 1),
    ]
    print("| rows | " + " | ".join(FORMATS) + " |")
    print("|---" * (len(FORMATS) + 1) + "|")
    for rows in args.rows:
        ms = step_ms(rows, shapes)
        print(f"| {rows} | " + " | ".join(f"{v:.1f} ms" for v in ms.values()) + " |")


if __name__ == "__main__":
    main()
