"""Ours against TRL's ``GRPOTrainer`` on the same job, on one machine, in one run.

The job: the first ``--prompts x --steps`` prompts of a synthetic-benchmark parquet, ``--n`` completions each,
prompts <= ``--max-prompt-length`` and completions <= ``--max-response-length`` tokens, sampled at temperature 1,
one optimizer step per generation batch (mini-batch = batch, micro-batches of ``--micro`` rows), no KL term
(TRL's beta 0, no reference model), gradient checkpointing on both sides or neither (``--gradient-checkpointing``),
the same SFT'd model, learning rate and dtype, and the machine's threads. The sides (``--sides``):

- ``trl``: TRL's ``GRPOTrainer`` with its defaults for everything the job leaves open (loss_type ``dapo``, the
  global token mean, which is our ``token-mean``: tests/trainer/test_trl_parity.py), generating with
  ``--trl-generation`` (``continuous``, the default: transformers' continuous batching, TRL's fastest on a CPU;
  ``hf``: ``model.generate``; ``vllm``: TRL's vLLM colocate mode, its fastest on a GPU; see
  experiments/results/peers/README.md for which run on a CPU);
- ``ours_grpo``: ``python -m arpo.main_arpo preset=grpo`` on verl's single-turn agent loop: the same single
  generation per completion, through vLLM, Ray and FSDP2 ranks, with our defaults and any ``--ours-set``
  overrides (say, vLLM and the actor's decoder layers compiled);
- ``ours_arpo``: our ARPO step as ``make run`` trains it (tools, the entropy-forked tree, M = ``--n``): more work
  per step than the other two (tool calls and results), reported beside them, not divided by them.

Each side runs in its own process (Ray, vLLM and TRL never share one), ``--repeats`` times, alternating sides,
at each ``--dtypes`` value. Per run: seconds per step (the median of the steps after ``--warmup``; model
loading and start-up are outside the step on both sides), generated tokens/s (completion tokens the model
sampled / step seconds), trained tokens/s (prompt + completion tokens in the update / step seconds), and peak
memory (the largest sum over the run's process tree: RSS sampled each 0.5 s, PSS each 10 s, since reading a large
process's PSS costs a measurable share of a small machine; the sampling's CPU seconds are in each run). Per side
and dtype the median and range over repeats, and ``ratio_to_trl`` = ours / TRL's seconds per step, paired by repeat.
Prints one JSON object on stdout (``--out`` also writes it, after every run, so a killed benchmark keeps what it
measured); each run's log goes to ``--work-dir``. Rerun with the same ``--work-dir`` and job, a killed benchmark
resumes: a run that finished there (its ``result.json``) for the same job is kept, not run again; a TRL run stays
valid when only ``--ours-set`` changed, ours when only the TRL flags did.

    python experiments/bench_peers.py                               # make run's SFT model and data (run it first)
    python experiments/bench_peers.py --model DIR --data DIR/train.parquet --dtypes bfloat16 float32 --repeats 3 \\
        --out experiments/results/peers/amx.json
    python experiments/bench_peers.py --model DIR --data PARQUET --prompts 2 --n 2 --max-response-length 32 \\
        --steps 1 --warmup 0 --repeats 1 --dtypes float32          # smoke (tests/test_bench_peers.py)
    python experiments/bench_peers.py --table experiments/results/peers   # table.md from every machine's JSON
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import REPO, PeakSampler, environ_with, repo_path, repo_relative  # noqa: E402

SIDES = ("trl", "ours_grpo", "ours_arpo")
DTYPES = ("bfloat16", "float32")
TRL_GENERATION = ("hf", "continuous", "vllm")
#: make run's outputs (python -m arpo.pipeline --preset smollm2)
DEFAULT_RUN = REPO / "outputs" / "smollm2_arpo"


# ---------------------------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------------------------

def write_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The job both sides run: its prompts as a verl parquet (no ``agent_name``: verl's single-turn loop) and
    every size that defines it."""
    import pandas as pd

    rows = args.prompts * args.steps
    frame = pd.read_parquet(args.data)
    if len(frame) < rows:
        raise SystemExit(f"error: --data {args.data} has {len(frame)} prompts; the job needs --prompts x --steps = "
                         f"{rows}: lower them or give a larger parquet")
    frame = frame.iloc[:rows].drop(columns=[c for c in ("agent_name",) if c in frame])
    work.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(work / "prompts.parquet")
    return {"model": str(args.model), "prompts_file": str(work / "prompts.parquet"), "data": str(args.data),
            "prompts_per_step": args.prompts, "n": args.n, "steps": args.steps, "warmup": args.warmup,
            "max_prompt_length": args.max_prompt_length, "max_response_length": args.max_response_length,
            "micro_batch_rows": args.micro, "lr": args.lr, "temperature": 1.0, "threads": args.threads,
            "gradient_checkpointing": args.gradient_checkpointing == "on",
            "trl_generation": args.trl_generation, "trl_bf16_weights": args.trl_bf16_weights,
            "ours_overrides": list(args.ours_set)}


