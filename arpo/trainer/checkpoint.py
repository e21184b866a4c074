"""Checkpoints that survive a SIGKILL at any instant, and resume exactly.

Layout under ``trainer.default_local_dir`` (verl's)::

    latest_checkpointed_iteration.txt     # "N", written last
    global_step_N/
        actor/                            # DCP shards of model + optimizer (any world size can load them),
            .metadata, __*_*.distcp       #   contents.json, extra_state_world_size_W_rank_R.pt (scheduler, RNG)
            huggingface/                  # optional full HF export (save_contents: hf_model)
                lora_adapter/             #   with LoRA: the adapter alone, peft's save_pretrained layout
        data.pt                           # dataloader position (epoch, batch index)
        trainer_state.pt                  # global step, driver RNG states, anything the trainer adds

Atomicity: everything is written into ``global_step_N.tmp``, every file and directory is fsynced, the
directory is renamed to ``global_step_N`` (atomic on POSIX), and only then is the tracker file replaced.
A crash leaves at worst a ``.tmp`` directory, which resume ignores and the next save removes. Resume picks
the highest complete ``global_step_N``. Sharded files are written by every rank into the same directory,
so multi-node training needs ``default_local_dir`` on a shared filesystem.

With LoRA (``actor_rollout_ref.model.lora_rank`` > 0) the model shards are the adapters only: the base is frozen,
so a resumed run reloads it from ``actor_rollout_ref.model.path`` (the worker's start-up) and takes the adapters,
their optimizer state, the scheduler and the RNG states from here; the next update is the uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from arpo.runtime.seeding import rng_state, set_rng_state
from arpo.trainer.lora import adapter_state, has_lora, save_worker_adapter

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "global_step_"
TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


# ----------------------------------------------------------------------------------------------------
# worker side: sharded model / optimizer / scheduler / RNG (collective over the ranks)
# ----------------------------------------------------------------------------------------------------

def _worker_rng_state() -> dict:
    state = rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_worker_rng_state(state: dict) -> None:
    set_rng_state(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_sharded(worker: Any, actor_dir: str | Path, contents: list[str]) -> None:
    """Save ``worker.model`` (+ optimizer, + ``extra``: scheduler and RNG, + ``hf_model``) into ``actor_dir``.
    Every rank calls it together."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(actor_dir)
    out.mkdir(parents=True, exist_ok=True)
    optimizers = [worker.optimizer] if worker.optimizer is not None and "optimizer" in contents else []
    model_sd, optim_sd = get_state_dict(worker.model, optimizers)
    adapters_only = has_lora(worker.model)
    if adapters_only:  # the frozen base is the model at actor_rollout_ref.model.path: no need to save it again
        model_sd = adapter_state(model_sd)
    state: dict[str, Any] = {"model": model_sd}
    if optimizers:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(out))
    if "extra" in contents:
        extra = {"rng": _worker_rng_state(),
                 "lr_scheduler": worker.lr_scheduler.state_dict() if worker.lr_scheduler is not None else None}
        torch.save(extra, out / f"extra_state_world_size_{worker.world_size}_rank_{worker.rank}.pt")
    if worker.rank == 0:
        (out / "contents.json").write_text(json.dumps({"contents": sorted(set(contents) | {"model"}),
                                                       "has_optimizer": bool(optimizers),
                                                       "world_size": worker.world_size,
                                                       "adapters_only": adapters_only,
                                                       "base_model": str(worker.cfg.model.path)}))
    if "hf_model" in contents:
        worker.export_hf(str(out / "huggingface"))
    dist.barrier()


