"""ARPO rollout vs plain GRPO rollout at equal budget M, in one process, on the same engine and prompts.

    python experiments/bench_arpo_rollout.py                                  # scripted engine (no model)
    python experiments/bench_arpo_rollout.py --engine-factory pkg.mod:make --model /path/to/ckpt
    python experiments/bench_arpo_rollout.py --prompts 16 --n 8 --initial 4 --repeats 3

``--engine-factory module:function`` names a function ``f(model_path) -> (engine, tokenizer)`` that builds a
real :class:`~arpo.engine.base.GenerationEngine` (vLLM or HF backend); without it the scripted fake engine
runs, with ``--latency-ms`` per request plus ``--token-latency-ms`` per generated token standing in for model
time (requests overlap, so a round of requests costs about its longest one). ``--tools-factory module:function``
(``f() -> list[BaseTool]``) plugs in real tools; the default is two deterministic tools, instant unless
``--tool-latency-ms`` delays each call.

Prints one JSON object on stdout and nothing else (logs, vLLM's included, go to stderr): per mode the median
wall time, generated tokens, tokens/s, requests, rounds, branches, prefix-cache hit rate overall and on the first
request of each branch, time in generation vs tools, the engine's idle fraction (no request in flight) and its
requests in flight on average while busy; and for each ARPO mode its wall time over plain GRPO's
(``arpo_over_single_wall``, the goal: at most 1.1), also as ``…_paired_median``: the median over repeats of the
ratio within one repeat, which a machine whose speed drifts between runs disturbs less, and as ``…_min``: fastest
run over fastest run, which bursts of other load on a shared machine disturb least. The wall ratio splits into
``…_work`` (tokens the engine decoded or prefilled past its prefix cache, mode over base, paired median) and,
for vLLM with its engine core in a process of its own, ``…_engine_cpu_per_work_token`` (the core's CPU seconds
per such token, mode over base): on a compute-bound engine the wall follows their product.

Modes: ``arpo`` (the default config) and ``single`` (plain GRPO) always run; ``arpo_no_fill_prediction``
(fills wait for the look-ahead alone: ``speculative_fill_probability: null``); ``arpo_fill_probability``
(fill prediction at threshold ``--fill-probability``); ``arpo_speculative_fill`` (``--speculative-fill``
speculative fills per group, default M − N, no prediction);
``single_logprobs`` and ``arpo_all_logprobs`` ask for top-k logprobs on every token (``return_entropy``),
which shows what entropy measurement costs; ``arpo_first_come`` grants branch slots first come, first
served instead of in a fixed order; ``arpo_no_speculative_forks`` keeps the order but starts a waiting
decision's forks only when its turn comes; ``arpo_fill_duplicate`` pads groups with copies of their last trajectory
(the released code) instead of fresh fills; ``arpo_rounds`` and ``single_rounds`` run ``schedule: rounds`` (all
trajectories step together) against the ``--schedule`` of the others (default ``async``), and are compared
with each other. ``--modes`` picks a subset. The prefix cache is reset before every run so no run inherits
another's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy  # noqa: E402
from experiments import git_sha  # noqa: E402
from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig  # noqa: E402
from tools.base import BaseTool  # noqa: E402


class InstantTool(BaseTool):
    """A deterministic tool, instant unless ``--tool-latency-ms`` asks for a delay per call (a real search or
    sandbox takes tens of milliseconds, which matters once generation is fast)."""

    latency_s = 0.0

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": "benchmark tool",
                                                  "parameters": {"type": "object", "properties": {
                                                      "input": {"type": "string"}}, "required": ["input"]}}}

    def call_text(self, content: str) -> str:
        if self.latency_s:
            time.sleep(self.latency_s)
        return f"{self.name} result for: {content.strip()[:200]}"


class InstantSearch(InstantTool):
    name = "search"


class InstantPython(InstantTool):
    name = "python"


def _load(spec: str):
    module, _, func = spec.partition(":")
    if not func:
        raise SystemExit(f"factory {spec!r}: use module:function")
    return getattr(importlib.import_module(module), func)


def _engine_processes() -> list:
    """vLLM's engine-core processes among ours (none for the scripted engine or an in-process core)."""
    import psutil

    cores = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM::EngineCore"):
                cores.append(p)
        except psutil.NoSuchProcess:  # a tool's subprocess that just ended
            pass
    return cores


