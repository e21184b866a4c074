"""Generate, grade and record evaluation samples with the training rollout, engine and tools.

Each sample (one question, one run) is one :meth:`ARPORollout.agenerate` call in ``mode: single`` with
``n = 1`` and its own seed, so it has its own per-tool call counter
(:class:`~arpo.evaluation.tool_limits.TrajectoryToolLimits`) and finishes on its own: it is graded and
appended to its benchmark's JSONL the moment it ends. ``concurrency`` samples are in flight at once;
the engine batches their requests (and the prefix cache shares the prompt of a question's runs, which
are queued next to each other).

With several engine replicas (one per GPU, or per tensor-parallel group, as in training) each sample runs whole on
one of them: the replica with the fewest samples in flight when it starts, ties in turn. A sample's turns stay on
one replica, whose prefix cache holds its history. Its requests carry their own seeds (from the run seed, benchmark,
question and run), so the replica does not change what it samples, beyond the float rounding that the requests
batched beside it give on one engine too.

Each benchmark has its own response budget (``response_budgets``, from ``eval.max_response_length_per_benchmark``;
the rollout config's ``sampling.max_response_length`` for the others). A sample that reaches it is recorded with
``truncated: true`` (``finish_reason`` ``length``). The bar (:mod:`arpo.evaluation.progress`) counts finished
samples and shows the samples in flight and the tokens they generate, updated after every engine request.

Grading runs in the event loop's thread, the main thread: math-verify's time limits use ``SIGALRM``,
which works only there, and grading one answer takes milliseconds against seconds of generation.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from arpo.evaluation.benchmarks import EvalItem
from arpo.evaluation.metrics import arpo_metrics, released_task
from arpo.evaluation.progress import EvalProgress, TokenCountingEngine
from arpo.evaluation.records import SampleWriter
from arpo.evaluation.tool_limits import TrajectoryToolLimits
from arpo.protocol import extract_answer
from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig, derive_seed
from arpo.rollout.tool_executor import ToolExecutor
from reward_fns.manager import score_one
from reward_fns.registry import RewardRegistry

logger = logging.getLogger(__name__)


@dataclass
class SampleSpec:
    """Everything that identifies one sample to generate."""

    item: EvalItem
    run: int
    prompt_ids: list[int]


def accepts_kwarg(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _streams_tokens(engine: Any) -> bool:
    """Whether ``engine`` reports tokens as it generates them (an in-process vLLM engine's ``token_listener``). Only
    a real attribute counts: a Ray replica's client answers every name (as a remote call), and a listener set on it
    would never be called."""
    return "token_listener" in getattr(engine, "__dict__", {}) or hasattr(type(engine), "token_listener")


class Grader:
    """Scores a response with the run's compute_score (the reward registry or a custom function).

    ``require_format=False`` is passed to the registry rewards that take it (the built-in qa, math and
    synthetic ones), so a wrong tag sequence does not hide a correct boxed answer, as in ARPO's evaluation.
    """

    def __init__(self, compute_score: Callable[..., Any], require_format: bool = False, error_score: float = 0.0):
        self.compute_score = compute_score
        self.require_format = require_format
        self.error_score = error_score
        self._kwargs: dict[str, dict[str, Any]] = {}

    def check_routes(self, data_sources: set[str]) -> None:
        """Fail before any generation when a data source has no reward (KeyError naming it and the fix)."""
        if isinstance(self.compute_score, RewardRegistry):
            for source in sorted(data_sources):
                self.compute_score.lookup(source)

    def _kwargs_for(self, data_source: str) -> dict[str, Any]:
        # Only registry rewards that declare the parameter get it: a custom_reward_function is called with
        # exactly verl's four arguments, as in training.
        if data_source not in self._kwargs:
            fn = self.compute_score
            takes = isinstance(fn, RewardRegistry) and accepts_kwarg(fn.lookup(data_source).resolve(),
                                                                      "require_format")
            self._kwargs[data_source] = {"require_format": self.require_format} if takes else {}
        return self._kwargs[data_source]

    def grade(self, data_source: str, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> dict[str, Any]:
        kwargs = self._kwargs_for(data_source)
        fn = self.compute_score

        def call(ds, sol, gt, extra):
            return fn(ds, sol, gt, extra, **kwargs)

        return score_one(call, (data_source, response, ground_truth, extra_info), self.error_score)


class EvalRunner:
    """Runs samples through the rollout, grades them and appends each record as it finishes. ``engine``: one
    engine, or a Sequence of replicas the samples are spread over (see the module docstring)."""

    def __init__(self, engine: Any, tokenizer: Any, executor: ToolExecutor, rollout_config: ARPORolloutConfig,
                 tool_limits: dict[str, int], refuse_repeated: tuple[str, ...], grader: Grader,
                 writer: SampleWriter, method: str, seed: int, concurrency: int = 64, show_progress: bool = True,
                 response_budgets: Mapping[str, int] | None = None):
        self.engine = engine
        if not self.engines:
            raise ValueError("EvalRunner needs at least one engine")
        #: samples each replica has run, and those it runs now (what picks the next sample's replica)
        self.replica_samples = [0] * len(self.engines)
        self._replica_load = [0] * len(self.engines)
        self._next_replica = 0
        #: the replicas as this run's samples see them (:meth:`_counted_engines`), set while :meth:`run` runs
        self._run_engines: list[Any] | None = None
        self.tokenizer = tokenizer
        self.executor = executor
        self.rollout_config = rollout_config.validate()
        self.tool_limits = dict(tool_limits)
        self.refuse_repeated = tuple(refuse_repeated)
        self.grader = grader
        self.writer = writer
        self.method = method
        self.seed = int(seed)
        self.concurrency = max(1, int(concurrency))
        self.show_progress = show_progress
        #: benchmark -> response tokens per sample (the others: rollout_config.sampling.max_response_length)
        self.response_budgets = {str(k): int(v) for k, v in (response_budgets or {}).items()}
        self._configs: dict[int, ARPORolloutConfig] = {}
        #: the run's bar while :meth:`run` runs
        self.progress: EvalProgress | None = None
        #: identifies the process that wrote a record (a resumed run writes a new one)
        self.session = uuid.uuid4().hex[:12]

    def sample_seed(self, item: EvalItem, run: int) -> int:
        return derive_seed(self.seed, item.benchmark, item.index, run)

    def response_budget(self, benchmark: str) -> int:
        return self.response_budgets.get(benchmark, self.rollout_config.sampling.max_response_length)

    def _config_for(self, budget: int) -> ARPORolloutConfig:
        if budget not in self._configs:
            self._configs[budget] = self.rollout_config.updated({"sampling.max_response_length": budget})
        return self._configs[budget]

    @property
    def engines(self) -> list[Any]:
        """The replicas the samples are spread over: ``engine``, or each engine of the Sequence given."""
        return list(self.engine) if isinstance(self.engine, Sequence) else [self.engine]

    def _counted_engines(self) -> list[Any]:
        """The replicas as this run's samples see them: every request's tokens reach the bar."""
        if len(self.replica_samples) != len(self.engines):  # ``engine`` was replaced since the last run
            self.replica_samples, self._replica_load = [0] * len(self.engines), [0] * len(self.engines)
            self._next_replica = 0
        if self.progress is None:
            return list(self.engines)
        if all(_streams_tokens(e) for e in self.engines):
            for e in self.engines:  # an in-process vLLM engine streams: tokens reach the bar as they are generated
                e.token_listener = self.progress.generated
            return list(self.engines)
        return [TokenCountingEngine(e, self.progress.generated) for e in self.engines]

    def _pick_replica(self) -> int:
        """The replica with the fewest samples in flight; ties go in turn from the one after the last pick, so
        samples that start one at a time (``concurrency`` 1, or a resumed run's few) still alternate."""
        n = len(self.engines)
        idx = min(((self._next_replica + k) % n for k in range(n)), key=self._replica_load.__getitem__)
        self._next_replica = (idx + 1) % n
        return idx

    async def run_sample(self, spec: SampleSpec) -> dict[str, Any]:
        item, run = spec.item, spec.run
        seed = self.sample_seed(item, run)
        budget = self.response_budget(item.benchmark)
        limits = TrajectoryToolLimits(self.executor, self.tool_limits, self.refuse_repeated)
        replica = self._pick_replica()
        engine = (self._run_engines or self.engines)[replica]
        # one engine per rollout: a rollout given several would route by its own load count, which starts
        # from zero for every sample and so sends every sample to the first replica
        rollout = ARPORollout(engine, self.tokenizer, self._config_for(budget), executor=limits)
        self._replica_load[replica] += 1
        start = time.perf_counter()
        try:
            batch = await rollout.agenerate([spec.prompt_ids], seed=seed)
        finally:
            self._replica_load[replica] -= 1
        elapsed = time.perf_counter() - start
        self.replica_samples[replica] += 1
        p_len = batch.tensors["prompts"].shape[1]
        valid = int(batch.tensors["attention_mask"][0, p_len:].sum())
        response_ids = batch.tensors["responses"][0, :valid].tolist()
        model_tokens = int(batch.tensors["response_mask"][0, :valid].sum())
        response = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        call_records = [dict(c) for c in batch.non_tensors["tool_calls"][0]]
        extra_info = {"question": item.question, "tool_calls": call_records}
        graded = self.grader.grade(item.data_source, response, item.ground_truth, extra_info)
        metrics = {k: graded[k] for k in ("score", "acc", "em", "f1", "format_ok") if k in graded}
        executed = dict(limits.executed)
        finish_reason = str(batch.non_tensors["finish_reason"][0])
        record = {
            "benchmark": item.benchmark, "index": item.index, "run": run, "seed": seed,
            "method": self.method, "run_seed": self.seed,
            "data_source": item.data_source, "question": item.question, "ground_truth": item.ground_truth,
            "prompt": self.tokenizer.decode(spec.prompt_ids, skip_special_tokens=False),
            "response": response,
            "answer": graded.get("answer", extract_answer(response) or ""),
            "task": released_task(item.data_source),
            "metrics": metrics,
            "format_reason": graded.get("format_reason"),
            "tool_calls": {"total": sum(executed.values()), "search": executed.get("search", 0),
                           "python": executed.get("python", 0), "refused": sum(limits.refused.values())},
            "tool_call_records": [{k: c.get(k) for k in ("tool", "start", "end", "error")} for c in call_records],
            "finish_reason": finish_reason,
            # the rollout ends a trajectory with "length" exactly when its response reached the budget
            "truncated": finish_reason == "length", "response_budget": budget,
            "response_tokens": valid, "model_tokens": model_tokens,
            "time_s": round(elapsed, 3), "session": self.session,
        }
        record["metrics_arpo"] = arpo_metrics(record)
        if "error" in graded:
            record["reward_error"] = graded["error"]
        if item.meta:
            record["meta"] = item.meta
        return record

    async def run(self, specs: list[SampleSpec]) -> int:
        """Run every spec; return how many records were written."""
        queue: asyncio.Queue[SampleSpec] = asyncio.Queue()
        for spec in specs:
            queue.put_nowait(spec)
        progress = self.progress = EvalProgress(len(specs), enabled=self.show_progress)
        self._run_engines = self._counted_engines()
        written = 0

        async def worker() -> None:
            nonlocal written
            while True:
                try:
                    spec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                progress.sample_started()
                record = await self.run_sample(spec)  # a failure ends the run (and the bar) below
                self.writer.write(record)
                written += 1
                progress.sample_finished(record)

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(self.concurrency, len(specs)))]
        heartbeat = asyncio.ensure_future(progress.heartbeat())
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # no orphan samples keep the engine busy after a failure
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            progress.close()
            self.progress = self._run_engines = None
        return written
