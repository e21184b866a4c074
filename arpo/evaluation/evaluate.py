"""Evaluate a checkpoint with the tools over the paper's benchmarks (the command: ``python -m arpo.eval``).

Settings are in ``configs/eval.yaml`` (every key documented there). The model (``actor_rollout_ref.model.path``,
an HF checkpoint) runs on the training engine (``arpo.engine``, vLLM or HF) inside the training rollout
(:class:`~arpo.rollout.arpo_rollout.ARPORollout`, ``mode: single``) with the training tools
(``tools.registry``), sampled as ARPO's evaluation samples (temperature 0.6, top_p 0.95, top_k 20,
repetition penalty 1.1, at most 5 python and 10 search calls), ``eval.num_runs`` times per question.

Every finished sample is appended to ``<run_dir>/samples/<benchmark>.jsonl`` at once (question, prompt, full
response with tool results, extracted answer, metrics, tool-call counts, run index, seed); a rerun skips
the samples already there, so a killed evaluation continues where it stopped. ``<run_dir>/summary.json``
holds per benchmark: mean and std over runs of each metric, pass@k, tool calls per question, truncated samples.

Each benchmark's samples get its response budget (``eval.max_response_length_per_benchmark``; a benchmark with
no entry, or a null one, gets ``actor_rollout_ref.rollout.arpo.sampling.max_response_length``). run.json keeps the
budget of every benchmark evaluated into the folder, and a rerun that would give a benchmark with samples
another budget is refused, as for the other sampling settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from arpo.config import REPO_ROOT, ConfigError
from arpo.evaluation.benchmarks import (EvalItem, encode_prompt, load_jsonl_benchmark, load_parquet_benchmark,
                                        parquet_benchmark_name)
from arpo.evaluation.metrics import PROFILES, summarise_profiles
from arpo.evaluation.prompts import PROMPT_TYPES, describe_tools, system_prompt
from arpo.evaluation.records import SAMPLES_DIR, load_run_samples, load_samples, sample_key, samples_path

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
#: run.json fields that must match for a rerun to add samples to an existing run directory
FINGERPRINT_KEYS = ("method", "seed", "model_path", "sampling", "tool_limits", "tools", "reward", "require_format")
#: the per-benchmark response budgets (benchmark -> tokens) and the global one they fall back to; run.json
#: binds each benchmark that has samples to its budget
BUDGET_KEY = "eval.max_response_length_per_benchmark"
GLOBAL_BUDGET_KEY = "actor_rollout_ref.rollout.arpo.sampling.max_response_length"


def _resolve_path(value: str) -> Path:
    """A config path: as given if it exists (or is absolute), else relative to the repository root."""
    p = Path(os.path.expandvars(os.path.expanduser(str(value))))
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


#: a model the Hub cache holds: .../models--<owner>--<name>/snapshots/<commit>
_HUB_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]+)/?$")


def resolve_hub_model(cfg: DictConfig) -> None:
    """A Hub model ID in ``actor_rollout_ref.model.path`` (``dongguanting/Qwen2.5-7B-ARPO``), as transformers and
    vLLM take one: downloaded once into the Hub cache (resumable), the path set to that snapshot."""
    from arpo.models.hub import MODEL_FILES, is_hub_id

    path = str(cfg.actor_rollout_ref.model.path)
    if not is_hub_id(path):
        return
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face Hub (its cache is reused)", path)
    try:
        local = snapshot_download(repo_id=path, allow_patterns=list(MODEL_FILES))
    except Exception as err:  # noqa: BLE001 — every Hub failure (network, gated, unknown ID) is one config line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"actor_rollout_ref.model.path={path}: not fetched from the Hugging Face Hub ({first}); "
                          f"check the ID and the network, `huggingface-cli login` for a gated model, or give a "
                          f"local HF checkpoint directory") from None
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = str(local)


def model_label(path: str) -> str:
    """What a run records as its model: ``owner/name@commit`` for a Hub snapshot, else the path as given."""
    m = _HUB_SNAPSHOT.search(str(path))
    return f"{m['owner']}/{m['name']}@{m['commit']}" if m else str(path)


def _method(cfg: DictConfig) -> str:
    if cfg.eval.method:
        return str(cfg.eval.method)
    m = _HUB_SNAPSHOT.search(str(cfg.actor_rollout_ref.model.path))
    return m["name"] if m else Path(str(cfg.actor_rollout_ref.model.path)).name


def run_dir_of(cfg: DictConfig) -> Path:
    if cfg.eval.run_dir:
        return Path(str(cfg.eval.run_dir))
    return Path(str(cfg.eval.output_dir)) / _method(cfg) / f"seed{int(cfg.eval.seed)}"


def _check_settings(cfg: DictConfig) -> None:
    from arpo.chat_templates import configured_template

    e = cfg.eval
    for key in ("prompt_type", "math_prompt_type", "parquet_prompt"):
        value = e[key]
        if value is not None and value not in PROMPT_TYPES:
            raise ConfigError(f"eval.{key}={value!r}: choose one of {list(PROMPT_TYPES)}"
                              + ("" if key == "prompt_type" else " or null"))
    for key in ("num_runs", "concurrency"):
        if int(e[key]) < 1:
            raise ConfigError(f"eval.{key}={e[key]}: must be >= 1")
    for key in ("max_python_calls", "max_search_calls", "max_total_calls"):
        if int(e[key]) < 0:
            raise ConfigError(f"eval.{key}={e[key]}: must be >= 0")
    if e.metric_profile not in PROFILES:
        raise ConfigError(f"eval.metric_profile={e.metric_profile!r}: choose one of {list(PROFILES)}")
    if e.max_samples is not None and int(e.max_samples) < 1:
        raise ConfigError(f"eval.max_samples={e.max_samples}: must be >= 1 or null (all questions)")
    if not list(e.benchmarks) and not list(e.parquet_files):
        raise ConfigError("nothing to evaluate: eval.benchmarks and eval.parquet_files are both empty")
    _check_budgets(cfg)
    configured_template(cfg)


def _check_budgets(cfg: DictConfig) -> None:
    table = cfg.eval.max_response_length_per_benchmark
    if table is not None and not isinstance(table, DictConfig):
        raise ConfigError(f"{BUDGET_KEY}={table!r}: give a mapping benchmark -> response tokens, e.g. {{gsm8k: 2048}}")
    for name, value in (table or {}).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{BUDGET_KEY}.{name}={value!r}: give a number of response tokens >= 1, or null for "
                              f"{GLOBAL_BUDGET_KEY}")


def response_budgets(cfg: DictConfig, benchmarks: Sequence[str]) -> dict[str, int]:
    """Each benchmark's response budget: its entry in eval.max_response_length_per_benchmark, else the global one."""
    default = int(cfg.actor_rollout_ref.rollout.arpo.sampling.max_response_length)
    table = cfg.eval.max_response_length_per_benchmark or {}
    return {b: int(table[b]) if table.get(b) is not None else default for b in benchmarks}


