"""The torch engine on the real SmolLM2-135M-Instruct GGUF.

Correctness against Hugging Face ``transformers`` built from the same dequantised weights,
batch invariance, seeded sampling, preemption/resume, and the chat "Paris" check.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sluicegate.engine.base import EngineLimits
from sluicegate.engine.torch import TorchEngine
from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from sluicegate.engine.torch.convert import hf_config_dict, to_hf_state_dict
from sluicegate.engine.torch.loader import load_checkpoint
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepPlan, StepResult
from tests.engine.torch.conftest import TEST_THREADS
from tests.engine.torch.drive import HOLDER_ID_PREFIX, generate, greedy, run_requests

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]


class RecordingEngine:
    """Wraps an engine and remembers the shape of every plan it ran (slot holders left out:
    they are not the requests under test)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.plans: list[list[int]] = []  # num_new_tokens per sequence, per step

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def step(self, plan: StepPlan) -> StepResult:
        tested = [s for s in plan.sequences if not s.request_id.startswith(HOLDER_ID_PREFIX)]
        self.plans.append([s.num_new_tokens for s in tested])
        return self.engine.step(plan)

    def close(self) -> None:
        self.engine.close()


def encode(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


@pytest.fixture(scope="module")
def hf_model(engine_f32: TorchEngine) -> torch.nn.Module:
    """transformers' LlamaForCausalLM holding exactly our dequantised float32 weights.

    Built on the torch thread, where the tests run too (see conftest.py): a second
    OpenMP team in the process would slow every step (see TorchEngine)."""
    pytest.importorskip("transformers")
    return engine_f32.call(_build_hf_model, engine_f32)


def _build_hf_model(engine_f32: TorchEngine) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**hf_config_dict(engine_f32.args))
    config._attn_implementation = "eager"
    with torch.device("meta"):  # skip 135M parameters' worth of random init
        model: Any = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers were on meta
    state = to_hf_state_dict(engine_f32.args, engine_f32.model.state_dict())
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    result: torch.nn.Module = model.eval()
    return result


def test_engine_identity(engine_f32: TorchEngine) -> None:
    assert engine_f32.model_name == "SmolLM2-135M-Instruct"
    im_end = engine_f32.tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert im_end in engine_f32.eos_token_ids
    assert engine_f32.limits.max_num_seqs == 8
    assert engine_f32.limits.max_model_len == 512
    args = engine_f32.args
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads) == (30, 576, 9, 3)
    assert args.rope_theta == 100000.0 and args.tie_word_embeddings


