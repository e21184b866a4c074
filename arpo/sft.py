"""Cold-start SFT: teach the tiny model the ARPO protocol before RL, as the paper does.

Demonstrations (:mod:`arpo.data.sft_demonstrations`) are built from each training row's gold tool plan
(``extra_info.plan``) by running the REAL tools (search over the benchmark's corpus, the sandboxed Python
interpreter), so the results the model sees in SFT are exactly what it will see in RL. Each demonstration is laid
out token for token like an RL trajectory: model segments and tool-result segments are tokenised separately and
concatenated (token-in-token-out), and the loss is masked on the prompt and on every ``<result>`` segment, exactly
as the RL response mask.

Demonstrations are deliberately imperfect (``sft.demo.*``): some skip a needed tool call and guess, some call
the wrong tool first and guess, so the SFT model follows the format but leaves headroom for RL. Thoughts are short
fixed sentences unless ``sft.demo.verbose_think``: the free text the model learns to write is the tool calls and the
boxed answer, where a tiny model sampling at T=1 is most likely to drift into a stray tag.

The first epoch trains on the demonstrations as the tools produce them (``sft.stream_demos``), so the tool calls
overlap training instead of preceding it.

The demonstrations are one source: ``sft.train_file`` may instead hold recorded trajectories (OpenAI ``messages`` or
ShareGPT ``conversations``), which :mod:`arpo.data.sft_dataset` lays out the same way and SFT trains on alike.

Training runs on the RL trainer's FSDP2 workers (:mod:`arpo.trainer.sft_step`): this driver builds the examples and
the seeded batch order (:mod:`arpo.data.sft_batches`) and hands each global batch to ``sft.num_ranks`` ranks (1: in
this process; more: Ray actors), which take the optimizer step together; the loss is normalised by the whole
batch's trained tokens, so any number of ranks takes the same steps. Checkpoints are the RL trainer's
(``sft.default_local_dir``, every ``sft.save_freq`` steps and at the end) and a killed run resumes from the newest
(``sft.resume_mode: auto``) to the weights of an uninterrupted one. The model is exported to ``sft.out_dir``
(``save_pretrained`` layout, tokenizer, ``sft_summary.json``).

Run: ``python -m arpo.sft [sft.epochs=...] [sft.train_file=...] [sft.num_ranks=...]
[actor_rollout_ref.model.path=...]``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from arpo.data.sft_batches import shuffled_batches, streamed_batches
from arpo.data.sft_demonstrations import DemonstrationStream, iter_demonstrations

logger = logging.getLogger(__name__)


def plan_steps(n_examples: int, batch_size: int, epochs: int, max_steps: int = 0) -> tuple[int, int]:
    """(steps per epoch, planned steps): ``min(epochs, max_steps)`` of full batches; the schedule spans them."""
    steps_per_epoch = n_examples // batch_size
    total = max(1, steps_per_epoch * epochs)
    return steps_per_epoch, min(total, max_steps) if max_steps else total


@dataclass
class DataPosition:
    """Where the batches stand (a checkpoint's ``data.pt``): the epoch, the batches of it already trained, and
    the batch order's RNG state at the epoch's start. A resumed run replays the epoch's batch order from that
    state and skips the batches done, so it trains on the uninterrupted run's batches."""

    epoch: int = 0
    batch: int = 0
    rng: dict | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "rng": copy.deepcopy(self.rng)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch, self.rng = int(state["epoch"]), int(state["batch"]), state["rng"]


@dataclass
class Checkpointing:
    """The RL trainer's checkpoints (:mod:`arpo.trainer.checkpoint`) for SFT: every ``save_freq`` steps (0: only
    at the end) under ``manager.root``; ``resume_from`` a step directory to continue from."""

    manager: Any
    save_freq: int = 0
    resume_from: Path | None = None


def train_sft(group, examples: list | DemonstrationStream, *, epochs: int, batch_size: int, seed: int, pad_id: int,
              max_minutes: float | None = None, max_steps: int = 0, share_prompt_prefix: bool = True,
              num_examples: int | None = None, checkpointing: Checkpointing | None = None) -> dict[str, Any]:
    """Train the model of ``group`` (a worker group of :class:`~arpo.trainer.sft_step.SFTWorker` ranks, whose
    optimizer and schedule span :func:`plan_steps`) on ``examples``; returns summary stats, the loss of every
    step included. Each global batch goes to :meth:`~arpo.trainer.worker_group.WorkerGroup.sft_step`.

    ``max_minutes``: an opt-in wall-clock stop (None: off). It makes the result depend on the machine's speed, so
    when it triggers the summary says so (``stopped_early``, ``stop_reason``) and the caller reports it.

    ``examples``: a list, or a :class:`DemonstrationStream` whose first epoch trains on the demonstrations as they
    arrive (``num_examples``, the rows it will yield at most, plans the schedule); later epochs shuffle them all.
    The common prompt prefix is run once per batch (``share_prompt_prefix``)."""
    from arpo.trainer.checkpoint import load_checkpoint, save_checkpoint

    streaming = isinstance(examples, DemonstrationStream)
    n_examples = (num_examples or 0) if streaming else len(examples)
    steps_per_epoch, total = plan_steps(n_examples, batch_size, epochs, max_steps)
    rng = np.random.default_rng(seed)
    position, losses, prefixes, seconds_before = DataPosition(), [], [], 0.0
    ckpt = checkpointing
    if ckpt is not None and ckpt.resume_from is not None:
        state = load_checkpoint(ckpt.resume_from, group, dataloader=position)
        if state.get("planned_steps") != total:
            raise ValueError(f"{ckpt.resume_from} belongs to an SFT run of {state.get('planned_steps')} steps, this "
                             f"one plans {total}: resume with the same sft.epochs, sft.max_steps, sft.batch_size and "
                             f"data, or start afresh (sft.resume_mode=disable)")
        losses, prefixes, seconds_before = list(state["losses"]), list(state["prefixes"]), float(state["seconds"])
        rng.bit_generator.state = position.rng
    compute_dtype = str(group.init_info[0]["dtype"]).removeprefix("torch.")
    logger.info("sft: %d examples%s, %d steps on %d rank(s), computing in %s", n_examples,
                " (streamed while built)" if streaming else "", total, group.world_size, compute_dtype)
    start = time.time() - seconds_before
    step, saved = len(losses), len(losses) if ckpt is not None and ckpt.resume_from is not None else -1
    bar = tqdm(total=total, initial=step, desc="sft", unit="step")
    stopped_early = False
    epoch, skip = position.epoch, position.batch

    def save() -> None:
        nonlocal saved
        save_checkpoint(ckpt.manager, step, group, dataloader=position,
                        trainer_state={"losses": losses, "prefixes": prefixes, "seconds": time.time() - start,
                                       "planned_steps": total})
        saved = step

    while step < total and not stopped_early:
        epoch_rng = copy.deepcopy(rng.bit_generator.state)
        if streaming and epoch == 0:
            batches = streamed_batches(examples, batch_size, rng, pad_id, share_prompt_prefix)
        else:
            if streaming and not examples.done:
                examples.collect()  # resumed after the streamed epoch: build the demonstrations first
            batches = shuffled_batches(examples.examples if streaming else examples, batch_size, rng, pad_id,
                                       share_prompt_prefix)
        epoch_steps = 0
        for input_ids, attn, labels, prefix in batches:
            epoch_steps += 1
            if epoch_steps <= skip:  # trained before the resume: the same batch, drawn again
                continue
            out = group.sft_step(input_ids, attn, labels, prefix)
            step += 1
            losses.append(out["loss"])
            prefixes.append(prefix)
            position = DataPosition(epoch, epoch_steps, epoch_rng)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", lr=f"{out['lr']:.2e}")
            if step % 100 == 0:
                logger.info("sft step %d/%d loss %.3f lr %.2e %.3f s/step", step, total, np.mean(losses[-20:]),
                            out["lr"], (time.time() - start) / step)
            if step >= total:
                break
            if ckpt is not None and ckpt.save_freq and step % ckpt.save_freq == 0:
                save()
            if max_minutes is not None and (time.time() - start) / 60 > max_minutes:
                stopped_early = True
                logger.warning("sft stopped at its time limit (sft.max_minutes=%s) after %d/%d steps; the model "
                               "depends on this machine's speed", max_minutes, step, total)
                break
        if hasattr(batches, "close"):
            batches.close()  # a stream left early stops its tool calls
        skip = 0
        if epoch_steps == 0:
            if epoch == 0:
                raise ValueError("no SFT batch: fewer demonstrations fit sft.max_length than sft.batch_size; raise it")
            break
        epoch += 1
    bar.close()
    if ckpt is not None and saved != step:
        save()
    return {"steps": step, "planned_steps": total, "epochs": round(step / max(1, steps_per_epoch), 2),
            "final_loss": float(np.mean(losses[-20:])) if losses else float("nan"),
            "seconds": time.time() - start, "stopped_early": stopped_early,
            "stop_reason": (f"sft.max_minutes={max_minutes:g} (wall clock) after {step} of {total} steps"
                            if stopped_early else None),
            "mean_shared_prefix": float(np.mean(prefixes)) if prefixes else 0.0,
            "compute_dtype": compute_dtype,
            "losses": [round(x, 6) for x in losses]}


def worker_config(s: Mapping[str, Any], model_path: Path | str, total_steps: int,
                  chat_template: Any = None) -> dict:
    """The root config the SFT ranks read (:class:`~arpo.trainer.worker_config.WorkerConfig`, ``sft.*``) from the
    ``sft`` section ``s``: the model, ``sft.device`` / ``sft.dtype`` / ``sft.num_ranks`` under the trainer's keys,
    the planned steps; ``chat_template`` (``actor_rollout_ref.model.custom_chat_template``) goes with the export."""
    ranks, threads = int(s["num_ranks"]), max(1, int(s["num_threads"]))
    # one forward per micro-batch, as the single-process SFT ran: no tree packing
    model = {"path": str(model_path), "dtype": s["dtype"], "custom_chat_template": chat_template,
             "enable_gradient_checkpointing": bool(s.get("enable_gradient_checkpointing", False)),
             "tree_packing": False, "share_prefix": False}
    return {"actor_rollout_ref": {"model": model,
                                  "actor": {"checkpoint": {"save_contents": ["model", "optimizer", "extra"]}}},
            "trainer": {"device": s["device"], "nnodes": 1, "n_gpus_per_node": ranks, "cpus_per_worker": threads,
                        "total_training_steps": int(total_steps), "seed": int(s["seed"])},
            "sft": {**{k: float(s[k]) for k in ("lr", "weight_decay", "warmup_ratio", "grad_clip")},
                    "micro_batch_size_per_gpu": s.get("micro_batch_size_per_gpu")},
            "ray_init": {"num_cpus": max(os.cpu_count() or 1, ranks * threads)}}


def validate_sft_config(s) -> None:
    """The ``sft.*`` keys a run reads before any work; raise ConfigError naming the key and the fix."""
    from arpo.config import ConfigError
    from arpo.trainer.device import resolve_device_type

    if s.dtype not in ("float32", "bfloat16", "fast"):
        raise ConfigError(f"sft.dtype={s.dtype!r} is not valid; choose float32, bfloat16 or fast")
    if s.max_minutes is not None and not (isinstance(s.max_minutes, (int, float)) and s.max_minutes > 0):
        raise ConfigError(f"sft.max_minutes={s.max_minutes!r} is not valid; use null (no time limit) or minutes > 0")
    if not isinstance(s.num_ranks, int) or isinstance(s.num_ranks, bool) or s.num_ranks < 1:
        raise ConfigError(f"sft.num_ranks={s.num_ranks!r} is not valid; use an integer >= 1")
    if s.batch_size % s.num_ranks:
        raise ConfigError(f"sft.batch_size={s.batch_size} does not split over sft.num_ranks={s.num_ranks}; make it "
                          f"a multiple")
    micro = s.micro_batch_size_per_gpu
    if micro is not None and (not isinstance(micro, int) or isinstance(micro, bool) or micro < 1):
        raise ConfigError(f"sft.micro_batch_size_per_gpu={micro!r} is not valid; use null (a rank's whole share of "
                          f"the batch in one forward) or rows >= 1")
    if not isinstance(s.save_freq, int) or isinstance(s.save_freq, bool) or s.save_freq < 0:
        raise ConfigError(f"sft.save_freq={s.save_freq!r} is not valid; use 0 (only at the end) or steps > 0")
    for key in ("skip_tool_prob", "wrong_tool_prob", "wrong_pick_prob"):
        p = s.demo[key]
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise ConfigError(f"sft.demo.{key}={p!r} is not valid; use a probability in [0, 1]")
    if s.resume_mode not in ("auto", "disable"):
        raise ConfigError(f"sft.resume_mode={s.resume_mode!r} is not valid; choose auto or disable")
    try:
        resolve_device_type(s.device)
    except ValueError as e:
        raise ConfigError(str(e).replace("trainer.device", "sft.device")) from None


def run_sft(cfg) -> Path:
    """Build the examples, train on ``sft.num_ranks`` ranks, save an HF checkpoint to ``sft.out_dir``; return its
    path. Resumes from the newest checkpoint under ``sft.default_local_dir`` (``sft.resume_mode: auto``)."""
    from arpo.chat_templates import configured_template, tokenizer_for
    from arpo.config import require_path
    from arpo.data.sft_dataset import CallTargets, detect_format, iter_trajectory_examples, load_trajectories
    from arpo.runtime.seeding import seed_everything
    from arpo.trainer.checkpoint import CheckpointManager
    from arpo.trainer.worker_group import LocalWorkerGroup, RayWorkerGroup
    from tools.registry import load_tools

    s = cfg.sft
    validate_sft_config(s)
    configured_template(cfg)  # a bad value stops before any work
    seed_everything(s.seed)
    model_path = require_path(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path",
                              "build the tiny model with `python -m arpo.models.tiny` or point it at an HF checkpoint",
                              kind="model directory")
    from arpo.plan.stages import check_stage
    from arpo.trainer.device import resolve_device_type

    check_stage("sft", cfg, resolve_device_type(s.device))  # a stage that cannot fit stops before any model loads
    train_file = require_path(s.train_file, "sft.train_file",
                              "generate it with `python -m arpo.data.synthetic`, or give a trajectory file "
                              "(messages / ShareGPT JSONL, JSON or parquet: docs/extending.md)")
    data_format = detect_format(train_file, s.data_format)
    trajectories = None
    if data_format != "synthetic":  # recorded trajectories carry their tool results: no tool is started
        trajectories = load_trajectories(train_file, data_format, CallTargets.from_tools(cfg.tools), s.max_samples)
    torch.set_num_threads(max(1, int(s.num_threads)))
    tokenizer = tokenizer_for(cfg)  # the export saves it, so RL renders prompts with the same template
    if trajectories is None:
        tools = load_tools(cfg.tools)
        df = pd.read_parquet(train_file)
        if s.max_samples and len(df) > s.max_samples:
            df = df.iloc[: s.max_samples]
        demos = iter_demonstrations(df, tokenizer, tools, s.seed, s.demo.skip_tool_prob, s.demo.wrong_tool_prob,
                                    s.tool_workers, s.demo.verbose_think, s.demo.wrong_pick_prob)
        stream, n_rows = DemonstrationStream(demos, s.max_length), len(df)
    else:
        tools = {}
        demos = iter_trajectory_examples(trajectories, tokenizer)
        stream, n_rows = DemonstrationStream(demos, s.max_length, kinds=(data_format,)), len(trajectories)
    manager = CheckpointManager(s.default_local_dir, max_to_keep=s.max_ckpt_to_keep)
    group = None
    try:
        examples: list | DemonstrationStream = stream
        if not s.stream_demos:
            examples = stream.collect()
            if not examples:
                raise ValueError(f"no SFT example fits sft.max_length={s.max_length}; raise it")
        n_examples = n_rows if s.stream_demos else len(examples)
        _, total = plan_steps(n_examples, s.batch_size, s.epochs, s.max_steps)
        wcfg = worker_config(s, model_path, total, cfg.actor_rollout_ref.model.get("custom_chat_template"))
        group = LocalWorkerGroup(wcfg, role="sft") if s.num_ranks == 1 else RayWorkerGroup(wcfg, role="sft")
        checkpointing = Checkpointing(manager, s.save_freq, manager.resolve_resume(s.resume_mode))
        summary = train_sft(group, examples, epochs=s.epochs, batch_size=s.batch_size, seed=s.seed,
                            max_minutes=s.max_minutes, pad_id=tokenizer.pad_token_id, max_steps=s.max_steps,
                            share_prompt_prefix=s.share_prompt_prefix, num_examples=n_rows,
                            checkpointing=checkpointing)
        out = Path(s.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        group.export_hf(str(out))
    finally:
        demos.close()
        for tool in tools.values():
            tool.close()
        if group is not None:
            group.shutdown()
    tokenizer.save_pretrained(str(out))
    (out / "sft_summary.json").write_text(json.dumps({**summary, "demos": stream.modes,
                                                             "demo_seconds": stream.seconds}, indent=2))
    logger.info("sft done: %s -> %s", {k: v for k, v in summary.items() if k != "losses"}, out)
    return out


def main() -> None:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import load_config
    from arpo.runtime.logging_utils import setup_logging

    exit_if_help("sft", "python -m arpo.sft", __doc__)
    cfg = load_config("sft")
    setup_logging(cfg.sft.out_dir)
    path = run_sft(cfg)
    print(f"sft checkpoint saved to {path}")


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
