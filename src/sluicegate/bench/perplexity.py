"""``sluicegate bench perplexity``: the embedded model's perplexity of a fixed text with
its full weights and with 4-bit ones, and llama.cpp's on the same GGUF.

The text (``bench/texts/rivers.txt``, plain English written for this) is cut into windows
of ``context`` tokens, as llama.cpp's ``llama-perplexity`` cuts it; each window is one
sequence from position 0, and only the predictions from its second half are scored (each
then has at least half a window before it).  With ``weights="q4"`` every token goes
through the 4-bit projections (rows marked as an answer's: what decoded tokens use), with
``full`` through the dtype's.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sluicegate.engine.torch.runner import TorchEngine

#: Tokens a window holds; its second half is scored.
CONTEXT = 256


def text() -> str:
    return (resources.files("sluicegate.bench") / "texts" / "rivers.txt").read_text("utf-8")


@dataclass(slots=True)
class Perplexity:
    label: str
    perplexity: float
    scored_tokens: int


def engine_perplexities(
    model: str | None = None, context: int = CONTEXT, cache_dir: str | None = None
) -> list[Perplexity]:
    """The embedded model's perplexity of :func:`text` with full weights and with 4-bit
    ones: one bfloat16 engine with ``--weights q4`` computes both (its prompt rows take
    the full weights, its answer rows the 4-bit ones)."""
    from sluicegate.engine.torch.runner import TorchEngine

    engine = TorchEngine(model, "bfloat16", 1, context, cache_dir=cache_dir, weights="q4")
    try:
        return [perplexity(engine, "full", context), perplexity(engine, "q4", context)]
    finally:
        engine.close()


def perplexity(engine: TorchEngine, weights: str, context: int = CONTEXT) -> Perplexity:
    """``engine``'s perplexity of :func:`text`, every token computed as a prompt's
    (``weights="full"``) or as an answer's (``"q4"``: the 4-bit weights, if it has them)."""
    from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch

    tokens = engine.tokenizer.encode(text())
    windows = [tokens[i : i + context] for i in range(0, len(tokens) - context + 1, context)]
    if not windows:
        raise ValueError(f"the text has fewer than {context} tokens")
    answer_start = 0 if weights == "q4" else None

    def window_nll(window: list[int]) -> tuple[float, int]:
        chunk = SequenceChunk(0, 0, len(window), len(window), answer_start)
        batch, _ = build_batch([chunk])
        with torch.inference_mode():
            logits = engine.model(torch.tensor(window), batch)  # [C, V] float32
        logprobs = torch.log_softmax(logits, dim=-1)
        # As llama-perplexity: rows first .. C - 2 predict the tokens after them.
        first = context // 2
        targets = torch.tensor(window[first + 1 :])
        picked = logprobs[first:-1].gather(1, targets[:, None])
        return -float(picked.sum()), len(targets)

    total, count = 0.0, 0
    for window in windows:
        nll, n = engine.call(window_nll, window)
        total += nll
        count += n
    dtype = str(engine.dtype).removeprefix("torch.")
    return Perplexity(f"sluicegate {dtype} weights={weights}", math.exp(total / count), count)


def llama_perplexity_of(binary: str, model: str, context: int = CONTEXT) -> Perplexity:
    """llama.cpp's ``llama-perplexity`` on the same text and windows (2 threads)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "text.txt"
        path.write_text(text(), encoding="utf-8")
        args = ["-m", model, "-f", str(path), "-c", str(context), "-b", str(context), "-t", "2"]
        done = subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=600, check=False
        )
    output = done.stdout + done.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    if done.returncode or found is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {output[-400:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", output)
    scored = int(chunks.group(1)) * (context - 1 - context // 2) if chunks else 0
    return Perplexity("llama.cpp llama-perplexity", float(found.group(1)), scored)