def test_qk_unpermute_matches_transformers_gguf_loader(
    engine_f32: TorchEngine, smollm2_path: str
) -> None:
    """An independent check of the rotary layout: transformers' own GGUF tensor processor
    applied to the raw dequantised file tensors gives our Q and K rows."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    args = engine_f32.args
    heads = {"num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads}
    processor: Any = LlamaTensorProcessor(config=heads)  # type: ignore[no-untyped-call]
    reader = GGUFReader(smollm2_path)
    tensors = {t.name: t for t in reader.tensors}
    state = engine_f32.model.state_dict()
    for layer in (0, 17, 29):
        wqkv = state[f"layers.{layer}.attention.wqkv.weight"]
        q, k, _ = torch.split(wqkv, [576, 192, 192])
        for name, ours in (("attn_q", q), ("attn_k", k)):
            gguf_name = f"blk.{layer}.{name}.weight"
            t = tensors[gguf_name]
            raw = dequantize(t.data, t.tensor_type)
            theirs = processor.process(raw, gguf_name).weights
            assert torch.equal(ours, torch.from_numpy(theirs.copy()))


def test_logits_match_transformers(engine_f32: TorchEngine, hf_model: torch.nn.Module) -> None:
    prompts = [encode(engine_f32, p) for p in PROMPTS[:3]]
    prompts.append(engine_f32.tokenizer.encode_chat([{"role": "user", "content": "Hi there!"}]))
    with torch.inference_mode():
        for ids in prompts:
            expected = hf_model(torch.tensor([ids])).logits[0]  # [S, V]
            # Ours: prefill in chunks of 4, asking for each chunk's last logits.
            rows, positions = [], []
            for start in range(0, len(ids), 4):
                n = min(4, len(ids) - start)
                batch, _ = build_batch([SequenceChunk(0, start, n, True)])
                rows.append(engine_f32.model(torch.tensor(ids[start : start + n]), batch)[0])
                positions.append(start + n - 1)
            torch.testing.assert_close(torch.stack(rows), expected[positions], atol=2e-4, rtol=1e-4)


def test_greedy_continuation_matches_transformers(
    engine_f32: TorchEngine, hf_model: torch.nn.Module
) -> None:
    prompts = [encode(engine_f32, p) for p in PROMPTS[:2]]
    # A 5-token budget per step: the second prompt is prefilled in chunks while the first
    # decodes.
    outputs = generate(engine_f32, prompts, max_new_tokens=16, max_num_batched_tokens=5)
    with torch.inference_mode():
        for ids, ours in zip(prompts, outputs, strict=True):
            seq = list(ids)
            for _ in range(len(ours)):
                seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
            assert ours == seq[len(ids) :]


def test_batched_generation_equals_each_alone(engine: TorchEngine) -> None:
    prompts = [encode(engine, p) for p in PROMPTS]
    # Alone: each prompt in slot 0, prefilled whole (a 64-token budget).
    alone = [generate(engine, [p], max_new_tokens=12)[0] for p in prompts]
    recorder = RecordingEngine(engine)
    # A budget of 16 tokens per step (3 of them to slot holders at first): prefill chunks
    # and decode tokens of different sequences share steps, in slots 3.. (not slot 0,
    # where they ran alone).
    together = generate(
        recorder, prompts, max_new_tokens=12, max_num_batched_tokens=16, hold_slots=3
    )
    assert together == alone
    mixed = [p for p in recorder.plans if 1 in p and any(n > 1 for n in p)]
    assert mixed, "no step mixed decode tokens with prefill chunks"
    assert max(len(p) for p in recorder.plans) == len(prompts)


def test_seeded_sampling_is_independent_of_the_batch(engine: TorchEngine) -> None:
    prompt = encode(engine, PROMPTS[2])
    sampled = SamplingParams(max_tokens=20, seed=1234, temperature=0.9, top_p=0.95, top_k=40)
    alone = generate(engine, [prompt], max_new_tokens=20, sampling=sampled)[0]
    others = [encode(engine, p) for p in PROMPTS[:2]]
    mixed_params = [
        SamplingParams(max_tokens=20, seed=1, temperature=1.2),
        greedy(20),
        sampled,
    ]
    # Prefilled in chunks (an 8-token budget, 2 of them to slot holders at first) beside
    # decode steps of the others, in slot 2 or above (alone: slot 0).
    together = generate(
        engine,
        [*others, prompt],
        max_new_tokens=20,
        sampling=mixed_params,
        max_num_batched_tokens=8,
        hold_slots=2,
    )
    assert together[2] == alone
    other_seed = SamplingParams(max_tokens=20, seed=4321, temperature=0.9, top_p=0.95, top_k=40)
    assert generate(engine, [prompt], max_new_tokens=20, sampling=other_seed)[0] != alone


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.",
    "What is the boiling point of water?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
]


def last_logits(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        batch, _ = build_batch([SequenceChunk(0, 0, len(ids), True)])
        result: torch.Tensor = engine.model(torch.tensor(ids), batch)[-1]
    return result


def chat_prompts(engine: TorchEngine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]


def test_nine_seeded_prompts_alone_batched_and_resumed_agree(engine: TorchEngine) -> None:
    """Bit-exact batch invariance at scale: 9 sampled chat answers, each computed alone,
    eight at a time in other slots with chunked prefill (the ninth in a slot another has
    left), and re-prefilled after a "preemption" half-way (KV dropped, tokens kept, in
    chunks, in another slot), give the same tokens.  (Greedy decoding is the argmax of
    the same logits.)"""
    prompts = chat_prompts(engine)[:9]
    params = [
        SamplingParams(max_tokens=10, seed=100 + i, temperature=0.8, top_p=0.95, ignore_eos=True)
        for i in range(len(prompts))
    ]
    alone = [
        generate(engine, [p], max_new_tokens=10, sampling=[s])[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    # A 32-token budget per step, less than any prompt: every prompt is prefilled in chunks.
    together = generate(
        engine, prompts, max_new_tokens=10, sampling=params, max_num_batched_tokens=32
    )
    assert together == alone
    resumed = []
    for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
        request = Request(f"resumed-{i}", list(p), s)
        request.all_token_ids.extend(alone[i][:5])
        resumed.append(request)
    # Re-prefilled in chunks (the same 32-token budget, less than any of them) in slots 1..
    # (slot 0, where each ran alone, is held).
    run_requests(engine, resumed, max_num_batched_tokens=32, hold_slots=1)
    assert [r.output_token_ids for r in resumed] == alone


def test_bfloat16_departs_from_float32_only_at_near_ties(
    engine_f32: TorchEngine, engine_bf16: TorchEngine
) -> None:
    """Greedy chat answers in bfloat16 against float32: most are identical, and where one
    departs, float32 itself scored the two tokens within a small margin."""
    prompts = chat_prompts(engine_f32)[:8]
    assert prompts == chat_prompts(engine_bf16)[:8]
    f32 = generate(engine_f32, prompts, max_new_tokens=32)
    bf16 = generate(engine_bf16, prompts, max_new_tokens=32)
    identical = 0
    for prompt, a, b in zip(prompts, f32, bf16, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:
            assert a == b
            identical += 1
            continue
        logits = last_logits(engine_f32, prompt + a[:first])
        margin = float(logits[a[first]] - logits[b[first]])
        assert 0 <= margin < 0.5, f"bfloat16 overturned a float32 margin of {margin:.3f}"
    assert identical >= len(prompts) // 2


def ask(engine: TorchEngine, question: str, max_new_tokens: int = 32) -> tuple[str, list[int]]:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
    out = generate(engine, [ids], max_new_tokens=max_new_tokens)[0]
    return engine.tokenizer.decode(out), out


def test_paris_float32(engine_f32: TorchEngine) -> None:
    text, out = ask(engine_f32, "What is the capital of France?")
    assert "Paris" in text
    assert out[-1] in engine_f32.eos_token_ids  # the chat answer ends by itself


def test_paris_bfloat16(smollm2_path: str, torch_cache_dir: Path) -> None:
    engine = TorchEngine(
        smollm2_path,
        dtype="bfloat16",
        max_num_seqs=2,
        max_model_len=256,
        cache_dir=str(torch_cache_dir),
        num_threads=TEST_THREADS,
    )
    try:
        assert engine.model.dtype == torch.bfloat16
        text, out = ask(engine, "What is the capital of France?")
        assert "Paris" in text
        assert out[-1] in engine.eos_token_ids
    finally:
        engine.close()


def test_warm_cache_holds_the_same_weights(
    engine_f32: TorchEngine, smollm2_path: str, torch_cache_dir: Path
) -> None:
    entries = list((torch_cache_dir / "torch").iterdir())
    assert len(entries) == 1
    files = {p.name for p in entries[0].iterdir()}
    assert {"meta.json", "tokenizer.json", "model-float32.safetensors"} <= files
    meta = json.loads((entries[0] / "meta.json").read_text())
    assert meta["name"] == "SmolLM2-135M-Instruct"
    warm = load_checkpoint(smollm2_path, "float32", torch_cache_dir)
    assert warm.args == engine_f32.args
    loaded = engine_f32.model.state_dict()
    assert warm.state_dict.keys() == loaded.keys()
    for name, tensor in warm.state_dict.items():
        assert torch.equal(tensor, loaded[name]), name
    assert warm.tokenizer.eos_token_ids == engine_f32.eos_token_ids


def test_hugging_face_directory_gives_the_same_model(
    engine_f32: TorchEngine, smollm2_path: str, torch_cache_dir: Path, tmp_path: Path
) -> None:
    """``sluicegate export-hf`` writes a directory that loads as the same model."""
    from sluicegate.engine.torch.export import export_hf_directory

    export_hf_directory(smollm2_path, tmp_path, cache_dir=torch_cache_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and 2 in config["eos_token_id"]
    engine = TorchEngine(
        str(tmp_path), dtype="float32", max_num_seqs=2, max_model_len=128, num_threads=TEST_THREADS
    )
    try:
        assert engine.model_name == tmp_path.name
        assert set(engine.eos_token_ids) >= {2}
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
        assert prompt == engine_f32.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
        ours = generate(engine, [prompt], max_new_tokens=8)
        assert ours == generate(engine_f32, [prompt], max_new_tokens=8)
    finally:
        engine.close()


def test_plan_validation(engine_f32: TorchEngine) -> None:
    ids = encode(engine_f32, "Hello")
    sampling = greedy(4)

    def seq(slot: int, start: int = 0, n: int | None = None) -> ScheduledSequence:
        n = len(ids) if n is None else n
        return ScheduledSequence(f"r{slot}", slot, ids, start, n, True, sampling, len(ids))

    with pytest.raises(ValueError, match="out of range"):
        engine_f32.step(StepPlan([seq(99)]))
    with pytest.raises(ValueError, match="twice"):
        engine_f32.step(StepPlan([seq(1), seq(1)]))
    with pytest.raises(ValueError, match="bad chunk"):
        engine_f32.step(StepPlan([seq(1, start=1, n=len(ids))]))
    assert engine_f32.step(StepPlan()).sampled_token_ids == {}
    # A prefill chunk that does not reach the end samples nothing.
    partial = ScheduledSequence("p", 0, ids, 0, 1, False, sampling, len(ids))
    assert engine_f32.step(StepPlan([partial])).sampled_token_ids == {}


@pytest.mark.caller_thread
def test_step_runs_on_another_thread(engine_f32: TorchEngine) -> None:
    ids = encode(engine_f32, PROMPTS[0])
    expected = generate(engine_f32, [ids], max_new_tokens=4)[0]
    result: list[list[int]] = []
    worker = threading.Thread(
        target=lambda: result.append(generate(engine_f32, [ids], max_new_tokens=4)[0])
    )
    worker.start()
    worker.join()
    assert result == [expected]