# ---------------------------------------------------------------------------------------------------------------
# Our side: python -m arpo.main_arpo
# ---------------------------------------------------------------------------------------------------------------

def ours_command(side: str, dtype: str, job: dict[str, Any], out: Path) -> list[str]:
    """``make run``'s RL overrides, then the job's sizes, then the side's algorithm, then ``--ours-set``."""
    from arpo.pipeline import Preset, overrides_for_stage

    p, n = job["prompts_per_step"], job["n"]
    sizes = [f"actor_rollout_ref.model.path={job['model']}", f"data.train_files={job['prompts_file']}",
             f"synthetic.out_dir={Path(job['data']).parent}",  # the search tool's corpus (ours_arpo)
             "data.val_files=null", "data.shuffle=false", f"data.train_batch_size={p}",
             f"actor_rollout_ref.actor.ppo_mini_batch_size={p}", f"actor_rollout_ref.rollout.n={n}",
             f"actor_rollout_ref.rollout.arpo.initial_rollouts={max(1, n // 2)}",
             f"data.max_prompt_length={job['max_prompt_length']}",
             f"data.max_response_length={job['max_response_length']}",
             f"actor_rollout_ref.rollout.max_model_len={job['max_prompt_length'] + job['max_response_length']}",
             f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={job['micro_batch_rows']}",
             f"actor_rollout_ref.actor.optim.lr={job['lr']}", f"actor_rollout_ref.model.dtype={dtype}",
             f"actor_rollout_ref.rollout.dtype={dtype}", "actor_rollout_ref.rollout.arpo.return_entropy=false",
             f"actor_rollout_ref.model.enable_gradient_checkpointing={str(job['gradient_checkpointing']).lower()}",
             f"trainer.total_training_steps={job['steps']}", "trainer.test_freq=-1", "trainer.val_before_train=false",
             "trainer.save_freq=-1", "trainer.logger=[jsonl]", f"trainer.output_dir={out}"]
    mine = {o.split("=", 1)[0] for o in sizes}
    preset = [o for o in overrides_for_stage("arpo_trainer", list(Preset.load("smollm2").overrides))
              if o.split("=", 1)[0] not in mine]
    algorithm = {"ours_grpo": ["preset=grpo", "actor_rollout_ref.rollout.mode=agent_loop"],
                 "ours_arpo": ["preset=arpo_soft"]}[side]
    return [sys.executable, "-m", "arpo.main_arpo", *preset, *sizes, *algorithm, *job.get("ours_overrides", [])]


def ours_steps(out: Path, rows: int) -> list[dict[str, float]]:
    """Each step's seconds and tokens from the run's metrics.jsonl."""
    path = out / "logs" / "metrics.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [{"seconds": s["timing_s/step"], "generated_tokens": s["response_length/model_tokens_mean"] * rows,
             "trained_tokens": s["perf/total_num_tokens"], "gen_seconds": s.get("timing_s/gen"),
             "update_seconds": s.get("timing_s/update_actor")} for s in steps if "timing_s/step" in s]


# ---------------------------------------------------------------------------------------------------------------
# TRL's side: this file with --trl-child, in its own process
# ---------------------------------------------------------------------------------------------------------------