def _reward_family(compute_score: Any, data_source: str) -> str | None:
    from reward_fns.registry import RewardRegistry

    if isinstance(compute_score, RewardRegistry):
        try:
            return compute_score.lookup(data_source).family
        except KeyError:
            return None
    return None


def load_items(cfg: DictConfig, compute_score: Any) -> list[EvalItem]:
    """Every question of the selected benchmarks and parquet files (first ``eval.max_samples`` of each)."""
    e = cfg.eval
    limit = int(e.max_samples) if e.max_samples is not None else None
    items: list[EvalItem] = []
    names: set[str] = set()
    data_dir = _resolve_path(str(e.data_dir))
    described: list = []

    def prompt(prompt_type: str | None) -> str | None:
        if prompt_type == "tools" and not described:  # read the tools' schemas once, only when asked for
            described.extend(describe_tools(cfg.tools))
        return None if prompt_type is None else system_prompt(prompt_type, described)

    for bench in e.benchmarks:
        bench = str(bench)
        path = data_dir / bench / "test.jsonl"
        if not path.is_file():
            from arpo.data.release import EVAL_BENCHMARKS

            fetch = ("python -m arpo.data.release --only eval (into $ARPO_DATA), " if bench in EVAL_BENCHMARKS
                     else "put the benchmark there, ")
            raise ConfigError(f"eval.benchmarks: no {path}; {fetch}point eval.data_dir at the folder holding it, "
                              f"or drop {bench} from eval.benchmarks")
        prompt_type = e.prompt_type
        if e.math_prompt_type and _reward_family(compute_score, bench) == "math":
            prompt_type = e.math_prompt_type
        items.extend(load_jsonl_benchmark(path, bench, prompt(prompt_type), limit=limit))
        names.add(bench)
    for i, entry in enumerate(e.parquet_files):
        entry = OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else entry
        spec = {"path": entry} if isinstance(entry, str) else dict(entry)
        unknown = set(spec) - {"path", "name", "data_source"}
        if "path" not in spec or unknown:
            raise ConfigError(f"eval.parquet_files[{i}]: give a path or {{path, name, data_source}} "
                              f"(got keys {sorted(spec)})")
        path = _resolve_path(spec["path"])
        if not path.is_file():
            raise ConfigError(f"eval.parquet_files[{i}]: no file {path}")
        name = str(spec.get("name") or parquet_benchmark_name(path))
        if name in names:
            raise ConfigError(f"eval.parquet_files[{i}]: benchmark name {name!r} is taken; give it another "
                              f"with {{path: {spec['path']}, name: ...}}")
        names.add(name)
        try:
            items.extend(load_parquet_benchmark(path, name, prompt(e.parquet_prompt), spec.get("data_source"), limit))
        except ValueError as err:
            raise ConfigError(f"eval.parquet_files[{i}]: {err}") from None
    return items


