"""Trainer step time and memory: old log-probs, the PPO update and the weight push on FSDP2 ranks (Ray actors, or
one rank in this process with ``--no-ray``).

Settings (``--settings all``): one rank with all ``--cpus`` threads, one rank with ``--cpus / --ranks`` threads,
and ``--ranks`` FSDP2 ranks with ``--cpus / --ranks`` threads each, plus the largest parameter difference
between one rank and N after the same updates (data parallelism must not change the result: ~1e-7 with
``--set actor_rollout_ref.model.dtype=float32``, bf16 rounding otherwise). Model keys default to
configs/trainer/actor.yaml's (bf16, gradient checkpointing).
``--settings multi`` runs only the N-rank setting (what a training run uses), once per ``--micro`` value.

Per setting: the median wall and CPU seconds (of the busiest rank) of each phase over ``--steps`` timed steps
(after ``--warmup`` steps), and per rank the peak resident memory of each phase (VmHWM, reset before every
phase) and of loading the model; on a GPU also the peak allocated GPU memory of each phase. Also the policy's
parameters and trainable parameters (LoRA: the adapters), the weight push's bytes, and the update's micro-batches
per rank with the token positions they run and the padding among them (``padding_fraction``: row batching vs
``--set actor_rollout_ref.actor.use_dynamic_bsz=true``). On a machine shared with other jobs the CPU seconds are
the comparable number.
Prints one JSON object on stdout and nothing else: a progress line per ``--micro`` value, logs and the Ray
workers' output go to stderr.

    python experiments/bench_trainer.py                       # builds the tiny model, 2 ranks vs 1
    python experiments/bench_trainer.py --rows 4 --prompt-len 16 --response-len 24 --settings multi --steps 1 \\
        --warmup 0 --micro 2                                  # smoke: one step on 2 ranks (about a minute)
    python experiments/bench_trainer.py --model /tmp/smollm2-hf --rows 32 --prompt-len 120-150 \\
        --response-len 300-500 --ranks 2 --micro 1,2,4,8 --settings multi --steps 1 --warmup 0
    ... --on-policy                                           # no old-log-prob pass (one mini-batch, 1 epoch)
    ... --set actor_rollout_ref.model.dtype=float32           # any config key (YAML-typed value)
    ... --system 105 --set actor_rollout_ref.model.share_prefix=false   # a shared system prompt, run per row
    ... --set actor_rollout_ref.model.lora_rank=8 --set actor_rollout_ref.model.lora_alpha=16   # LoRA adapters
    ... --layout-only --set actor_rollout_ref.actor.use_dynamic_bsz=true     # padding only (bench_layout.py)
    ... --trees experiments/results/smollm2_advantage/rollouts/arpo_soft.jsonl --prompt-len 200 \
        --set actor_rollout_ref.model.tree_packing=true|false
    python experiments/bench_trainer.py --model CONFIG_DIR --random-init --no-ray --ranks 1 --settings multi \
        --device cuda ...                                     # one GPU, no Ray: the checkpoint's architecture with
                                                              # random weights (CONFIG_DIR: config.json, tokenizer)
        # ARPO trees: each group's shape (forks, lengths, tool results) from a rollout dump, random token ids;
        # reports the batch's packed (unique) and total tokens
    python experiments/bench_trainer.py --model /tmp/smollm2-hf --numerics --text README.md --rows 4 \
        --prompt-len 150 --response-len 400 --sample 400
        # bf16 autocast vs fp32 on one process, on responses sampled from the model: log-prob / entropy
        # differences, gradient cosine and relative error
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from experiments.trainer_batches import (length_range, make_batch, sampled_batch, text_batch,  # noqa: E402
                                         token_counts, tree_dump_batch)

PHASES = ("old_log_prob", "update_policy", "weight_sync")


def build_default_model(work: Path) -> Path:
    from arpo.data.synthetic import generate
    from arpo.models.tiny import build_tiny_model

    paths = generate(work / "synthetic", seed=0, sizes={"train": 300, "val": 8, "test": 8})
    return build_tiny_model(work / "model", [paths["train"], paths["corpus"]], seed=0)


def random_init_model(source: Path, out: Path, device: str = "cpu") -> Path:
    """``source``'s architecture with freshly initialised weights, saved (with its tokenizer files) at ``out``.

    On a GPU the weights are initialised there and saved in bf16: a 7B model's random init on the CPU and its
    30 GB fp32 file took most of a 160 s check (the trainer keeps fp32 master weights either way)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)), dtype=dtype)
    model.save_pretrained(out)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    for f in source.iterdir():
        if f.is_file() and not (out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def write_profile(profiler, kernels, path: Path) -> None:
    """The Python profile's 40 costliest functions by own and by cumulative time, then torch's operators by
    device time (by CPU time without a GPU), as text."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text.write(kernels.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60))
    path.write_text(text.getvalue())


def device_name(device: str) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return platform.processor() or platform.machine()


def numerics(model_dir: Path, batch, chunk: int, sample_len: int = 0) -> dict:
    """bf16 autocast against fp32 on one process (no FSDP): the same forward/backward of a policy-gradient
    loss in each precision; differences over response tokens, gradient agreement over all parameters."""
    from transformers import AutoModelForCausalLM

    from arpo.trainer.logprobs import compute_logprobs_and_entropy

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if sample_len:
        batch = sampled_batch(model, batch, sample_len, seed=0)
    model.train()  # no dropout in these models; train mode as in the update
    mask = batch["response_mask"].bool()

    def run(autocast: bool, head_fp32: bool):
        model.zero_grad(set_to_none=True)
        t0 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, ent = compute_logprobs_and_entropy(
                model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                batch["responses"].shape[1], chunk_size=chunk, calc_entropy=True, entropy_grad=False,
                head_fp32=head_fp32)
        loss = -(batch["advantages"] * logp * mask).sum() / mask.sum()
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        return logp.detach()[mask], ent.detach()[mask], grad, time.process_time() - t0

    ref_lp, ref_ent, ref_grad, ref_s = run(False, True)
    out: dict = {"tokens": int(mask.sum()), "fp32_cpu_s": round(ref_s, 2), "fp32_mean_log_prob": float(ref_lp.mean()),
                 "fp32_mean_entropy": float(ref_ent.mean())}
    for name, head_fp32 in (("bf16_autocast_fp32_head", True), ("bf16_autocast_bf16_head", False)):
        lp, ent, grad, secs = run(True, head_fp32)
        d = (lp - ref_lp).abs()
        out[name] = {
            "cpu_s": round(secs, 2),
            "log_prob_abs_diff_mean": float(d.mean()), "log_prob_abs_diff_p99": float(d.quantile(0.99)),
            "log_prob_abs_diff_max": float(d.max()),
            "ratio_exp_diff_mean": float((lp - ref_lp).exp().sub(1).abs().mean()),
            "entropy_abs_diff_mean": float((ent - ref_ent).abs().mean()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0)),
            "grad_rel_l2_error": float((grad - ref_grad).norm() / ref_grad.norm()),
        }
    return out


def _set(cfg: dict, dotted: str, value) -> None:
    node = cfg
    *path, last = dotted.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def config(model: Path, ranks: int, cpus_per_rank: float, micro: int, args) -> dict:
    import yaml

    n = args.group_size
    cfg = {
        "trainer": {"device": args.device, "nnodes": 1, "n_gpus_per_node": ranks, "cpus_per_worker": cpus_per_rank},
        "data": {"train_batch_size": args.rows // n},
        "actor_rollout_ref": {
            # configs/trainer/actor.yaml's defaults; --set overrides them.
            "model": {"path": str(model), "dtype": "bfloat16", "enable_gradient_checkpointing": True},
            # One mini-batch of all rows: the on-policy case ARPO's configs run.
            "actor": {"ppo_mini_batch_size": args.rows // n, "ppo_micro_batch_size_per_gpu": micro,
                      "ppo_epochs": 1, "grad_clip": 1.0, "loss_agg_mode": "token-mean", "use_kl_loss": False,
                      "entropy_coeff": 0.0, "clip_ratio": 0.2, "optim": {"lr": 1e-5}},
            "rollout": {"n": n, "log_prob_micro_batch_size_per_gpu": micro},
        },
    }
    for item in args.set:
        key, _, value = item.partition("=")
        _set(cfg, key, yaml.safe_load(value))
    return cfg


def _rank_stats(group) -> tuple[list[float], list[float], list[float]]:
    """Per rank: peak RSS and peak allocated GPU memory (MiB, 0 on CPU) since the last call (which resets
    them), and CPU seconds so far."""
    stats = group.execute_all("memory_stats", True)
    return ([round(s["peak_rss_mb"], 1) for s in stats], [round(s.get("peak_gpu_mb", 0.0), 1) for s in stats],
            [s["cpu_s"] for s in stats])


def run_setting(model: Path, ranks: int, cpus_per_rank: float, micro: int, batch, args) -> dict:
    from arpo.trainer.worker_group import LocalWorkerGroup, RayWorkerGroup
    from experiments.bench_layout import policy_layout

    t0 = time.perf_counter()
    cfg = config(model, ranks, cpus_per_rank, micro, args)
    group = LocalWorkerGroup(cfg) if args.no_ray else RayWorkerGroup(cfg, role="actor")
    start_s = time.perf_counter() - t0
    layout = policy_layout(group, cfg, batch)
    seconds: dict[str, list[float]] = {p: [] for p in PHASES}
    cpu_seconds: dict[str, list[float]] = {p: [] for p in PHASES}
    load_peaks, load_gpu, cpu_before = _rank_stats(group)
    peaks: dict[str, list[float]] = {"load": load_peaks}
    gpu_peaks: dict[str, list[float]] = {"load": load_gpu}
    phases = [p for p in PHASES if not (args.on_policy and p == "old_log_prob")]
    profiler = None
    try:
        for step in range(args.warmup + args.steps):
            if args.profile and step == args.warmup:  # the timed steps only
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
                kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []))
                kernels.__enter__()
            train = batch
            for phase in phases:
                t0 = time.perf_counter()
                if phase == "old_log_prob":
                    train = batch.index(slice(0, len(batch)))
                    train.tensors["old_log_probs"] = group.compute_log_prob(batch)["log_probs"]
                elif phase == "update_policy":
                    metrics = group.update_policy(train)
                else:
                    # rank 0 gathers the weights bucket by bucket into Ray's object store, as a push does
                    sizes = group.plan_weight_sync("bfloat16" if args.device == "cuda" else "float32", 512 * 2**20)
                    for i in range(len(sizes)):
                        bucket = group.weight_bucket(i)
                        if not args.no_ray:
                            import ray

                            ray.wait([bucket], fetch_local=False)
                    group.end_weight_sync()
                elapsed = time.perf_counter() - t0
                step_peaks, step_gpu, cpu_after = _rank_stats(group)
                if step >= args.warmup:  # warm-up steps pay one-off allocation and autograd set-up
                    seconds[phase].append(elapsed)
                    cpu_seconds[phase].append(max(a - b for a, b in zip(cpu_after, cpu_before)))
                cpu_before = cpu_after
                peaks[phase] = [max(a, b) for a, b in zip(peaks.get(phase, step_peaks), step_peaks)]
                gpu_peaks[phase] = [max(a, b) for a, b in zip(gpu_peaks.get(phase, step_gpu), step_gpu)]
        params = group.full_parameters() if args.settings == "all" else {}
    finally:
        if profiler is not None:
            profiler.disable()
            kernels.__exit__(None, None, None)
            write_profile(profiler, kernels, args.profile.with_suffix(f".micro{micro}.txt"))
        group.shutdown()
    out = {"ranks": ranks, "cpus_per_rank": cpus_per_rank, "micro": micro, "start_s": round(start_s, 2), **layout}
    if "weight_sync" in phases:  # LoRA pushes merged weights: as many bytes as full fine-tuning
        out["weight_sync_bytes"] = sum(sizes)
    for phase in phases:
        out[f"{phase}_s"] = round(statistics.median(seconds[phase]), 3)
    out["step_s"] = round(sum(out[f"{p}_s"] for p in phases), 3)
    # finite loss and gradient: the update ran, not just took time
    out["last_update"] = {k: round(float(metrics[k]), 6) for k in ("actor/pg_loss", "actor/grad_norm") if k in metrics}
    # The busiest rank's CPU seconds: the wall time this work takes on an otherwise idle machine.
    for phase in phases:
        out[f"{phase}_cpu_s"] = round(statistics.median(cpu_seconds[phase]), 3)
    out["step_cpu_s"] = round(sum(out[f"{p}_cpu_s"] for p in phases), 3)
    out["peak_rss_mb_per_rank"] = peaks
    out["peak_rss_mb_max"] = max(max(v) for v in peaks.values())
    if any(any(v) for v in gpu_peaks.values()):
        out["peak_gpu_mb_per_rank"] = gpu_peaks
        out["peak_gpu_mb_max"] = max(max(v) for v in gpu_peaks.values())
    out["_params"] = params
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: build the tiny model)")
    p.add_argument("--rows", type=int, default=16, help="trajectories per step (one mini-batch, n=2 per prompt)")
    p.add_argument("--prompt-len", type=length_range, default=(64, 64), help="N or MIN-MAX tokens")
    p.add_argument("--response-len", type=length_range, default=(192, 192), help="N or MIN-MAX tokens")
    p.add_argument("--system", type=int, default=0, help="leading prompt tokens shared by every row (a system "
                   "prompt; actor_rollout_ref.model.share_prefix runs them once per micro-batch)")
    p.add_argument("--micro", default="4", help="comma list: ppo_micro_batch_size_per_gpu (and log-prob micro)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (their memory still counts)")
    p.add_argument("--settings", choices=("all", "multi"), default="all")
    p.add_argument("--on-policy", action="store_true", help="update without an old-log-prob pass")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--numerics", action="store_true", help="bf16 autocast vs fp32 on one process, then exit")
    p.add_argument("--text", type=Path, default=None, help="build rows from this text file (real tokens)")
    p.add_argument("--trees", type=Path, default=None, help="rollout dump (JSONL): rows on its groups' trees; "
                   "--rows is rounded up to whole groups, the first of --prompt-len is the prompt length")
    p.add_argument("--chunk", type=int, default=256, help="logprob_chunk_size for --numerics")
    p.add_argument("--sample", type=int, default=0, metavar="TOKENS",
                   help="--numerics: sample this many response tokens from the model (on-policy tokens)")
    p.add_argument("--device", default="cpu", help="trainer.device: cpu | cuda | auto")
    p.add_argument("--layout-only", action="store_true", help="only the parameters and the update's micro-batches "
                   "and padding, from the config alone (no ranks, no timing): e.g. bf16's layout on an avx2-only CPU")
    p.add_argument("--no-ray", action="store_true", help="one rank in this process (LocalWorkerGroup), no Ray: "
                   "needs --ranks 1 --settings multi")
    p.add_argument("--profile", type=Path, default=None, metavar="PATH", help="with --no-ray: cProfile the timed "
                   "steps into PATH.micro<N>.txt (Python-side cost: where a GPU waits on the CPU)")
    p.add_argument("--random-init", action="store_true", help="--model's architecture (its config.json and "
                   "tokenizer) with random weights: timing where the checkpoint is not at hand")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs to share among the ranks")
    args = p.parse_args()
    if args.no_ray and (args.ranks != 1 or args.settings != "multi"):
        p.error("--no-ray runs one rank: add --ranks 1 --settings multi")
    if args.profile and not args.no_ray:
        p.error("--profile needs --no-ray (the ranks are other processes otherwise)")
    if args.random_init and not args.model:
        p.error("--random-init needs --model (a directory with config.json and the tokenizer)")
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    os.environ.setdefault("TQDM_DISABLE", "1")
    setup_logging()  # console on stderr
    from transformers import AutoConfig

    results = []
    with tempfile.TemporaryDirectory() as work:
        model = args.model or build_default_model(Path(work))
        if args.random_init:
            model = random_init_model(model, Path(work) / "random_init", args.device)
        vocab = AutoConfig.from_pretrained(str(model)).vocab_size
        args.group_size = 2
        if args.trees:
            batch = tree_dump_batch(args.trees, args.rows, args.prompt_len[0], min(vocab, 2000), seed=0)
            args.rows, args.group_size = len(batch), batch.meta["group_size"]
        elif args.text:
            batch = text_batch(model, args.text, args.rows, args.prompt_len, args.response_len, seed=0)
        else:
            batch = make_batch(args.rows, args.prompt_len, args.response_len, min(vocab, 2000), seed=0,
                               system=args.system)
        if args.numerics:
            torch.set_num_threads(max(1, args.cpus // args.ranks))
            print(json.dumps({"bench": "trainer_numerics", "model": str(model), "rows": args.rows,
                              "sampled_response_len": args.sample, **token_counts(batch),
                              **numerics(model, batch, args.chunk, args.sample)}, indent=2), file=out, flush=True)
            return
        if not args.no_ray and not args.layout_only:
            from arpo.runtime.ray_utils import init_ray

            init_ray({"num_cpus": args.cpus, "object_store_memory": 200 * 1024 * 1024})
        for micro in (int(m) for m in args.micro.split(",")):
            entry: dict = {"micro": micro}
            if args.layout_only:
                from experiments.bench_layout import layout_only

                cfg = config(model, args.ranks, 1, micro, args)
                results.append({**entry, f"layout_{args.ranks}_ranks": layout_only(cfg, batch)})
                continue
            if args.settings == "all":
                single = run_setting(model, 1, args.cpus, micro, batch, args)
                # One rank on one rank's share of the CPUs: separates the data-parallel gain from thread
                # scaling (on a busy machine a 2-thread process can be slower than a 1-thread one).
                entry["single_process"] = single
                entry["single_process_one_share"] = run_setting(model, 1, args.cpus / args.ranks, micro, batch, args)
            multi = run_setting(model, args.ranks, args.cpus / args.ranks, micro, batch, args)
            entry[f"fsdp2_{args.ranks}_ranks"] = multi
            if args.settings == "all":
                entry["speedup"] = round(single["step_s"] / multi["step_s"], 3)
                entry["max_param_diff_after_same_updates"] = max(
                    float((single["_params"][k] - multi["_params"][k]).abs().max()) for k in single["_params"])
            for r in entry.values():
                if isinstance(r, dict):
                    r.pop("_params")
            results.append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)  # progress: one line per micro size
    print(json.dumps({
        "bench": "trainer_step", "device": args.device, "device_name": device_name(args.device),
        "model": str(args.model or "tiny (built)"), "random_init": args.random_init, "no_ray": args.no_ray,
        "torch": torch.__version__,
        "rows": args.rows, "prompt_len": list(args.prompt_len), "system": args.system,
        "response_len": list(args.response_len), "trees": str(args.trees) if args.trees else None,
        **token_counts(batch),
        "on_policy": args.on_policy, "overrides": args.set, "timed_steps": args.steps, "warmup_steps": args.warmup,
        "cpu_count": os.cpu_count(), "results": results,
    }, indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