def load_sharded(worker: Any, actor_dir: str | Path) -> None:
    """Load what :func:`save_sharded` wrote into ``worker`` (resharding to the current world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    src = Path(actor_dir)
    meta_file = src / "contents.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"{src} is not an actor checkpoint (no contents.json); point the resume at a "
                                f"complete global_step_N directory")
    meta = json.loads(meta_file.read_text())
    adapters_only = bool(meta.get("adapters_only", False))
    _check_lora_match(worker, src, meta)
    use_optim = meta.get("has_optimizer", False) and worker.optimizer is not None
    optimizers = [worker.optimizer] if use_optim else []
    model_sd, optim_sd = get_state_dict(worker.model, optimizers)
    if adapters_only:  # the base stays as the start-up loaded it from actor_rollout_ref.model.path
        model_sd = adapter_state(model_sd)
    state: dict[str, Any] = {"model": model_sd}
    if use_optim:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(src))
    options = StateDictOptions(strict=not adapters_only)
    if use_optim:
        set_state_dict(worker.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    else:
        set_model_state_dict(worker.model, state["model"], options=options)
        if worker.optimizer is not None:
            logger.warning("checkpoint %s has no optimizer state: the optimizer starts fresh", src)
    if "extra" in meta.get("contents", []):
        own = src / f"extra_state_world_size_{worker.world_size}_rank_{worker.rank}.pt"
        files = [own] if own.exists() else sorted(src.glob("extra_state_world_size_*_rank_0.pt"))
        if not own.exists():
            logger.warning("checkpoint %s was written by %s ranks, now %d: the scheduler is restored, per-rank "
                           "RNG states are not", src, meta.get("world_size"), worker.world_size)
        extra = torch.load(files[0], weights_only=False)
        if extra.get("lr_scheduler") is not None and worker.lr_scheduler is not None:
            worker.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if own.exists():
            _set_worker_rng_state(extra["rng"])


def _check_lora_match(worker: Any, src: Path, meta: dict) -> None:
    """An adapter-only checkpoint needs a LoRA worker (on the same base), a full one a worker without LoRA: the
    parameter names differ (a wrapped linear's weight is ``<name>.base_layer.weight``)."""
    if bool(meta.get("adapters_only")) != has_lora(worker.model):
        if meta.get("adapters_only"):
            raise ValueError(f"{src} holds LoRA adapters only (the run that wrote it had actor_rollout_ref.model."
                             f"lora_rank > 0): resume it with the same lora_rank, lora_alpha and target_modules")
        raise ValueError(f"{src} holds a full model written without LoRA: resume it with actor_rollout_ref.model."
                         f"lora_rank=0, or train adapters on it by exporting it (save_contents: hf_model) and "
                         f"pointing actor_rollout_ref.model.path at the export")
    saved_base = meta.get("base_model")
    if meta.get("adapters_only") and saved_base and saved_base != str(worker.cfg.model.path):
        logger.warning("%s: adapters trained on %s, loaded onto actor_rollout_ref.model.path=%s (the base must be the "
                       "same weights)", src, saved_base, worker.cfg.model.path)


def export_worker_hf(worker: Any, out_dir: str | Path) -> str | None:
    """The worker's model as an HF checkpoint in ``out_dir`` (:func:`export_hf_model`; with LoRA the merged model,
    plus the adapter alone in ``out_dir/lora_adapter`` for peft). Collective; rank 0 writes and returns the path."""
    from arpo.trainer.memory import release_memory

    state = None
    try:
        if has_lora(worker.model):  # collective: every rank gathers each adapter whole; rank 0 writes them
            save_worker_adapter(worker, Path(out_dir) / "lora_adapter")
        state = worker.state_dict_for_engine()
        if state is None:
            return None
        return str(export_hf_model(state, worker.model.config, worker.cfg.model.path, out_dir,
                                   worker.cfg.model.custom_chat_template))
    finally:
        state = None
        release_memory()


def export_hf_model(state: dict[str, torch.Tensor], config: Any, tokenizer_src: str | Path | None,
                    out_dir: str | Path, chat_template: Any = None) -> Path:
    """``save_pretrained`` of a full state dict under ``config`` plus the tokenizer and generation config
    from ``tokenizer_src`` (the original model directory), so transformers and vLLM load ``out_dir``. The
    tokenizer carries ``chat_template`` (``actor_rollout_ref.model.custom_chat_template``) when one is set: the
    export then prompts as training did."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from arpo.chat_templates import load_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A meta-device skeleton supplies config and naming; the weights come from ``state``, no second copy.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    skeleton.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    if tokenizer_src:
        load_tokenizer(tokenizer_src, chat_template).save_pretrained(str(out))
        try:
            GenerationConfig.from_pretrained(str(tokenizer_src)).save_pretrained(str(out))
        except OSError:
            pass  # the source has no generation_config.json
    return out


# ----------------------------------------------------------------------------------------------------
# driver side: atomic step directories, tracker, retention, resume
# ----------------------------------------------------------------------------------------------------

def _fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (children before parents)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def step_of(path: str | Path) -> int | None:
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


class CheckpointManager:
    """Step directories under ``root``: atomic commit, verl's tracker file, retention.

    Retention (verl's ``trainer.max_actor_ckpt_to_keep`` / ``max_critic_ckpt_to_keep``; None keeps all): after each
    commit, step directories beyond the newest ``max_to_keep`` are removed, and the critic shards (``critic/``) of
    those beyond the newest ``max_critic_to_keep``. Never removed: the step just written, the tracker's step and
    the newest complete step (:meth:`latest`, what ``resume_mode: auto`` reads). A resumed run that saves a step
    below an older run's newest (resumed from a path) thus keeps both.
    """

    def __init__(self, root: str | Path, max_to_keep: int | None = None, max_critic_to_keep: int | None = None):
        for key, value in (("max_actor_ckpt_to_keep", max_to_keep), ("max_critic_ckpt_to_keep", max_critic_to_keep)):
            if value is not None and value < 1:
                raise ValueError(f"trainer.{key} must be null (keep all) or >= 1, got {value}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.max_critic_to_keep = max_critic_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(s for p in self.root.iterdir() if p.is_dir() and (s := step_of(p)) is not None)

    def begin(self, step: int) -> Path:
        """A fresh ``global_step_N.tmp`` to write into; leftovers of interrupted saves are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"):
            logger.info("removing incomplete checkpoint %s (an earlier save was interrupted)", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"{STEP_PREFIX}{step}{TMP_SUFFIX}"
        tmp.mkdir()
        return tmp

    def commit(self, step: int) -> Path:
        """fsync the temporary directory, rename it into place, then update the tracker and prune."""
        tmp = self.root / f"{STEP_PREFIX}{step}{TMP_SUFFIX}"
        final = self.step_dir(step)
        fsync_tree(tmp)
        if final.exists():
            # Re-saving a step (a resumed run reaching it again): move the old one aside first, so a crash
            # in between still leaves one complete copy under a name resume reads or ignores.
            old = self.root / f"{STEP_PREFIX}{step}.old{TMP_SUFFIX}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_path(self.root)
        tracker_tmp = self.root / (TRACKER_FILE + TMP_SUFFIX)
        tracker_tmp.write_text(str(step))
        _fsync_path(tracker_tmp)
        tracker_tmp.replace(self.root / TRACKER_FILE)
        _fsync_path(self.root)
        self.prune(written=step)
        logger.info("checkpoint saved: %s", final)
        return final

    def prune(self, written: int | None = None) -> None:
        """Apply retention after step ``written`` was committed (see the class docstring)."""
        steps = self.complete_steps()
        protected = {written, self._tracked_step(), steps[-1] if steps else None}
        for limit, part, key in ((self.max_to_keep, None, "max_actor_ckpt_to_keep"),
                                 (self.max_critic_to_keep, "critic", "max_critic_ckpt_to_keep")):
            if limit is None:
                continue
            for step in steps[: max(0, len(steps) - limit)]:
                target = self.step_dir(step) / part if part else self.step_dir(step)
                if step in protected or not target.exists():
                    continue
                shutil.rmtree(target, ignore_errors=True)
                logger.info("removed old checkpoint %s (trainer.%s=%d)", target, key, limit)

    def _tracked_step(self) -> int | None:
        try:
            return int((self.root / TRACKER_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def latest(self) -> Path | None:
        """The newest complete step directory. Normally the tracker's; a higher complete directory wins
        (a crash after the rename but before the tracker write)."""
        steps = self.complete_steps()
        if not steps:
            return None
        tracker = self.root / TRACKER_FILE
        if tracker.exists():
            try:
                tracked = int(tracker.read_text().strip())
            except ValueError:
                tracked = None
            if tracked is not None and tracked != steps[-1]:
                logger.warning("%s says step %s but the newest complete checkpoint is step %d; using it",
                               tracker, tracked, steps[-1])
        return self.step_dir(steps[-1])

    def resolve_resume(self, resume_mode: str = "auto", resume_from_path: str | None = None) -> Path | None:
        """Where to resume from: ``auto`` (newest here, or None to start fresh), ``disable`` (None),
        ``resume_path`` (``resume_from_path``) or a ``global_step_N`` path given directly."""
        mode = str(resume_mode)
        if mode == "disable":
            return None
        if mode == "auto":
            return self.latest()
        path = Path(resume_from_path if mode == "resume_path" else mode)
        if path.name.endswith(TMP_SUFFIX) or not (path / "actor" / "contents.json").exists():
            raise ValueError(f"trainer.resume_mode: {path} is not a complete checkpoint (expected a "
                             f"global_step_N directory holding actor/contents.json)")
        return path


def save_checkpoint(manager: CheckpointManager, step: int, actor_group: Any, dataloader: Any = None,
                    trainer_state: dict | None = None, contents: list[str] | None = None,
                    critic_group: Any = None) -> Path:
    """Write step ``step`` atomically: actor shards (every rank), critic shards (``critic/``, PPO with a critic),
    dataloader position, driver RNG and ``trainer_state``. ``actor_group`` is anything whose
    ``save_checkpoint(dir, contents)`` runs on all ranks; ``contents`` None means the config's
    ``actor_rollout_ref.actor.checkpoint.save_contents``."""
    tmp = manager.begin(step)
    actor_group.save_checkpoint(str(tmp / "actor"), contents)
    if critic_group is not None:
        critic_group.save_checkpoint(str(tmp / "critic"))
    if dataloader is not None:
        torch.save(dataloader.state_dict(), tmp / "data.pt")
    torch.save({"global_step": step, "rng": rng_state(), **(trainer_state or {})}, tmp / "trainer_state.pt")
    return manager.commit(step)


def load_checkpoint(ckpt_dir: str | Path, actor_group: Any, dataloader: Any = None, critic_group: Any = None) -> dict:
    """Restore a :func:`save_checkpoint` directory; returns the trainer state (``global_step`` …) after
    restoring the driver's RNG states and the dataloader position."""
    ckpt = Path(ckpt_dir)
    actor_group.load_checkpoint(str(ckpt / "actor"))
    if critic_group is not None:
        if not (ckpt / "critic" / "contents.json").exists():
            raise FileNotFoundError(f"{ckpt} has no critic shards (critic/contents.json): it was written by a run "
                                    f"without a critic; resume it with the same algorithm.adv_estimator")
        critic_group.load_checkpoint(str(ckpt / "critic"))
    if dataloader is not None:
        data_file = ckpt / "data.pt"
        if not data_file.exists():
            raise FileNotFoundError(f"{data_file} missing: the checkpoint has no dataloader position")
        dataloader.load_state_dict(torch.load(data_file, weights_only=False))
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    set_rng_state(state["rng"])
    logger.info("resumed from %s (global step %d)", ckpt, state["global_step"])
    return state