def _fingerprint(cfg: DictConfig) -> dict[str, Any]:
    a = cfg.actor_rollout_ref.rollout.arpo
    return {
        "method": _method(cfg),
        "seed": int(cfg.eval.seed),
        "model_path": model_label(str(cfg.actor_rollout_ref.model.path)),
        "sampling": {k: OmegaConf.to_container(a.sampling)[k] for k in
                     ("temperature", "top_p", "top_k", "repetition_penalty", "max_response_length", "extra_stop")},
        "tool_limits": {"python": int(cfg.eval.max_python_calls), "search": int(cfg.eval.max_search_calls),
                        "total": int(cfg.eval.max_total_calls),
                        "refuse_repeated_search": bool(cfg.eval.refuse_repeated_search)},
        "tools": OmegaConf.to_container(cfg.tools),
        "reward": {"custom_reward_function": OmegaConf.to_container(cfg.custom_reward_function),
                   **{k: cfg.reward[k] for k in ("math_mode", "qa_metric", "deep_research_tool_bonus",
                                                          "deep_research_variant")}},
        "require_format": bool(cfg.eval.require_format),
    }


def _prepare_run_dir(run_dir: Path, cfg: DictConfig, budgets: dict[str, int] | None = None) -> dict[str, Any]:
    """Write run.json, or check that an existing one was made with the same settings (``budgets``: the response
    budget of each benchmark evaluated now)."""
    budgets = dict(budgets or {})
    meta = {**_fingerprint(cfg), "prompt_type": cfg.eval.prompt_type, "math_prompt_type": cfg.eval.math_prompt_type,
            "num_runs": int(cfg.eval.num_runs), "pass_threshold": float(cfg.eval.pass_threshold),
            "metric_profile": str(cfg.eval.metric_profile), "response_budgets": budgets}
    path = run_dir / RUN_FILE
    if path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in FINGERPRINT_KEYS if old.get(k) != meta.get(k)]
        old_budgets = old.get("response_budgets")
        if old_budgets is None:  # a run.json from before per-benchmark budgets: every sample had the global one
            old_global = (old.get("sampling") or {}).get("max_response_length")
            old_budgets = {p.stem: old_global for p in (run_dir / SAMPLES_DIR).glob("*.jsonl")}
        # a benchmark is bound to its budget once it has samples; the others may take any budget
        changed += [f"response_budgets.{b}" for b, n in budgets.items()
                    if b in old_budgets and old_budgets[b] != n and samples_path(run_dir, b).exists()]
        if changed:
            key = changed[0]
            there, now = old.get(key), meta.get(key)
            if key.startswith("response_budgets."):
                bench = key.split(".", 1)[1]
                there, now = old_budgets[bench], budgets[bench]
                key += f" (set by {BUDGET_KEY}.{bench} or {GLOBAL_BUDGET_KEY})"
            raise ConfigError(
                f"{run_dir} holds an evaluation with other settings ({key}: {json.dumps(there)[:200]} "
                f"there, {json.dumps(now)[:200]} now); its samples would mix. Use another "
                f"eval.run_dir, eval.method or eval.seed, or delete that folder")
        meta["response_budgets"] = {**old_budgets, **budgets}
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def _finished_keys(run_dir: Path, items: Sequence[EvalItem]) -> set[tuple[str, int, int]]:
    """Keys of the samples already written; a recorded question that differs from the file's is an error."""
    by_key = {(it.benchmark, it.index): it for it in items}
    done: set[tuple[str, int, int]] = set()
    for bench in sorted({it.benchmark for it in items}):
        path = samples_path(run_dir, bench)
        for record in load_samples(path):
            item = by_key.get((bench, int(record["index"])))
            if item is not None and record.get("question") != item.question:
                raise ConfigError(f"{path}: sample {record['index']} was made for another question than "
                                  f"line {record['index'] + 1} of the benchmark now has (the file changed); "
                                  f"evaluate into a new eval.run_dir")
            done.add(sample_key(record))
    return done


