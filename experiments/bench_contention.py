"""How a busy machine slows training: a forward+backward step and an SFT step, alone and beside one busy process.

A laptop is rarely idle. With one other CPU-bound process on a 2-core machine the fair share of a 2-thread
training step is half the machine, so a step should take about 2x as long, no more. OpenMP's worker threads wait
for each other at the end of every parallel region (thousands a step); while they spin-wait they keep a core from
the thread they wait for, which the busy process has already taken half of. This bench measures the step times
under each threading setting (``--settings``: name=ENV=VALUE,... ; threads=N sets the step's torch threads),
each in a fresh process (OpenMP reads its environment once, at start-up), alone and beside a pure-Python spin
loop on one core that the bench starts and stops. Runs are interleaved (setting x load, ``--repeats`` rounds) so
that other load on the machine spreads over all of them; the medians are reported.

Steps: ``fwd_bwd`` (forward + backward of ``--rows`` x ``--tokens`` on the model, loss over every position) and
``sft`` (arpo.sft's step: the masked LM loss with the shared prompt prefix, backward, clipping, fused AdamW).
Prints one JSON object.

    python experiments/bench_contention.py                     # SmolLM2-135M (converted once, as the pipeline does)
    python experiments/bench_contention.py --model-dir DIR --repeats 3 --steps 3
    python experiments/bench_contention.py --settings "old=threads=2" "passive=threads=2,OMP_WAIT_POLICY=PASSIVE"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
#: the OpenMP wait policy this process started with, before ``import arpo`` sets its default (arpo.THREAD_ENV)
STARTED_WITH = os.environ.get("OMP_WAIT_POLICY")

#: the settings compared by default: how processes started before (OpenMP's default wait policy), and the
#: environment arpo now sets where its processes start (arpo.THREAD_ENV)
DEFAULT_SETTINGS = ("old=threads=2,OMP_WAIT_POLICY=", "new=threads=2,OMP_WAIT_POLICY=PASSIVE")
SPIN = "while True: pass"


def parse_setting(text: str) -> tuple[str, int, dict[str, str]]:
    """``name=threads=N,KEY=VALUE,...`` -> (name, threads, env); an empty VALUE removes KEY from the environment."""
    name, _, rest = text.partition("=")
    threads, env = 0, {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "threads":
            threads = int(value)
        else:
            env[key] = value
    return name, threads, env


def child(args: argparse.Namespace) -> None:
    """One setting's step times, in this (fresh) process: torch (and with it OpenMP) loads before arpo, so
    the setting's environment is what OpenMP reads."""
    import torch
    from transformers import AutoModelForCausalLM

    from arpo.trainer.sft_step import masked_lm_loss

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.tokens))
    ids[:, : args.tokens // 4] = ids[:1, : args.tokens // 4]  # a shared system prompt, as SFT batches have
    attn = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, : args.tokens // 2] = -100  # trained on the second half, as a demonstration's response
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def fwd_bwd() -> None:
        model(input_ids=ids, attention_mask=attn, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def sft() -> None:
        masked_lm_loss(model, ids, attn, labels, shared_prefix=args.tokens // 4 - 1).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    out = {"torch_threads": torch.get_num_threads(), "omp_wait_policy_at_start": STARTED_WITH}
    for name, step in (("fwd_bwd", fwd_bwd), ("sft", sft)):
        step()  # warm-up: first-touch allocations, oneDNN primitive creation
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[name] = times
    print(json.dumps(out))


def run_setting(args: argparse.Namespace, threads: int, env: dict[str, str]) -> dict:
    from experiments import environ_with  # here, not at the top: a child loads torch before arpo

    full_env = environ_with(env)
    cmd = [sys.executable, __file__, "--child", "--model-dir", str(args.model_dir), "--rows", str(args.rows),
           "--tokens", str(args.tokens), "--steps", str(args.steps), "--threads", str(threads)]
    r = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def default_model_dir() -> Path:
    from arpo.models.pretrained import prepare_base_model

    return prepare_base_model("smollm2-135m-instruct", Path("outputs/smollm2_arpo/models/smollm2-base"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="HF checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS),
                        help="name=threads=N,ENV=VALUE,... (empty VALUE: unset)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds over settings x load")
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.model_dir = args.model_dir or default_model_dir()
    settings = [parse_setting(s) for s in args.settings]
    times: dict[str, dict[str, dict[str, list[float]]]] = {
        name: {load: {"fwd_bwd": [], "sft": []} for load in ("alone", "busy")} for name, _, _ in settings}
    # the machine's 1-minute load average before and after each run: other work on the machine, which no
    # interleaving removes, shows here
    loads: dict[str, dict[str, list]] = {name: {"alone": [], "busy": []} for name, _, _ in settings}
    policies: dict[str, str | None] = {}
    for rnd in range(args.repeats):
        for name, threads, env in settings:
            for load in ("alone", "busy"):
                spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "busy" else None
                try:
                    load_before = os.getloadavg()[0]
                    result = run_setting(args, threads, env)
                    loads[name][load].append([round(load_before, 2), round(os.getloadavg()[0], 2)])
                    policies[name] = result["omp_wait_policy_at_start"]
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                for step in ("fwd_bwd", "sft"):
                    times[name][load][step] += result[step]
                print(f"round {rnd + 1}/{args.repeats} {name} {load}: fwd_bwd {result['fwd_bwd']} sft "
                      f"{result['sft']}", file=sys.stderr, flush=True)
    summary = {}
    for name, threads, env in settings:
        row: dict = {"threads": threads, "env": env, "omp_wait_policy_in_effect": policies[name],
                     "load_average_before_after": loads[name]}
        for step in ("fwd_bwd", "sft"):
            alone = statistics.median(times[name]["alone"][step])
            busy = statistics.median(times[name]["busy"][step])
            row[step] = {"alone_s": round(alone, 3), "busy_s": round(busy, 3), "slowdown": round(busy / alone, 2),
                         "alone_all_s": [round(t, 3) for t in times[name]["alone"][step]],
                         "busy_all_s": [round(t, 3) for t in times[name]["busy"][step]]}
        summary[name] = row
    from arpo.runtime.machine import machine_info
    from experiments import git_sha

    print(json.dumps({"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                      "git_sha": git_sha(), "machine": machine_info(), "model": args.model_dir.name,
                      "rows": args.rows, "tokens": args.tokens, "steps_per_run": args.steps,
                      "repeats": args.repeats, "busy_process": f"python -c '{SPIN}' (one core)",
                      "settings": summary}, indent=2))


if __name__ == "__main__":
    main()