def trl_child(job: dict[str, Any], dtype: str, out: Path) -> None:
    """Train ``job`` with TRL's GRPOTrainer; write each step's seconds and tokens to ``out/steps.json``."""
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_fns.registry import default_compute_score

    torch.set_num_threads(job["threads"])
    frame = pd.read_parquet(job["prompts_file"])
    dataset = Dataset.from_list([{"prompt": [dict(m) for m in row["prompt"]], "data_source": row["data_source"],
                                  "ground_truth": str(row["reward_model"]["ground_truth"])}
                                 for _, row in frame.iterrows()])

    def reward(completions: list[Any], data_source: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [default_compute_score(d, t, g, {}) for d, t, g in zip(data_source, texts, ground_truth)]
        return [float(s["score"] if isinstance(s, dict) else s) for s in scores]

    steps: list[dict[str, float]] = []
    generation = {"seconds": 0.0}  # TRL's _generate inside the current step, for the same split as ours

    class StepClock(TrainerCallback):
        """The optimizer step's wall time (TRL generates inside it) and the tokens TRL logged for it."""

        def on_step_begin(self, args, state, control, **kwargs):
            generation["seconds"] = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            # the rest is the rewards and the update: at beta 0 and one iteration TRL has no log-prob pass
            steps.append({"seconds": seconds, "gen_seconds": generation["seconds"],
                          "update_seconds": seconds - generation["seconds"]})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and steps and "completions/mean_length" in logs:
                steps[-1]["generated_tokens"] = logs["completions/mean_length"] * job["prompts_per_step"] * job["n"]
                steps[-1]["num_tokens"] = logs.get("num_tokens")

    rows = job["prompts_per_step"] * job["n"]
    micro = min(job["micro_batch_rows"], rows)
    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=not torch.cuda.is_available(), bf16=dtype == "bfloat16",
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=job["n"],
        max_completion_length=job["max_response_length"], max_steps=job["steps"], learning_rate=job["lr"],
        beta=0.0, temperature=job["temperature"], shuffle_dataset=False, logging_steps=1, save_strategy="no",
        report_to=[], gradient_checkpointing=job["gradient_checkpointing"], seed=0,
        use_transformers_continuous_batching=job["trl_generation"] == "continuous", dataloader_num_workers=0,
        use_vllm=job["trl_generation"] == "vllm", vllm_mode="colocate",
        vllm_max_model_length=job["max_prompt_length"] + job["max_response_length"],
        lr_scheduler_type="constant", warmup_steps=0)  # ours: a constant learning rate
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    tokenizer.padding_side = "left"
    # bfloat16: mixed precision over float32 weights, as our trainer; --trl-bf16-weights: the weights themselves in
    # bf16 (no float32 master copy), faster and less exact, TRL's fastest CPU setting
    weights = torch.bfloat16 if dtype == "bfloat16" and job["trl_bf16_weights"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=weights)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
    generate = trainer._generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generation["seconds"] += time.perf_counter() - start

    trainer._generate = timed_generate
    trainer.train()
    prev = 0.0
    for step in steps:  # TRL logs a running total of the tokens it has trained on
        total = step.pop("num_tokens", None)
        if total is not None:
            step["trained_tokens"], prev = total - prev, total
    (out / "steps.json").write_text(json.dumps(steps))


# ---------------------------------------------------------------------------------------------------------------
# Running and measuring
# ---------------------------------------------------------------------------------------------------------------

#: PSS (``/proc/<pid>/smaps_rollup``) costs ~0.14 s of CPU for a 13 GB process, RSS (``statm``) ~40 us: at every
#: 0.5 s sample the sampler took 0.4-0.5 of a core (top) from the 2-core machine's measured run
PSS_EVERY = 20


def tree_rss_pss(root: Any, pss: bool = True) -> tuple[float, float]:
    """Summed RSS and PSS (bytes; PSS 0 unless ``pss``) of ``root`` (a psutil.Process) and all its descendants."""
    import psutil

    rss = pss_sum = 0.0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # the root has exited
        return rss, pss_sum
    for proc in procs:
        try:
            mem = proc.memory_full_info() if pss else proc.memory_info()
        except psutil.Error:  # exited between listing and reading
            continue
        rss += mem.rss
        pss_sum += getattr(mem, "pss", mem.rss) if pss else 0.0
    return rss, pss_sum