def write_summary(run_dir: Path, meta: dict[str, Any], expected: dict[str, int] | None = None) -> dict[str, Any]:
    """Summarise every samples file of ``run_dir`` into summary.json (``expected``: benchmark -> questions)."""
    expected = expected or {}
    profile = str(meta.get("metric_profile", "strict"))
    threshold = float(meta.get("pass_threshold", 1.0))
    benchmarks = {}
    for bench, records in load_run_samples(run_dir).items():
        n_q = expected.get(bench)
        benchmarks[bench] = summarise_profiles(records, threshold, profile, expected_questions=n_q,
                                               expected_runs=int(meta["num_runs"]) if n_q is not None else None)
    summary = {"method": meta["method"], "seed": meta["seed"], "model_path": meta["model_path"],
               "num_runs": meta["num_runs"], "metric_profile": profile, "benchmarks": benchmarks}
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def _build_rollout_config(cfg: DictConfig):
    from arpo.rollout.config import ARPORolloutConfig

    values = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.arpo, resolve=True)
    e = cfg.eval
    values.update({"mode": "single", "n": 1, "show_progress": False, "tools.call_limit": int(e.max_total_calls)})
    try:
        return ARPORolloutConfig.from_dict(values)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _shutdown(obj: Any) -> None:
    # kill first: a Ray replica's client turns any other name into an un-awaited remote call, and kill also
    # stops the actor process (and vLLM's engine core under it)
    for name in ("kill", "shutdown", "close"):
        fn = getattr(obj, name, None)
        if callable(fn):
            fn()
            return


def eval_replicas(cfg: DictConfig) -> int:
    """How many engine replicas evaluate: ``actor_rollout_ref.rollout.num_replicas``, or when null (auto) one per
    tensor-parallel group of this machine's visible GPUs, as colocated training has (every GPU generates), and
    1 without GPUs (replicas would share the same cores)."""
    from arpo.runtime.placement import auto_num_replicas

    r = cfg.actor_rollout_ref.rollout
    if r.num_replicas is not None:
        if int(r.num_replicas) < 1:
            raise ConfigError(f"actor_rollout_ref.rollout.num_replicas={r.num_replicas}: must be >= 1, or null "
                              f"(one per tensor-parallel group of the visible GPUs)")
        return int(r.num_replicas)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return auto_num_replicas(True, gpus, int(r.tensor_model_parallel_size), gpus > 0)


