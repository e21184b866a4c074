"""LoRA adapters on the policy through peft (verl's ``actor_rollout_ref.model.lora_rank``, ``lora_alpha``,
``target_modules``), so a policy that would not fit a GPU with full AdamW state trains its adapters only.

The adapters are injected in place (``peft.inject_adapter_in_model``): the model stays the HF class, so FSDP2
shards it block by block as before, gradient checkpointing and the tree-attention forward are unchanged, and every
parameter that is not an adapter keeps its name. Every rank wraps its meta model and rank 0 its loaded copy the
same way before sharding (:meth:`arpo.trainer.fsdp_worker.ActorWorker.init_model`); rank 0's adapter initialisation
(A random from ``trainer.seed``, B zero, so the wrapped model starts as the base model) is broadcast with the
weights. Only the adapters require grad, and the optimizer holds only them.

A vLLM engine serving LoRA (``actor_rollout_ref.rollout.lora_serving: adapter``) gets the adapters alone after
each update (:func:`save_worker_adapter`, :mod:`arpo.engine.lora_serving`). Otherwise the engine gets merged weights
under the base model's names (:func:`lora_engine_tensors`): a wrapped linear's
``<name>.base_layer.weight`` is sent as ``<name>.weight`` = W + (alpha / r) B A, its bias as ``<name>.bias``; the
adapter matrices themselves are not sent, so the engine loads them as a plain checkpoint. The HF export
(``ActorWorker.export_hf``) writes the same merged model, and the adapter alone in peft's ``save_pretrained`` layout
in its ``lora_adapter/`` folder (:func:`save_adapter`).

A reference policy, when a KL term needs one, is the actor's own model with the adapters disabled
(:func:`adapters_disabled`): no reference worker group (``arpo.trainer.actor_config.reference_policy``). Checkpoints
hold the adapters only (:func:`adapter_state`); the frozen base comes from ``actor_rollout_ref.model.path`` at
start-up, as on the first run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BASE = ".base_layer."


def lora_config(rank: int, alpha: float, target_modules: str | list[str]) -> Any:
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=targets, lora_dropout=0.0, bias="none")


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: str | list[str],
               seed: int | None = None) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; ``seed`` fixes A's initialisation
    (rank 0's loaded copy; the other ranks' meta copies receive it)."""
    from peft import inject_adapter_in_model

    if seed is not None:
        torch.manual_seed(seed)
    model = inject_adapter_in_model(lora_config(rank, alpha, target_modules), model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return any(".lora_A." in n for n, _ in model.named_parameters())


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def adapter_state(state: dict[str, Any]) -> dict[str, Any]:
    """The adapter entries of a model state dict (what a LoRA checkpoint holds: the base is frozen)."""
    return {n: t for n, t in state.items() if is_adapter(n)}


def peft_name(name: str) -> str:
    """An in-place adapter's parameter name as peft's ``save_pretrained`` writes it: under ``base_model.model.``
    (the PeftModel wrapper), without the adapter name."""
    for m in (".lora_A.", ".lora_B."):
        name = name.replace(f"{m}default.", m)
    return f"base_model.model.{name}"


def save_adapter(tensors: dict[str, torch.Tensor], rank: int, alpha: float, target_modules: str | list[str],
                 base_model: str, out_dir: str | Path) -> Path:
    """``tensors`` (the adapters, unsharded) in peft's ``save_pretrained`` layout (``adapter_config.json`` +
    ``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base, out_dir)`` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(rank, alpha, target_modules)
    config.base_model_name_or_path, config.task_type = str(base_model), "CAUSAL_LM"
    config.save_pretrained(str(out))
    save_file({peft_name(n): t.contiguous() for n, t in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out


def save_worker_adapter(worker: Any, out_dir: str | Path) -> str | None:
    """The worker's adapters alone in peft's layout in ``out_dir``: what a vLLM engine serving LoRA loads after an
    update (MBs, against the whole merged model). Collective: every rank gathers each FSDP2-sharded adapter whole,
    one at a time; rank 0 writes and returns the path (None elsewhere)."""
    from arpo.trainer.actor_update import full_tensor

    adapters = {n: full_tensor(p.detach()).cpu() for n, p in worker.model.named_parameters() if is_adapter(n)}
    if worker.rank != 0:
        return None
    m = worker.cfg.model
    return str(save_adapter(adapters, m.lora_rank, m.lora_alpha, m.target_modules, str(m.path), out_dir))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer bypasses its adapter inside the block (the reference policy's forward
    without a second copy of the weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


@dataclass
class MergedLinear:
    """A LoRA linear's weight as the engine sees it: base + scaling * B @ A, gathered whole on demand."""

    base: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def full(self, dtype: torch.dtype) -> torch.Tensor:
        """Gather the three (collective under FSDP2) and merge in float32, then cast."""
        from arpo.trainer.actor_update import full_tensor

        w = full_tensor(self.base.detach()).float()
        b, a = full_tensor(self.lora_b.detach()).float(), full_tensor(self.lora_a.detach()).float()
        return (w + self.scaling * (b @ a)).to(dtype)


def lora_engine_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` (the wrapped model's state dict) as the base model's: LoRA weights merged (:class:`MergedLinear`)
    under the base names, other base-layer tensors renamed, adapter matrices left out; order kept."""
    from peft.tuners.lora import LoraLayer

    scaling = {f"{n}{BASE}weight": m.scaling["default"] for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, Any] = {}
    for name, t in state.items():
        if is_adapter(name):
            continue
        if name in scaling:
            prefix = name[: -len(f"{BASE}weight")]
            out[f"{prefix}.weight"] = MergedLinear(t, state[f"{prefix}.lora_A.default.weight"],
                                                   state[f"{prefix}.lora_B.default.weight"], scaling[name])
        else:
            out[name.replace(BASE, ".")] = t
    return out
