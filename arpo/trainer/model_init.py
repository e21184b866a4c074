"""Loading a model onto N FSDP2 ranks without any rank or device holding all of it twice.

Rank 0 alone reads the checkpoint (into host RAM); every rank, rank 0 included, builds the same model on the meta
device, shards it block by block (:func:`shard_model`), allocates only its own shards on its device, and receives
the weights from rank 0 one tensor at a time (DCP's ``set_model_state_dict`` with ``broadcast_from_rank0``), so
no GPU ever holds the whole model and no other rank ever holds it in host RAM. Buffers left out of the state dict
(a rotary embedding's ``inv_freq``) are broadcast from rank 0's loaded copy too: they are then exactly what
``from_pretrained`` computed, as if every rank had loaded the checkpoint itself. The decoder layers' FSDP2 units
are handled here too: whether they reshard after forward, and compiling them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def shard_model(model: torch.nn.Module, mesh: Any, mp_policy: Any = None) -> None:
    """FSDP2 over ``mesh``: each transformer block (``_no_split_modules``) its own unit, the rest in the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes its ``_no_split_modules`` names (also once FSDP2 has
    made each an ``FSDP<name>`` subclass)."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if any(c.__name__ in block_names for c in type(m).__mro__)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class in _no_split_modules; "
                         f"cannot shard it layer by layer")
    return blocks


def reshard_layers_after_forward(model: torch.nn.Module, reshard: bool) -> None:
    """FSDP2's reshard-after-forward switch on each decoder layer's unit. The layers only: FSDP2 never reshards the
    root unit after forward, and True on it would add a gather."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if module is not model and isinstance(module, FSDPModule):
            module.set_reshard_after_forward(reshard, recurse=False)


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place (compiled at its first forward). Dynamic shapes, since every
    micro-batch has its own length; FSDP2's hooks stay outside the graph (dynamo skips them), and the tree
    attention's per-segment loop is excluded (arpo.trainer.tree_attention), which traced would recompile for
    every batch's segments."""
    for block in transformer_blocks(model):
        block.compile(dynamic=True)


def materialize_from_rank0(model: torch.nn.Module, loaded: torch.nn.Module | None, device: torch.device) -> None:
    """Give the sharded meta ``model`` its weights: ``loaded`` (rank 0: the checkpoint's model on CPU; None on the
    other ranks) is broadcast tensor by tensor, each rank keeping its shards. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    is_source = dist.get_rank() == 0
    if is_source and loaded is None:
        raise ValueError("rank 0 must pass the loaded model to materialize_from_rank0")
    model.to_empty(device=device)
    full = loaded.state_dict() if is_source else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    source_buffers = dict(loaded.named_buffers()) if is_source else {}
    for name, buf in model.named_buffers():
        if is_source:
            buf.copy_(source_buffers[name])
        dist.broadcast(buf, src=0)
    _check_ties(model)


def _check_ties(model: torch.nn.Module) -> None:
    """A tied LM head must still be the embedding after the state dict was loaded into it."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is not embed.weight:
        raise RuntimeError("the tied LM head no longer shares the embedding's weight after loading")