def start_engines(cfg: DictConfig) -> list[Any]:
    """The evaluation's engine replicas (:func:`eval_replicas`): one in this process, or with several one Ray actor
    each (Ray gives each its own GPUs)."""
    from arpo.engine.factory import create_engines

    replicas = eval_replicas(cfg)
    r = cfg.actor_rollout_ref.rollout
    if replicas > 1 and not r.ray_actor:
        with open_dict(cfg):  # each replica is a Ray actor: one process cannot hold engines on several GPUs
            r.ray_actor = True
    logger.info("evaluating on %d engine replica(s) (%s)", replicas,
                "Ray actors" if r.ray_actor else "in this process")
    return create_engines(cfg, replicas=replicas)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run the evaluation described by ``cfg`` (configs/eval.yaml); return the summary."""
    from reward_fns.registry import build_compute_score

    _check_settings(cfg)
    resolve_hub_model(cfg)
    rollout_config = _build_rollout_config(cfg)
    try:
        compute_score = build_compute_score(cfg)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as err:
        raise ConfigError(str(err)) from None
    from arpo.evaluation.runner import Grader

    grader = Grader(compute_score, require_format=bool(cfg.eval.require_format),
                    error_score=float(cfg.reward.error_score))
    items = load_items(cfg, compute_score)
    try:
        grader.check_routes({it.data_source for it in items})
    except KeyError as err:
        raise ConfigError(f"{err.args[0]} (a parquet file's data_source can be set in eval.parquet_files)") from None
    run_dir = run_dir_of(cfg)
    budgets = response_budgets(cfg, list(dict.fromkeys(it.benchmark for it in items)))
    meta = _prepare_run_dir(run_dir, cfg, budgets)
    num_runs = int(cfg.eval.num_runs)
    done = _finished_keys(run_dir, items)
    pending = [(it, r) for it in items for r in range(num_runs) if (it.benchmark, it.index, r) not in done]
    total = len(items) * num_runs
    logger.info("eval %s seed %d: %d samples (%d questions x %d runs), %d already in %s, %d to run",
                meta["method"], meta["seed"], total, len(items), num_runs, total - len(pending), run_dir,
                len(pending))
    logger.info("response budgets (tokens): %s", ", ".join(f"{b} {n}" for b, n in budgets.items()))
    if pending:
        _generate(cfg, rollout_config, grader, run_dir, meta, pending, budgets)
    expected = {}
    for it in items:
        expected[it.benchmark] = expected.get(it.benchmark, 0) + 1
    summary = write_summary(run_dir, meta, expected)
    logger.info("summary written to %s", run_dir / SUMMARY_FILE)
    return summary


def _generate(cfg: DictConfig, rollout_config: Any, grader: Any, run_dir: Path, meta: dict[str, Any],
              pending: list[tuple[EvalItem, int]], budgets: dict[str, int]) -> None:
    """Start the tokenizer, tools and engine, run the pending samples, and shut everything down."""
    from arpo.chat_templates import tokenizer_for
    from arpo.evaluation.records import SampleWriter
    from arpo.evaluation.runner import EvalRunner, SampleSpec
    from arpo.rollout.tool_executor import ToolExecutor
    from tools.registry import ToolConfigError, load_tools

    model_path = str(cfg.actor_rollout_ref.model.path)
    if not Path(model_path).is_dir():
        raise ConfigError(f"actor_rollout_ref.model.path={model_path}: no such directory; give an HF checkpoint "
                          f"(the tiny SFT model: python -m arpo.pipeline)")
    import torch

    from arpo.plan.stages import check_stage

    # an evaluation that cannot fit its GPUs stops before any engine starts
    check_stage("eval", cfg, "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tokenizer_for(cfg)
    specs = [SampleSpec(item, run, encode_prompt(tokenizer, item.messages)) for item, run in pending]
    try:
        tools = load_tools(cfg.tools)
    except ToolConfigError as err:
        raise ConfigError(str(err)) from None
    limits = {"python": int(cfg.eval.max_python_calls), "search": int(cfg.eval.max_search_calls)}
    executor = ToolExecutor(tools, max_workers=rollout_config.tools.workers, timeout_s=rollout_config.tools.timeout_s,
                            retries=rollout_config.tools.retries, retry_on_empty=rollout_config.tools.retry_on_empty,
                            max_result_chars=rollout_config.tools.max_result_chars)
    try:
        engines = start_engines(cfg)
    except ValueError as err:
        executor.close()
        tools.close()
        raise ConfigError(str(err)) from None
    try:
        with SampleWriter(run_dir, fsync=bool(cfg.eval.fsync)) as writer:
            runner = EvalRunner(engines, tokenizer, executor, rollout_config, limits,
                                ("search",) if cfg.eval.refuse_repeated_search else (), grader, writer,
                                method=meta["method"], seed=meta["seed"], concurrency=int(cfg.eval.concurrency),
                                show_progress=bool(cfg.eval.show_progress), response_budgets=budgets)
            written = asyncio.run(runner.run(specs))
            logger.info("wrote %d samples (session %s); samples per engine replica: %s", written, runner.session,
                        runner.replica_samples)
    finally:
        for engine in engines:
            _shutdown(engine)
        executor.close()
        tools.close()


def print_summary(summary: dict[str, Any]) -> None:
    """The evaluation's closing lines: per benchmark, accuracy (± std over runs), pass@k, tool calls."""
    print(f"method={summary['method']} seed={summary['seed']} runs={summary['num_runs']} "
          f"metric_profile={summary['metric_profile']}")
    for bench, s in summary["benchmarks"].items():
        acc, tools = s["acc"], s["tool_calls_total"]
        std = f" ± {100 * acc['std']:.1f}" if acc["std"] is not None else ""
        k = max((int(k) for k in s["pass@k"]), default=1)
        pk = s["pass@k"].get(str(k))
        pass_text = f"pass@{k} {100 * pk:.1f}" if pk is not None else ""
        truncated = s.get("truncated", {}).get("count", 0)
        cut = f", {truncated} truncated" if truncated else ""
        print(f"  {bench:<12} acc {100 * acc['mean']:.1f}{std}  {pass_text}  tool calls/q {tools['mean']:.2f}  "
              f"({s['num_samples']} samples{cut})")