def _cpu_s(processes: list) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in processes)


async def _run_once(engine, tokenizer, tools, prompts, cfg: ARPORolloutConfig, seed: int,
                    rate_priors: dict[str, dict[int, float]] | None = None, mode: str = "") -> dict[str, float]:
    await engine.reset_prefix_cache()
    cores = _engine_processes()
    cpu_before = _cpu_s(cores)
    gen = ARPORollout(engine, tokenizer, cfg, tools=tools)
    # a trainer keeps one generator across steps, so fill prediction starts from the last call's tool-call rates
    if rate_priors is not None:
        gen.call_rate_prior = rate_priors.get(mode, {})
    try:
        batch = await gen.agenerate(prompts, seed=seed)
    finally:
        gen.close()
    if rate_priors is not None:
        rate_priors[mode] = gen.call_rate_prior
    metrics = dict(batch.meta["metrics"])
    if cores:
        metrics["engine_cpu_s"] = _cpu_s(cores) - cpu_before
    return metrics


def _work(metrics: dict[str, float]) -> float:
    """Tokens the engine computed: decoded, and prefilled past its prefix cache (0 where it reports no cache)."""
    return metrics["rollout/tokens/generated"] + metrics.get("rollout/tokens/prefilled", 0.0)


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    wall = [m["timing_s/rollout_total"] for m in runs]
    pick = runs[wall.index(statistics.median_low(wall))]
    keys = ["rollout/tokens/generated", "rollout/tokens/discarded", "rollout/fill_predicted", "rollout/requests",
            "rollout/rounds", "rollout/branches",
            "rollout/tool_calls/total", "rollout/prefix_cache/hit_rate", "rollout/prefix_cache/branch_hit_rate",
            "rollout/tokens/prefilled",
            "timing_s/rollout_generate", "timing_s/rollout_tools", "rollout/engine_idle_fraction",
            "rollout/requests_in_flight_mean", "rollout/last_start_frac", "rollout/tail_after_half_done_frac",
            "rollout/branch_decisions_waited", "timing_s/rollout_grant_wait", "rollout/branches_speculative",
            "rollout/branches_dropped",
            "rollout/tokens/monitor", "rollout/aepo/initial_rollouts_mean"]
    out = {"wall_s_median": statistics.median(wall), "wall_s_min": min(wall), "wall_s_all": wall}
    optional = {"rollout/tokens/monitor", "rollout/aepo/initial_rollouts_mean"}  # AEPO's pre-monitoring only
    out.update({k.split("/", 1)[1]: pick.get(k) for k in keys if k in pick or k not in optional})
    out["tokens_per_s"] = pick["rollout/tokens/generated"] / pick["timing_s/rollout_total"]
    # the engine's work: tokens it decoded or prefilled (past its prefix cache), and its CPU milliseconds per such token
    work = [_work(m) for m in runs]
    out["work_tokens_median"] = statistics.median(work)
    if all("engine_cpu_s" in m for m in runs):
        out["engine_cpu_ms_per_work_token"] = statistics.median(
            1000 * m["engine_cpu_s"] / w for m, w in zip(runs, work))
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    # One event loop for everything: async engines (vLLM's AsyncLLM) are bound to the loop they start on.
    if args.engine_factory:
        engine, tokenizer = _load(args.engine_factory)(args.model)
        engine_name = args.engine_factory
    else:
        engine = ScriptedEngine(policy=ScriptPolicy(), latency_s=args.latency_ms / 1000,
                                token_latency_s=args.token_latency_ms / 1000)
        tokenizer, engine_name = engine.tokenizer, "scripted"
    if args.tools_factory:
        tools = _load(args.tools_factory)()
    else:
        tools = [InstantSearch(), InstantPython()]
        for tool in tools:
            tool.latency_s = args.tool_latency_ms / 1000
    if args.data:
        import pandas as pd

        rows = pd.read_parquet(args.data).prompt[: args.prompts]
        prompts = [tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True)["input_ids"]
                   for m in rows]
    else:
        prompts = [tokenizer.encode(f"Question {i}: which city is the capital of country number {i}?",
                                    add_special_tokens=False) for i in range(args.prompts)]
    common = {"n": args.n, "sampling.max_response_length": args.max_response_length,
              "tools.call_limit": args.tool_call_limit, "tools.retries": 0, "schedule.mode": args.schedule}
    arpo = {**common, "mode": "arpo", "initial_rollouts": args.initial, "branching.timing": args.timing}
    speculative = args.n - args.initial if args.speculative_fill is None else args.speculative_fill
    variants = {
        "arpo": arpo,
        # fills wait for the look-ahead over the known draws alone: what fill prediction saves
        "arpo_no_fill_prediction": {**arpo, "schedule.fill_probability": None},
        # fill prediction with another threshold
        "arpo_fill_probability": {**arpo, "schedule.fill_probability": args.fill_probability},
        # K fills per group started with the initial rollouts, no prediction
        "arpo_speculative_fill": {**arpo, "schedule.fill_probability": None, "schedule.speculative_fill": speculative},
        # ARPO asking for logprobs on every token (return_entropy): what the window-only requests save
        "arpo_all_logprobs": {**arpo, "return_entropy": True},
        # groups short of M padded with copies of their last trajectory (the released code; biased, no extra
        # trajectories to generate): what fresh fills cost
        "arpo_fill_duplicate": {**arpo, "schedule.fill": "duplicate"},
        # slots to whichever decision comes first: what ordered grants (same batch whatever the timing) cost
        "arpo_first_come": {**arpo, "schedule.branch_grant": "first_come"},
        # ordered grants whose waiting decisions start no forks before their turn: what speculative forks save
        "arpo_no_speculative_forks": {**arpo, "schedule.speculative_forks": False},
        # the round-synchronous loop (released code's; exact replay): what the per-trajectory tasks save
        "arpo_rounds": {**arpo, "schedule.mode": "rounds"},
        # the successors at the same budget: AEPO (ARPO damped after consecutive forks on a path) and
        # Tree-GRPO (initial trees grown from nodes at tool results; n must be a multiple of initial)
        "aepo": {**arpo, "policy": "aepo"},
        # AEPO with its entropy pre-monitoring: a probe trajectory per prompt first, then N set from its entropies
        "aepo_pre_monitoring": {**arpo, "policy": "aepo", "aepo.pre_monitoring": True},
        "tree_grpo": {**arpo, "policy": "tree_grpo"},
        "single": {**common, "mode": "single"},
        "single_rounds": {**common, "mode": "single", "schedule.mode": "rounds"},
        # the same sampling with top-k logprobs on every token: what entropy measurement alone costs
        "single_logprobs": {**common, "mode": "single", "return_entropy": True},
    }
    if args.modes:
        unknown = sorted(set(args.modes) - set(variants))
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; choose from {sorted(variants)}")
        keep = set(args.modes) | {"arpo", "single"} | ({"single_rounds"} if "arpo_rounds" in args.modes else set())
        variants = {m: v for m, v in variants.items() if m in keep}
    try:  # only the chosen modes: e.g. tree_grpo needs n to be a multiple of initial
        cfgs = {name: ARPORolloutConfig.from_dict(v) for name, v in variants.items()}
    except ValueError as err:
        raise SystemExit(f"--n/--initial/--modes: {err}") from None
    result: dict[str, Any] = {"engine": engine_name, "prompts": args.prompts, "budget_m": args.n,
                              "initial_rollouts": args.initial, "timing": args.timing,
                              "python": platform.python_version(), "git": git_sha()}
    # one untimed run first: the engine's first requests pay for allocations no later run pays for
    await _run_once(engine, tokenizer, tools, prompts, cfgs["arpo"], args.seed + 1000)
    # modes interleaved within each repeat, so drifts of the machine's speed hit every mode alike
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in cfgs}
    rate_priors: dict[str, dict[int, float]] = {}
    for r in range(args.repeats):
        for mode, cfg in cfgs.items():
            runs[mode].append(await _run_once(engine, tokenizer, tools, prompts, cfg, args.seed + r,
                                              rate_priors, mode))
    for mode in cfgs:
        result[mode] = _summary(runs[mode])
    for mode in [m for m in cfgs if not m.startswith("single")]:
        base = "single_rounds" if mode.endswith("_rounds") else "single"
        result[f"{mode}_over_{base}_wall"] = result[mode]["wall_s_median"] / result[base]["wall_s_median"]
        # the ratio within each repeat (same minute of machine time), robust to the machine's speed drifting
        paired = [a["timing_s/rollout_total"] / b["timing_s/rollout_total"] for a, b in zip(runs[mode], runs[base])]
        result[f"{mode}_over_{base}_wall_paired_median"] = statistics.median(paired)
        # best run over best run: what each mode costs when nothing else on the machine got in its way
        result[f"{mode}_over_{base}_wall_min"] = result[mode]["wall_s_min"] / result[base]["wall_s_min"]
        # the wall ratio is (work ratio) x (cost per unit of work ratio): which of the two an excess comes from
        result[f"{mode}_over_{base}_work"] = statistics.median(
            _work(a) / _work(b) for a, b in zip(runs[mode], runs[base]))
        if "engine_cpu_ms_per_work_token" in result[mode] and "engine_cpu_ms_per_work_token" in result[base]:
            result[f"{mode}_over_{base}_engine_cpu_per_work_token"] = (
                result[mode]["engine_cpu_ms_per_work_token"] / result[base]["engine_cpu_ms_per_work_token"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-factory", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tools-factory", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--data", default=None, help="verl parquet whose chat prompts to use (real models)")
    ap.add_argument("--n", type=int, default=8, help="budget M for both modes")
    ap.add_argument("--initial", type=int, default=4, help="ARPO initial rollouts N")
    ap.add_argument("--max-response-length", type=int, default=1024)
    ap.add_argument("--tool-call-limit", type=int, default=3)
    ap.add_argument("--tool-latency-ms", type=float, default=0.0,
                    help="built-in tools only (no --tools-factory): delay per tool call")
    ap.add_argument("--timing", choices=["code", "paper"], default="code")
    ap.add_argument("--schedule", choices=["async", "rounds"], default="async",
                    help="rollout schedule of every mode except the *_rounds ones")
    ap.add_argument("--speculative-fill", type=int, default=None,
                    help="speculative fills per group of mode arpo_speculative_fill (default: n - initial)")
    ap.add_argument("--fill-probability", type=float, default=0.2,
                    help="speculative_fill_probability of mode arpo_fill_probability")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=2.0, help="scripted engine only: delay per request")
    ap.add_argument("--token-latency-ms", type=float, default=1.0,
                    help="scripted engine only: delay per generated token (a round costs its longest request)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="*", default=None,
                    help="subset of modes to run (arpo and single always run, single_rounds with arpo_rounds); "
                         "default: all")
    args = ap.parse_args()
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()  # console on stderr; VLLM_CONFIGURE_LOGGING=0 keeps vLLM's own stdout handler away
    print(json.dumps(asyncio.run(amain(args)), indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
