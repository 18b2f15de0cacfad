"""``bench perplexity``: SmolLM2's perplexity of the fixed text is what a model this size
gets on plain English, and its own 4-bit blocks for answers leave it within 1%."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.bench.perplexity import engine_perplexity
from sluicegate.engine.torch.q4 import supported

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(not supported(), reason="no int4 CPU kernel in this torch"),
]


def test_4_bit_weights_keep_the_perplexity_of_the_text(torch_cache_dir: Path) -> None:
    full = engine_perplexity("full", cache_dir=str(torch_cache_dir))
    q4 = engine_perplexity("q4", cache_dir=str(torch_cache_dir))
    assert full.scored_tokens == q4.scored_tokens > 400
    assert 10 < full.perplexity < 100
    assert abs(q4.perplexity / full.perplexity - 1) < 0.01