def tree_memory_sampler(root: Any, interval: float = 0.5) -> PeakSampler:
    """Peak RSS every ``interval`` seconds and peak PSS every :data:`PSS_EVERY` samples of ``root``'s process
    tree."""
    samples = itertools.count()
    return PeakSampler(lambda: tree_rss_pss(root, pss=next(samples) % PSS_EVERY == 0), interval)


def run_dir(work: Path, side: str, dtype: str, repeat: int) -> Path:
    """One run's folder: its log, its outputs and, once it finished, its ``result.json``."""
    return work / f"{side}_{dtype}_r{repeat}"


def run_side(side: str, dtype: str, job: dict[str, Any], work: Path, repeat: int) -> dict[str, Any]:
    """One run of one side; its steps, the summary over the timed ones, and the peak memory."""
    import psutil

    from arpo.runtime.machine import git_sha

    out = run_dir(work, side, dtype, repeat)
    # A run starts clean: what an earlier, unfinished or other-job run left there (its metrics.jsonl, which our
    # trainer appends to) must not count as this run's steps.
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if side == "trl":
        cmd = [sys.executable, __file__, "--trl-child", str(work / "job.json"), "--dtype-child", dtype,
               "--out-child", str(out)]
    else:
        cmd = ours_command(side, dtype, job, out)
    threads = str(job["threads"])
    env = environ_with({"OMP_NUM_THREADS": threads, "TRL_EXPERIMENTAL_SILENCE": "1", "TQDM_DISABLE": "1",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    start = time.perf_counter()
    with (out / "run.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        with tree_memory_sampler(root) as memory:
            rc = proc.wait()
    peak_rss, peak_pss = memory.peaks
    wall = time.perf_counter() - start
    rows = job["prompts_per_step"] * job["n"]
    if side != "trl":
        steps = ours_steps(out, rows)
    else:  # the child writes its steps when it finishes
        steps = json.loads((out / "steps.json").read_text()) if (out / "steps.json").is_file() else []
    result: dict[str, Any] = {"side": side, "dtype": dtype, "repeat": repeat, "returncode": rc,
                              "wall_s": round(wall, 1), "peak_rss_gb": round(peak_rss / 2**30, 2),
                              "peak_pss_gb": round(peak_pss / 2**30, 2),
                              "memory_sampling_cpu_s": round(memory.cpu_seconds, 1), "steps": steps,
                              "log": repo_path(out / "run.log"), "git_sha": git_sha()}
    timed = steps[job["warmup"]:]
    if rc != 0 or not timed:
        tail = (out / "run.log").read_text(errors="replace").splitlines()[-5:]
        result["error"] = repo_relative(" | ".join(tail))
        return result
    seconds = statistics.median(s["seconds"] for s in timed)
    result["step_s"] = round(seconds, 2)
    for key in ("generated_tokens", "trained_tokens"):
        values = [s[key] / s["seconds"] for s in timed if s.get(key) is not None]
        if values:
            result[f"{key.split('_')[0]}_tokens_per_s"] = round(statistics.median(values), 1)
    (out / "result.json").write_text(json.dumps({"job": job, "result": result}))
    return result


#: job keys only one side reads: a change to them leaves the other side's finished runs valid
SIDE_KEYS = {"trl": ("trl_generation", "trl_bf16_weights"), "ours": ("ours_overrides",)}


def side_job(side: str, job: dict[str, Any]) -> dict[str, Any]:
    """The part of ``job`` that ``side``'s run depends on."""
    other = SIDE_KEYS["ours" if side == "trl" else "trl"]
    return {k: v for k, v in job.items() if k not in other}


def finished_run(side: str, dtype: str, job: dict[str, Any], work: Path, repeat: int) -> dict[str, Any] | None:
    """The result of this run when an earlier benchmark finished it in ``work`` for the same job (as ``side``
    reads it: ``--ours-set`` does not rerun TRL, nor ``--trl-generation`` ours)."""
    path = run_dir(work, side, dtype, repeat) / "result.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    # jobs saved before the key existed ran with checkpointing on both sides
    saved_job = {"gradient_checkpointing": True, **saved.get("job", {})}
    return saved["result"] if side_job(side, saved_job) == side_job(side, job) else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dtype and side: the median and range over repeats; ours / TRL's step time paired by repeat."""
    out: dict[str, Any] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        here = [r for r in runs if r["dtype"] == dtype and "step_s" in r]
        table: dict[str, Any] = {}
        for side in dict.fromkeys(r["side"] for r in here):
            mine = [r for r in here if r["side"] == side]
            row: dict[str, Any] = {"repeats": len(mine)}
            for key in ("step_s", "generated_tokens_per_s", "trained_tokens_per_s", "peak_rss_gb", "peak_pss_gb"):
                values = [r[key] for r in mine if key in r]
                if values:
                    row[key] = {"median": round(statistics.median(values), 2), "min": min(values),
                                "max": max(values)}
            trl = {r["repeat"]: r for r in here if r["side"] == "trl"}
            paired = [(r, trl[r["repeat"]]) for r in mine if side != "trl" and r["repeat"] in trl]
            # Per trained token too: the two sides sample their completions, so a step's work differs by its
            # lengths (±10% over one step of 64 completions), and the update's time follows them.
            for key, ratios in (("ratio_to_trl", [o["step_s"] / t["step_s"] for o, t in paired]),
                                ("ratio_to_trl_per_trained_token",
                                 [t["trained_tokens_per_s"] / o["trained_tokens_per_s"] for o, t in paired
                                  if "trained_tokens_per_s" in o and "trained_tokens_per_s" in t])):
                if ratios:
                    row[key] = {"median": round(statistics.median(ratios), 3),
                                "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
            table[side] = row
        out[dtype] = table
    return out


def _spread(cell: dict[str, Any] | None, digits: int = 1) -> str:
    if not cell:
        return "–"
    return f"{cell['median']:.{digits}f} [{cell['min']:.{digits}f}, {cell['max']:.{digits}f}]"


def write_table(folder: Path) -> dict[str, Any]:
    """``folder/table.md`` from every bench_peers JSON in ``folder``: per machine, dtype, TRL's generation and side
    the medians and ranges over repeats, and ours / TRL's step time and time per trained token."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("benchmark") != "bench_peers":
            continue
        m = result["machine"]
        machine = f"{m['cpu_model']}, {m['cpus']} cpus, torch {m['torch_cpu_capability']}" + (
            f", {m['gpu']}" if m.get("gpu") else "")
        job = result.get("job", {})
        trl = job.get("trl_generation", "hf") + (", bf16 weights" if job.get("trl_bf16_weights") else "")
        recompute = "" if job.get("gradient_checkpointing", True) else ", no gradient checkpointing"
        for dtype, sides in result["summary"].items():
            for side, row in sides.items():
                rows.append({"file": path.name, "machine": machine, "dtype": dtype + recompute, "trl_config": trl,
                             "side": side, "repeats": row["repeats"], "step_s": row.get("step_s"),
                             "generated_tokens_per_s": row.get("generated_tokens_per_s"),
                             "trained_tokens_per_s": row.get("trained_tokens_per_s"),
                             "peak_pss_gb": row.get("peak_pss_gb"), "ratio_to_trl": row.get("ratio_to_trl"),
                             "ratio_per_token": row.get("ratio_to_trl_per_trained_token"),
                             "ours_set": " ".join(job.get("ours_overrides", [])), "commit": m["git_sha"][:7]})
    lines = ["| machine | dtype | TRL generates with | our overrides | side | repeats | s / step | generated tok/s | "
             "trained tok/s | peak PSS GB | ours / TRL (s / step) | ours / TRL (s / trained token) | commit | file |",
             "|" + "---|" * 14]
    for r in rows:
        ours_set = f"`{r['ours_set']}`" if r["side"] != "trl" and r["ours_set"] else "–"
        lines.append(f"| {r['machine']} | {r['dtype']} | {r['trl_config']} | {ours_set} | {r['side']} | "
                     f"{r['repeats']} | {_spread(r['step_s'])} | "
                     f"{_spread(r['generated_tokens_per_s'])} | {_spread(r['trained_tokens_per_s'])} | "
                     f"{_spread(r['peak_pss_gb'], 2)} | {_spread(r['ratio_to_trl'], 3)} | "
                     f"{_spread(r['ratio_per_token'], 3)} | {r['commit']} | `{r['file']}` |")
    (folder / "table.md").write_text("Median [min, max] over repeats (`python experiments/bench_peers.py --table "
                                     f"{repo_path(folder)}`).\n\n" + "\n".join(lines) + "\n")
    return {"benchmark": "bench_peers", "table": repo_path(folder / "table.md"), "rows": rows}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_RUN / "models" / "smollm2-sft",
                   help="the SFT'd HF model both sides start from (default: make run's)")
    p.add_argument("--data", type=Path, default=DEFAULT_RUN / "data" / "synthetic" / "train.parquet",
                   help="verl parquet whose first prompts make the job (default: make run's training set)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bfloat16"])
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (make run: 8)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (make run: M = 8)")
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--max-response-length", type=int, default=384)
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch on both sides (make run: 8)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the step time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads of TRL's process; our side splits the same cores over its ranks and engine")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                   help="recompute each decoder layer in the backward, on both sides (default on: TRL's and make "
                        "run's setting; off: more memory, and TRL's step 11%% shorter on a 2-core CPU)")
    p.add_argument("--trl-generation", choices=TRL_GENERATION, default="continuous",
                   help="TRL's generation (default: continuous batching, its fastest on a CPU)")
    p.add_argument("--trl-bf16-weights", action="store_true",
                   help="TRL at bfloat16 keeps its weights in bf16 instead of mixed precision over float32 weights")
    p.add_argument("--ours-set", action="append", metavar="KEY=VALUE", default=None,
                   help="a config override for our sides (repeatable; default: none, our defaults), e.g. "
                        "actor_rollout_ref.rollout.enforce_eager=false (vLLM compiled)")
    p.add_argument("--work-dir", type=Path, default=None, help="runs' logs and outputs (default: a temporary dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--table", type=Path, default=None,
                   help="only write FOLDER/table.md from the bench_peers JSON files in FOLDER (several machines)")
    p.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dtype-child", choices=DTYPES, help=argparse.SUPPRESS)
    p.add_argument("--out-child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ours_set = args.ours_set or []  # our defaults, as a user runs them
    for override in args.ours_set:
        if "=" not in override:
            p.error(f"--ours-set {override!r}: give KEY=VALUE (a config override)")
    if args.trl_child is None and args.table is None:
        for name, value in (("--model", args.model), ("--data", args.data)):
            if not value.exists():
                p.error(f"{name} {value}: not found; run `make run` first (it makes both) or pass {name}")
        if args.warmup >= args.steps:
            p.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}: lower it")
        if (args.prompts * args.n) % min(args.micro, args.prompts * args.n):
            p.error(f"--micro {args.micro} must divide --prompts x --n = {args.prompts * args.n}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from arpo.runtime.machine import machine_info

    args = parse_args(argv)
    if args.trl_child is not None:
        trl_child(json.loads(args.trl_child.read_text()), args.dtype_child, args.out_child)
        return 0
    if args.table is not None:
        print(json.dumps(write_table(args.table.resolve()), indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        work = (args.work_dir or Path(tmp)).resolve()
        job = write_job(args, work)
        (work / "job.json").write_text(json.dumps(job))
        from importlib import metadata

        versions = {d: metadata.version(d) for d in ("trl", "transformers", "accelerate", "torch")}
        head = {"benchmark": "bench_peers", "command": "python experiments/bench_peers.py " + " ".join(
                    repo_relative(a) for a in (argv if argv is not None else sys.argv[1:])),
                "machine": machine_info(), "versions": versions,
                "job": {k: (repo_path(Path(v)) if k in ("model", "prompts_file", "data") else v)
                        for k, v in job.items()}}
        runs: list[dict[str, Any]] = []
        result = {**head, "summary": {}, "runs": runs}
        for repeat in range(args.repeats):
            for dtype in args.dtypes:
                for side in args.sides:  # alternating, so a drift in the machine's speed reaches every side
                    kept = finished_run(side, dtype, job, work, repeat)
                    print(f"bench_peers: repeat {repeat + 1}/{args.repeats} {dtype} {side}"
                          + (" (finished earlier in --work-dir: kept)" if kept else ""), file=sys.stderr, flush=True)
                    runs.append(kept or run_side(side, dtype, job, work, repeat))
                    result = {**head, "summary": summarize(runs), "runs": runs}
                    if args.out:  # after every run: a killed benchmark keeps what it measured
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if all("step_s" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
