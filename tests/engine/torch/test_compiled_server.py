"""``--engine-compile decode`` through the real server: it serves eagerly while the
package builds in the background, then decodes through it; a restart loads the package.

The model is SmolLM2 cut to its first layer (same widths, tokenizer and template), so
the background build takes seconds rather than a minute.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.model]

LAYERS = 1


@pytest.fixture(scope="module")
def two_layer_model(
    smollm2_path: str, torch_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from sluicegate.engine.torch.export import export_hf_directory

    out = export_hf_directory(
        smollm2_path, tmp_path_factory.mktemp("smollm2-cut"), cache_dir=torch_cache_dir
    )
    weights = load_file(out / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < LAYERS
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": LAYERS}))
    return out


def serve(model: Path, cache: Path) -> ServerProcess:
    return start_server(
        ["--model", str(model), "--engine-compile", "decode", "--max-num-seqs", "4",
         "--max-model-len", "256", "--cache-dir", str(cache),
         # The build competes for the CPU; this test is not about admission.
         "--ttft-slo-ms", "60000"],
        "compiled",
    )  # fmt: skip


def complete(server: ServerProcess, seed: int) -> str:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        reply = client.completions.create(
            model=str(server.stats()["model"]), prompt="Once upon a time", max_tokens=24,
            temperature=0.8, seed=seed, extra_body={"ignore_eos": True},
        )  # fmt: skip
    return reply.choices[0].text


def test_builds_in_the_background_then_decodes_compiled(
    two_layer_model: Path, tmp_path: Path
) -> None:
    server = serve(two_layer_model, tmp_path)
    try:
        assert server.stats()["engine_compile"] == "building"
        assert complete(server, 1)  # served eagerly meanwhile
        deadline = time.monotonic() + 300
        while server.stats()["engine_compile"] == "building":  # each step looks at the build
            assert time.monotonic() < deadline, "the compiled decode step was not built"
            complete(server, 1)
            time.sleep(1)
        assert server.stats()["engine_compile"] == "ready"
        alone = complete(server, 7)
        with ThreadPoolExecutor(4) as pool:
            batched = list(pool.map(lambda seed: complete(server, seed), [7, 8, 9, 7]))
        assert batched[0] == batched[3] == alone  # seeded: the same alone and batched
        assert len(set(batched[:3])) == 3
    finally:
        server.stop()
    assert list((tmp_path / "compiled").glob("*.pt2"))
    restarted = serve(two_layer_model, tmp_path)  # the package is loaded at start
    try:
        assert restarted.stats()["engine_compile"] == "ready"
        assert complete(restarted, 7) == alone
    finally:
        restarted.stop()
