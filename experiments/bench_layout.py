"""What ``experiments/bench_trainer.py`` reports beside timings: the policy's trainable parameters (LoRA: the
adapters) and the micro-batches the update runs, with their padding (row batching vs ``use_dynamic_bsz``).

Nothing here loads weights or runs a forward: parameters are counted on the meta device, and the micro-batches are
cut as the ranks cut them (:func:`arpo.trainer.dynamic_batching.update_padding` on
:meth:`arpo.trainer.worker_group.WorkerGroup.update_shares`), so ``--layout-only`` gives the layout of a dtype the
machine cannot run fast (bf16's left-aligned micro-batches on a CPU without native bf16).
"""

from __future__ import annotations

from typing import Any


def policy_layout(group: Any, cfg: dict, batch: Any) -> dict:
    """The policy's parameters and trainable parameters, and the update's micro-batches on ``batch`` with their
    padding, for ``group``'s ranks."""
    from arpo.trainer.dynamic_batching import update_padding
    from arpo.trainer.fsdp_worker import ActorWorker
    from arpo.trainer.lora import apply_lora

    workers = [ActorWorker(cfg, "actor", r, group.world_size) for r in range(group.world_size)]
    model, m = workers[0].empty_model(), workers[0].cfg.model
    if workers[0].uses_lora:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
    return {"params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "update_micro_batches": update_padding(workers, group.update_shares(batch))}


def layout_only(cfg: dict, batch: Any) -> dict:
    """:func:`policy_layout` from a worker group without workers: the layout of ``cfg``'s dtype (bf16: fast,
    left-aligned rows dealt by length; float32: exact) on any machine."""
    from arpo.trainer.actor_config import world_size
    from arpo.trainer.device import device_settings_from_config
    from arpo.trainer.worker_config import WorkerConfig
    from arpo.trainer.worker_group import WorkerGroup

    settings, group = device_settings_from_config(cfg), WorkerGroup()
    group.cfg, group.role, group.world_size = WorkerConfig.from_config(cfg, "actor"), "actor", world_size(cfg)
    group.init_info = [{"device": settings.device_type, "fast_layout": settings.fast_layout}]
    return {"ranks": group.world_size, "dtype": str(settings.compute_dtype).removeprefix("torch."),
            **policy_layout(group, cfg, batch)}
