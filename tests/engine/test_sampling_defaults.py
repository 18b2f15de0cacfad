"""The model's recommended sampling: checkpoint, model card table, settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sluicegate.engine.sampling_defaults import (
    RecommendedSampling,
    SamplingDefaults,
    recommended_sampling,
    with_settings,
)
from sluicegate.engine.torch.loader import default_model_path, model_name_from_path


def test_the_shipped_smollm2_gets_its_model_card_sampling() -> None:
    name = model_name_from_path(Path(default_model_path()))
    defaults = recommended_sampling(name, RecommendedSampling())
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.2, 0.9, 0)
    assert "SmolLM2 model card" in defaults.describe()


def test_the_checkpoint_wins_over_the_table() -> None:
    config = RecommendedSampling.from_json({"temperature": 0.6, "top_p": 0.95, "do_sample": True})
    defaults = recommended_sampling("SmolLM2-360M-Instruct", config)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 0)
    assert defaults.source == "the checkpoint's generation config"


def test_gguf_metadata_and_nonsense_values() -> None:
    metadata = {
        "general.sampling.temp": np.float32(0.5),
        "general.sampling.top_k": np.int32(20),
        "general.sampling.top_p": np.float32(7.0),  # out of range: ignored
    }
    found = RecommendedSampling.from_gguf_metadata(metadata)
    assert found == RecommendedSampling(temperature=0.5, top_p=None, top_k=20)
    assert RecommendedSampling.from_json({"temperature": "hot", "top_k": True}).empty
    assert RecommendedSampling.from_json(found.to_json()) == found


def test_unknown_models_get_openais_defaults_and_settings_win() -> None:
    assert recommended_sampling("my-model", RecommendedSampling()) == SamplingDefaults()
    model = recommended_sampling("SmolLM2-1.7B-Instruct", RecommendedSampling())
    assert with_settings(model, None, None, None) == model
    mixed = with_settings(model, 0.0, None, 5)
    assert (mixed.temperature, mixed.top_p, mixed.top_k) == (0.0, 0.9, 5)
