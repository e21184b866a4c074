"""ARPO training entry point (verl's ``main_ppo``): ``python -m arpo.main_arpo [key=value ...]``.

Builds every part from ``configs/arpo_trainer.yaml`` — tokenizer, datasets, tools, the generation engine (its own
Ray actor), the rollout (``actor_rollout_ref.rollout.mode``: ``arpo`` | ``single`` | ``agent_loop``), FSDP2
actor/ref worker groups, the reward manager, the tracker and the checkpoint manager — validates the config at
start-up, then runs :class:`arpo.trainer.ray_trainer.RayARPOTrainer`.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from arpo.config import ConfigError, require_path

logger = logging.getLogger(__name__)

ROLLOUT_MODES = ("arpo", "single", "agent_loop")


def validate_config(cfg: DictConfig) -> None:
    """Every cross-key rule, checked before anything starts; each failure is one line naming keys and fix."""
    from arpo.chat_templates import configured_template
    from arpo.engine.config import EngineConfig
    from arpo.engine.lora_serving import resolve_lora_serving_in_cfg
    from arpo.rollout.config import ARPORolloutConfig
    from arpo.trainer.actor_config import (rollout_temperature, validate_actor_config, validate_critic_config,
                                           validate_validation_config)
    from arpo.trainer.algo_config import validate_algorithm_config
    from reward_fns.overlong import OverlongBuffer

    r = cfg.actor_rollout_ref.rollout
    if r.mode not in ROLLOUT_MODES:
        raise ConfigError(f"actor_rollout_ref.rollout.mode={r.mode!r}: choose one of {list(ROLLOUT_MODES)}")
    if r.arpo.mode != "arpo" and r.arpo.mode != r.mode:  # training takes the generator's mode from rollout.mode
        raise ConfigError(f"actor_rollout_ref.rollout.arpo.mode={r.arpo.mode!r} is ignored in training (the "
                          f"rollout follows actor_rollout_ref.rollout.mode={r.mode!r}): set "
                          f"actor_rollout_ref.rollout.mode={r.arpo.mode} instead")
    if not isinstance(r.calculate_log_probs, bool):
        raise ConfigError(f"actor_rollout_ref.rollout.calculate_log_probs must be true or false, got "
                          f"{r.calculate_log_probs!r}")
    if r.arpo.calculate_log_probs and not r.calculate_log_probs:
        raise ConfigError("actor_rollout_ref.rollout.arpo.calculate_log_probs is ignored in training: set "
                          "actor_rollout_ref.rollout.calculate_log_probs=true instead")
    temperature = rollout_temperature(cfg)
    if r.calculate_log_probs and temperature != 1.0 and r.logprobs_mode != "processed_logprobs":
        raise ConfigError(f"actor_rollout_ref.rollout.calculate_log_probs=true at temperature {temperature}: "
                          f"raw log-probs are of the temperature-1 distribution, the trainer's of logits / "
                          f"temperature; set actor_rollout_ref.rollout.logprobs_mode=processed_logprobs")
    require_path(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path",
                 "run `python -m arpo.pipeline` (builds the tiny SFT model) or point it at an HF checkpoint",
                 kind="model directory")
    for key in ("train_files", "val_files"):
        files = cfg.data[key]
        for f in ([files] if isinstance(files, str) else list(files or [])):
            require_path(f, f"data.{key}", "generate the data with `python -m arpo.data.synthetic` or point it at "
                                           "verl-format parquet or prompt/answer JSONL files", kind="file")
    try:
        configured_template(cfg)
        resolve_lora_serving_in_cfg(cfg)  # once: the engines, the trainer and the memory plan read the decision
        EngineConfig.from_cfg(cfg)
        arpo_cfg = ARPORolloutConfig.from_dict(r.arpo)
        validate_algorithm_config(cfg)
        validate_actor_config(cfg)
        validate_critic_config(cfg)
        validate_validation_config(cfg)
        if r.mode == "agent_loop":
            agent_loop_config(cfg)
        OverlongBuffer.from_config(cfg.reward.get("overlong_buffer"), cfg.data.max_response_length)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if r.name == "vllm" and not r.ray_actor:
        # vLLM's AsyncLLM answers only on the event loop it first served (the rollout's); the weight push and its
        # probe run on another, so they would wait for ever (measured: begin_weight_update never returned). An
        # engine actor has one loop of its own for every call. Evaluation may keep an in-process engine.
        raise ConfigError("actor_rollout_ref.rollout.ray_actor=false with actor_rollout_ref.rollout.name=vllm: the "
                          "trainer's weight push cannot reach a vLLM engine bound to the rollout's event loop in "
                          "this process (it would hang); set actor_rollout_ref.rollout.ray_actor=true")
    # one value per setting: the tree rollout reads verl's keys through interpolations (configs/arpo_trainer.yaml)
    s = arpo_cfg.sampling
    for mine, theirs, verl in ((arpo_cfg.n, r.n, "n"), (s.temperature, r.temperature, "temperature"),
                               (s.top_p, r.top_p, "top_p"), (s.top_k, r.top_k, "top_k")):
        if mine != theirs:
            where = "n" if verl == "n" else f"sampling.{verl}"
            raise ConfigError(f"actor_rollout_ref.rollout.arpo.{where}={mine} differs from actor_rollout_ref.rollout."
                              f"{verl}={theirs}: one setting, one value; set only actor_rollout_ref.rollout.{verl}")
    if cfg.ray_init.address is None and cfg.ray_init.num_cpus is not None:
        require_cpus(cfg, cfg.ray_init.num_cpus, "ray_init.num_cpus gives",
                     "raise ray_init.num_cpus (logical CPUs may exceed the cores) or lower the others")
    if not isinstance(cfg.actor_rollout_ref.hybrid_engine, bool):
        raise ConfigError(f"actor_rollout_ref.hybrid_engine={cfg.actor_rollout_ref.hybrid_engine!r}: use true (the "
                          f"engine shares the training GPUs) or false (GPUs of its own)")
    if cfg.ray_init.address is None and cfg.trainer.nnodes > 1:
        raise ConfigError(f"trainer.nnodes={cfg.trainer.nnodes} needs a Ray cluster of that many nodes, and a run "
                          f"without ray_init.address starts a private one-node cluster: start one (ray start "
                          f"--head, then ray start --address=... on the others) and set ray_init.address")
    if arpo_cfg.sampling.max_response_length > cfg.data.max_response_length:
        raise ConfigError(f"actor_rollout_ref.rollout.arpo.sampling.max_response_length="
                          f"{arpo_cfg.sampling.max_response_length} exceeds "
                          f"data.max_response_length={cfg.data.max_response_length}")
    from arpo.plan import check_config as check_memory_plan

    check_memory_plan(cfg)  # last: the memory plan reads a config every other rule has passed (arpo/plan/)


def worker_groups(cfg: DictConfig) -> list[str]:
    """The FSDP2 worker groups the config needs: the actor, the reference (a KL term without LoRA), the critic
    (GAE)."""
    from arpo.trainer.actor_config import needs_reference, uses_critic

    return ["actor"] + ["ref"] * needs_reference(cfg) + ["critic"] * uses_critic(cfg)


def ray_cpus_needed(cfg: DictConfig) -> float:
    from arpo.engine.config import default_device
    from arpo.runtime.placement import planned_num_replicas

    groups = len(worker_groups(cfg))
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    # before Ray starts (num_replicas still null), a private cluster's GPUs are ray_init.num_gpus or the local ones
    gpus = cfg.trainer.device != "cpu" and bool(cfg.ray_init.num_gpus if cfg.ray_init.num_gpus is not None
                                                else default_device() == "cuda")
    return groups * ranks * float(cfg.trainer.cpus_per_worker) + planned_num_replicas(cfg, gpus)


def require_cpus(cfg: DictConfig, have: float, where: str, fix: str) -> None:
    """Ray would wait forever for an actor it cannot place: ``have`` CPUs (``where`` names them) must hold what the
    actors ask for, else one config error."""
    needed = ray_cpus_needed(cfg)
    if needed > have:
        raise ConfigError(f"{where} {have:g} CPUs, fewer than the {needed:g} the actors ask for (trainer.nnodes x "
                          f"trainer.n_gpus_per_node x trainer.cpus_per_worker per worker group, "
                          f"{' + '.join(worker_groups(cfg))}, + 1 per engine replica): {fix}")


def check_cluster_fits(cfg: DictConfig) -> None:
    """A joined cluster (``ray_init.address``) must hold the actors; a private one is sized by ``ray_init.num_cpus``
    (validate_config)."""
    import ray

    if cfg.ray_init.address is not None:
        try:
            training_nodes(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        require_cpus(cfg, ray.cluster_resources().get("CPU", 0.0),
                     f"the Ray cluster at ray_init.address={cfg.ray_init.address} has",
                     "add nodes to the cluster or lower those keys")


def build_trainer(cfg: DictConfig):
    from arpo.chat_templates import tokenizer_for
    from arpo.data.rl_dataset import create_rl_dataloaders
    from arpo.engine.factory import create_engines
    from arpo.runtime.placement import resolve_rollout_auto
    from arpo.runtime.ray_utils import init_ray
    from arpo.runtime.tracking import Tracking
    from arpo.trainer.ray_trainer import RayARPOTrainer, TrainerCheckpointer
    from arpo.trainer.worker_group import RayWorkerGroup
    from reward_fns.manager import RewardManager
    from tools.registry import load_tools

    t = cfg.trainer
    tokenizer = tokenizer_for(cfg)
    tools = load_tools(cfg.tools)
    # A model that calls tools in the hermes format reads their schemas from the prompt's tools block.
    hermes = cfg.actor_rollout_ref.rollout.arpo.tools.format == "hermes"
    try:
        train_loader, val_loader = create_rl_dataloaders(cfg, tokenizer, tools.schemas() if hermes else None)
    except BaseException:
        tools.close()  # a bad data file stops the run here: its sandbox workers must not outlive it
        raise
    init_ray(cfg)
    resolve_rollout_auto(cfg, uses_gpu_placement(cfg))  # num_replicas, free_cache_engine: null -> by placement
    check_cluster_fits(cfg)
    engines, groups = _start_engine_and_workers(cfg, create_engines, RayWorkerGroup)
    if len(engines) > 1:
        logger.info("%d engine replicas on Ray nodes %s", len(engines), [getattr(e, "node_id", None) for e in engines])
    rollout = build_rollout(cfg, engines, tokenizer, tools)
    reward_manager = RewardManager.from_config(cfg)
    tracker = Tracking(t.project_name, t.experiment_name, list(t.logger), Path(t.output_dir) / "logs",
                       config=OmegaConf.to_container(cfg, resolve=True), wandb_mode=t.wandb_mode)
    checkpointer = TrainerCheckpointer(t.default_local_dir, t.resume_mode, t.resume_from_path,
                                       t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep)
    trainer = RayARPOTrainer(cfg, tokenizer, train_loader, val_loader, rollout, groups["actor"], groups.get("ref"),
                             engines, reward_manager, tracker, checkpointer, critic_wg=groups.get("critic"))
    return trainer


def _start_engine_and_workers(cfg: DictConfig, create_engines, worker_group) -> tuple[list[Any], dict[str, Any]]:
    """The rollout engine's replicas and the worker groups by role (:func:`worker_groups`), on a cluster with GPUs
    in the placement groups of :mod:`arpo.runtime.placement` (colocated or split). On CPU their start-ups (process spawns,
    imports, model loads; ~10 s each here) run at once. On a GPU they start one after another, as in verl: vLLM
    sizes its KV cache from the memory free while it profiles, which ranks loading beside it would change."""
    from arpo.engine.config import default_device

    roles = worker_groups(cfg)
    placement = gpu_placement(cfg, roles) if uses_gpu_placement(cfg) else None
    device = cfg.trainer.device
    if device == "cuda" or (device == "auto" and placement is not None and default_device() == "cuda"):
        engines = create_engines(cfg, placement=placement)
        return engines, {role: worker_group(cfg, role=role, placement=placement) for role in roles}
    with ThreadPoolExecutor(1 + len(roles), thread_name_prefix="start-up") as pool:
        engines = pool.submit(create_engines, cfg, placement=placement)
        groups = {role: pool.submit(worker_group, cfg, role=role, placement=placement) for role in roles}
        return engines.result(), {role: g.result() for role, g in groups.items()}


def uses_gpu_placement(cfg: DictConfig) -> bool:
    """Whether the run's actors go into GPU placement groups: the cluster has GPUs and trainer.device is not cpu."""
    import ray

    return cfg.trainer.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0


