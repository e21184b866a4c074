"""Where SFT runs on different CPU kernels part: the same SFT under several kernel and thread settings.

The same seed gives a different SFT model on a different CPU: torch's vectorised kernels (ATen, by
``ATEN_CPU_CAPABILITY``), MKL's and oneDNN's matmuls (by the CPU's instruction sets) and the thread count decide
the order of floating-point sums. This script trains one preset's SFT on one machine under settings that emulate
those differences (each in a fresh process: the libraries read their environment once), on the same
demonstrations and base model, and compares every run with the first one:

* the first forward and backward of the first batch, module by module in call order: the first module whose
  output differs (bit for bit), its largest difference, the loss and the largest gradient difference;
* the loss of every step: the first step whose loss differs, the largest difference;
* the final weights: the largest absolute difference.

Settings: ``name=threads=N,dtype=D,vs=OTHER,ENV=VALUE,...`` (empty VALUE: unset; ``vs``: compare with that
setting instead of the first). Prints one JSON object.

    python experiments/sft_spread.py --preset tiny --steps 200 --work /tmp/sft_spread
    python experiments/sft_spread.py --preset smollm2 --steps 10 --settings "default=threads=2" "t1=threads=1"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import environ_with, git_sha  # noqa: E402

DEFAULT_SETTINGS = (
    "default=",
    "default_again=",
    "threads_2=threads=2",
    "aten_default=ATEN_CPU_CAPABILITY=default",
    "onednn_sse41=ONEDNN_MAX_CPU_ISA=SSE41",
    "mkl_compatible=MKL_CBWR=COMPATIBLE",
    "bfloat16=dtype=bfloat16",
)


def parse_setting(text: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``name=threads=N,dtype=D,vs=OTHER,KEY=VALUE,...`` -> (name, {threads, dtype, vs} given, env)."""
    name, _, rest = text.partition("=")
    own, env = {}, {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        (own if key in ("threads", "dtype", "vs") else env)[key] = value
    return name, own, env


def prepare(work: Path, preset: str, overrides: list[str]) -> dict:
    """Data, base model and the demonstrations (built once, shared by every setting) under ``work``."""
    from arpo.pipeline import Pipeline
    from arpo.data.sft_demonstrations import DemonstrationStream, iter_demonstrations
    from tools.registry import load_tools

    import pandas as pd
    from transformers import AutoTokenizer

    pipeline = Pipeline(work, preset, overrides)
    if not (pipeline.paths["data"] / "train.parquet").exists():
        pipeline._generate_data()
    if not (pipeline.base_model_dir / "config.json").exists():
        pipeline._build_base()
    cfg = pipeline.config("sft")
    s = cfg.sft
    demos_path = work / "demos.json"
    if not demos_path.exists():
        tokenizer = AutoTokenizer.from_pretrained(str(pipeline.base_model_dir))
        tools = load_tools(cfg.tools)
        df = pd.read_parquet(s.train_file)
        if s.max_samples and len(df) > s.max_samples:
            df = df.iloc[: s.max_samples]
        demos = iter_demonstrations(df, tokenizer, tools, s.seed, s.demo.skip_tool_prob, s.demo.wrong_tool_prob,
                                    s.tool_workers, s.demo.verbose_think, s.demo.wrong_pick_prob)
        examples = DemonstrationStream(demos, s.max_length).collect()
        for tool in tools.values():
            tool.close()
        demos_path.write_text(json.dumps(examples))
    sft = {k: s[k] for k in ("seed", "epochs", "batch_size", "lr", "warmup_ratio", "weight_decay", "grad_clip",
                             "share_prompt_prefix", "num_threads", "dtype")}
    return {"base_model": str(pipeline.base_model_dir), "demos": str(demos_path), "sft": sft}


def child(work: Path, name: str, threads: int, dtype: str, steps: int) -> None:
    """One setting, in this fresh process: the first batch's forward/backward probe, then ``steps`` SFT steps."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arpo.data.sft_batches import shuffled_batches
    from arpo.sft import plan_steps, train_sft, worker_config
    from arpo.trainer.device import device_settings
    from arpo.trainer.sft_step import masked_lm_loss
    from arpo.trainer.worker_group import LocalWorkerGroup

    plan = json.loads((work / "plan.json").read_text())
    s = plan["sft"]
    torch.set_num_threads(threads)
    examples = [tuple(x) for x in json.loads(Path(plan["demos"]).read_text())]
    pad_id = AutoTokenizer.from_pretrained(plan["base_model"]).pad_token_id

    def load():
        torch.manual_seed(s["seed"])
        return AutoModelForCausalLM.from_pretrained(plan["base_model"], dtype=torch.float32)

    model = load()
    model.train()
    outputs: dict[str, torch.Tensor] = {}

    def hook(module, args, out, key=None):
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor):
            outputs[f"{len(outputs):03d} {key}"] = out.detach().float().clone()

    handles = [m.register_forward_hook(lambda mod, a, o, key=n: hook(mod, a, o, key)) for n, m in
               model.named_modules() if n]
    input_ids, attn, labels, prefix = next(shuffled_batches(examples, s["batch_size"], np.random.default_rng(s["seed"]),
                                                    pad_id, s["share_prompt_prefix"]))
    with device_settings("cpu", dtype).autocast_context():
        loss = masked_lm_loss(model, input_ids, attn, labels, prefix)
    loss.backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"outputs": outputs, "loss": loss.detach(), "grads": grads}, work / f"probe_{name}.pt")

    torch.manual_seed(s["seed"])
    total = plan_steps(len(examples), s["batch_size"], s["epochs"], steps)[1]
    group = LocalWorkerGroup(worker_config({**s, "dtype": dtype, "num_ranks": 1, "num_threads": threads,
                                            "device": "cpu"}, plan["base_model"], total), role="sft")
    start = time.perf_counter()
    try:
        summary = train_sft(group, examples, epochs=s["epochs"], batch_size=s["batch_size"], seed=s["seed"],
                            pad_id=pad_id, max_steps=steps, share_prompt_prefix=s["share_prompt_prefix"])
        torch.save(group.full_parameters(), work / f"final_{name}.pt")
    finally:
        group.shutdown()
    from arpo.runtime.machine import machine_info

    (work / f"run_{name}.json").write_text(json.dumps({
        "losses": summary["losses"], "seconds": round(time.perf_counter() - start, 1),
        "compute_dtype": summary["compute_dtype"], "machine": machine_info()}))


def compare(work: Path, ref: str, name: str) -> dict:
    """``name``'s run against ``ref``'s: where the first bit differs and how far apart they end."""
    import torch

    a, b = (torch.load(work / f"probe_{n}.pt") for n in (ref, name))
    first = None
    for key in a["outputs"]:
        x, y = a["outputs"][key], b["outputs"].get(key)
        if y is None or x.shape != y.shape or not torch.equal(x, y):
            diff = float((x - y).abs().max()) if y is not None and x.shape == y.shape else None
            first = {"module": key.split(" ", 1)[1], "call_index": int(key.split(" ", 1)[0]), "max_abs_diff": diff}
            break
    grad_diff = max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"])
    probe = {"first_differing_module": first, "loss_diff": float((a["loss"] - b["loss"]).abs()),
             "max_grad_diff": grad_diff}
    if not (work / f"run_{name}.json").exists():  # stopped after its probe (--probe-only)
        return {"first_forward": probe, "training": "not run"}
    ra, rb = (json.loads((work / f"run_{n}.json").read_text()) for n in (ref, name))
    la, lb = ra["losses"], rb["losses"]
    first_step = next((i + 1 for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)
    wa, wb = (torch.load(work / f"final_{n}.pt") for n in (ref, name))
    weight_diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return {"first_forward": probe,
            "first_differing_step": first_step,
            "max_loss_diff": round(max(abs(x - y) for x, y in zip(la, lb)), 6),
            "final_loss_mean_last20": round(sum(lb[-20:]) / len(lb[-20:]), 4),
            "final_weights_max_abs_diff": weight_diff, "seconds": rb["seconds"], "compute_dtype": rb["compute_dtype"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--work", type=Path, default=Path("outputs/sft_spread"))
    parser.add_argument("--steps", type=int, default=200, help="SFT steps of every setting (the schedule spans them)")
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    parser.add_argument("--probe-only", action="store_true",
                        help="compare settings that have only their first-batch probe (no SFT steps)")
    parser.add_argument("--nice", type=int, default=0, help="run each setting under nice -n N")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.work, args.child, args.threads, args.dtype, args.steps)
        return
    plan = prepare(args.work, args.preset, overrides)
    (args.work / "plan.json").write_text(json.dumps(plan))
    settings = [parse_setting(s) for s in args.settings]
    for name, own, env in settings:
        done = args.work / (f"probe_{name}.pt" if args.probe_only else f"run_{name}.json")
        if done.exists():  # by an earlier invocation: runs resume by setting
            continue
        full_env = environ_with(env)
        cmd = (["nice", "-n", str(args.nice)] if args.nice else []) + [
            sys.executable, __file__, "--child", name, "--work", str(args.work), "--steps", str(args.steps),
            "--threads", own.get("threads", str(plan["sft"]["num_threads"])),
            "--dtype", own.get("dtype", plan["sft"]["dtype"])]
        r = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"setting {name} failed: {r.stderr[-3000:]}")
        print(f"{name} done", file=sys.stderr, flush=True)
    ref = settings[0][0]
    from arpo.runtime.machine import machine_info

    print(json.dumps({"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                      "git_sha": git_sha(), "machine": machine_info(), "preset": args.preset, "steps": args.steps,
                      "sft": plan["sft"], "reference": ref,
                      "settings": {name: {"threads": own.get("threads", plan["sft"]["num_threads"]),
                                          "dtype": own.get("dtype", plan["sft"]["dtype"]), "env": env,
                                          "compared_with": own.get("vs", ref),
                                          **compare(args.work, own.get("vs", ref), name)}
                                   for name, own, env in settings}},
                     indent=2))


if __name__ == "__main__":
    main()