def training_nodes(cfg: DictConfig) -> list[str] | None:
    """The nodes of the training ranks (:func:`arpo.runtime.ray_utils.rank_nodes`; ValueError when the cluster lacks them).
    With GPU placement a node's bundle holds rank r of every role (their CPUs together, one GPU); else each
    role's ranks are pinned on their own."""
    from arpo.runtime.ray_utils import rank_nodes

    t = cfg.trainer
    if uses_gpu_placement(cfg):
        return rank_nodes(t.nnodes, t.n_gpus_per_node, float(t.cpus_per_worker) * len(worker_groups(cfg)), 1.0)
    return rank_nodes(t.nnodes, t.n_gpus_per_node, float(t.cpus_per_worker), 0.0)


def gpu_placement(cfg: DictConfig, roles: list[str]):
    """The run's placement groups on a cluster with GPUs (one clear error when it cannot hold them)."""
    from arpo.runtime.placement import GpuPlacement, PlacementPlan

    try:
        return GpuPlacement(PlacementPlan.from_config(cfg, roles), training_nodes(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_rollout(cfg: DictConfig, engines: list[Any], tokenizer: Any, tools: Any):
    r = cfg.actor_rollout_ref.rollout
    if r.mode in ("arpo", "single"):
        from arpo.rollout.arpo_rollout import ARPORollout

        arpo_cfg = dict(OmegaConf.to_container(r.arpo, resolve=True))
        arpo_cfg["mode"] = r.mode
        arpo_cfg["calculate_log_probs"] = bool(r.calculate_log_probs)
        # the prompts' chat-template arguments, so a hermes tool message ends in the prompts' generation prompt
        kwargs = cfg.data.get("apply_chat_template_kwargs")
        return ARPORollout(engines, tokenizer, arpo_cfg, tools,
                           chat_template_kwargs=OmegaConf.to_container(kwargs, resolve=True) if kwargs else None)
    from arpo.agent_loop.manager import AgentLoopManager

    return AgentLoopManager(engines, tokenizer, agent_loop_config(cfg), tools=list(tools.values()),
                            calculate_log_probs=bool(r.calculate_log_probs))


def agent_loop_config(cfg: DictConfig):
    """The agent loops' config from verl's places: ``actor_rollout_ref.rollout.{agent,multi_turn}``,
    ``data.max_response_length`` and ``data.apply_chat_template_kwargs``."""
    from arpo.agent_loop.manager import AgentLoopConfig

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True)

    r = cfg.actor_rollout_ref.rollout
    try:
        return AgentLoopConfig.load({**plain(r.agent), "multi_turn": plain(r.multi_turn),
                                     "response_length": int(cfg.data.max_response_length),
                                     "chat_template_kwargs": plain(cfg.data.apply_chat_template_kwargs)})
    except ValueError as e:  # name the full key: the loader knows its sections only
        msg = str(e)
        if msg.startswith("multi_turn."):
            raise ValueError(f"actor_rollout_ref.rollout.{msg}") from None
        sep = "." if msg.split("=")[0].isidentifier() else ": "
        raise ValueError(f"actor_rollout_ref.rollout.agent{sep}{msg}") from None


def announce(cfg: DictConfig) -> None:
    """Save the resolved config as ``<output_dir>/config.yaml`` and log the run's header: what is trained on what,
    and every key that differs from ``configs/arpo_trainer.yaml``."""
    from arpo.config import load_config
    from arpo.runtime.console import config_diff, run_header

    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    r, t = cfg.actor_rollout_ref.rollout, cfg.trainer
    fields = {
        "model": cfg.actor_rollout_ref.model.path,
        "train data": cfg.data.train_files, "val data": cfg.data.val_files,
        "rollout": f"{r.mode}, n={r.n} per prompt, {cfg.data.train_batch_size} prompts per step",
        "advantage": f"{cfg.algorithm.adv_estimator}, {cfg.algorithm.advantage_mode}",
        "steps": t.total_training_steps or f"{t.total_epochs} epoch(s)",
        "output": f"{out} (config.yaml, logs/arpo.log, logs/metrics.jsonl)",
    }
    diff = config_diff(cfg, load_config("arpo_trainer", []))
    logger.info(run_header("ARPO training", fields, {"keys that differ from configs/arpo_trainer.yaml": diff},
                           more_at=out / "config.yaml"))


def run(cfg: DictConfig) -> dict[str, Any]:
    from arpo.runtime.seeding import seed_everything

    validate_config(cfg)
    announce(cfg)
    seed_everything(cfg.trainer.seed)
    trainer = build_trainer(cfg)
    try:
        final_val = trainer.fit()
        export_dir = Path(cfg.trainer.output_dir) / "hf_model"
        trainer.actor_wg.export_hf(str(export_dir))
    finally:
        trainer.close()
        # The engine actor's vLLM engine core is its child process, which Ray's shutdown does not reach: stopped
        # here, or it outlives the run (seen as orphaned VLLM::EngineCore processes after ablation runs).
        for engine in trainer.engines:
            if hasattr(engine, "kill"):
                engine.kill()
    out = Path(cfg.trainer.output_dir)
    gain = validation_gain(cfg.trainer.validation_data_dir, trainer.global_step)
    plots = write_plots(out, cfg.trainer.rollout_data_dir)
    summary = {"final_validation": final_val, "validation_gain": gain, "hf_model": str(export_dir), "plots": plots,
               "checkpoints": str(cfg.trainer.default_local_dir),
               "metrics": str(trainer.tracker.jsonl_path), "log": str(out / "logs" / "arpo.log"),
               "machine": run_machine(cfg, trainer.actor_wg.init_info[0])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_machine(cfg: DictConfig, rank_info: dict) -> dict[str, Any]:
    """:func:`arpo.runtime.machine.machine_info` with the trainer's resolved dtype and a training rank's thread count."""
    from arpo.runtime.machine import machine_info
    from arpo.trainer.device import device_settings_from_config

    info = machine_info()
    info["dtypes"] = {"trainer": str(device_settings_from_config(cfg).compute_dtype).removeprefix("torch.")}
    info["trainer_rank_threads"] = rank_info.get("torch_threads")
    return info


def write_plots(run_dir: Path, rollout_dir: str | None) -> str | None:
    """``<run_dir>/plots/*.png`` (arpo.analysis.write_run_plots); a plotting failure costs the plots, not the run."""
    from arpo.analysis import write_run_plots

    try:
        written = write_run_plots(run_dir, rollout_dir)
    except Exception:  # noqa: BLE001 - the trained model and metrics are already saved
        logger.exception("writing the run's plots failed; metrics are in %s", run_dir / "logs" / "metrics.jsonl")
        return None
    logger.info("plots: %s", ", ".join(str(p) for p in written))
    return str(run_dir / "plots") if written else None


def validation_records(path: Path) -> dict[int, list[dict]]:
    """One validation dump (``step_<N>.jsonl``) grouped by prompt: a prompt's samples under its index."""
    by_prompt: dict[int, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        by_prompt.setdefault(rec["prompt_index"], []).append(rec)
    return by_prompt


def validation_gain(folder: str | None, last_step: int, confidence: float = 0.95) -> dict[str, Any] | None:
    """Before (step 0) vs after (``last_step``) validation, paired by prompt: mean accuracy and reward with a
    bootstrap confidence interval of the gain. None when either validation is missing."""
    import numpy as np

    from arpo.evaluation.stats import paired_gain

    if not folder or last_step == 0:
        return None
    files = [Path(folder) / f"step_{s}.jsonl" for s in (0, last_step)]
    if not all(f.is_file() for f in files):
        return None
    per_prompt = [validation_records(f) for f in files]
    common = sorted(set(per_prompt[0]) & set(per_prompt[1]))
    out: dict[str, Any] = {"before_step": 0, "after_step": last_step}
    for key in ("acc", "score"):
        before, after = ([float(np.mean([r[key] for r in p[i]])) for i in common] for p in per_prompt)
        out[key] = paired_gain(before, after, confidence=confidence).as_dict()
    return out


def describe_gain(gain: dict[str, Any]) -> str:
    """One line: validation accuracy and reward before → after RL, with the gain's interval."""
    from arpo.evaluation.stats import GainInterval

    fields = GainInterval.__dataclass_fields__
    parts = [GainInterval(**{k: v for k, v in gain[key].items() if k in fields}).describe(name)
             for key, name in (("acc", "accuracy"), ("score", "reward"))]
    return f"RL gain (step 0 -> {gain['after_step']}): " + "; ".join(parts)


def main() -> None:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import load_config
    from arpo.runtime.logging_utils import setup_logging

    from arpo.runtime.ray_utils import stop_ray

    exit_if_help("arpo_trainer", "python -m arpo.main_arpo", __doc__)
    cfg = load_config("arpo_trainer")
    setup_logging(Path(cfg.trainer.output_dir) / "logs")
    summary = run(cfg)
    stop_ray()
    print(json.dumps(summary, indent=2))
    if summary["validation_gain"]:
        print(describe_gain(summary["validation_gain"]))


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
