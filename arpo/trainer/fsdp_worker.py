"""One training rank: a HF causal LM sharded with FSDP2, its optimizer, and verl's dp_actor update.

Run one :class:`ActorWorker` per rank (as Ray actors, see :mod:`arpo.trainer.worker_group`); every method that
touches the model is a collective, so all ranks must call it together with equally sized shares of a batch.

The PPO update itself (exact data parallelism, the on-policy path without old log-probs) is in
:mod:`arpo.trainer.actor_update`. Memory: activations are recomputed in the backward pass when
``actor_rollout_ref.model.enable_gradient_checkpointing`` is on, glibc maps large blocks so RSS follows live
memory, and freed memory goes back to the OS after every big phase (:mod:`arpo.trainer.memory`). In low
precision micro-batches also run left-aligned, only as wide as their longest row (DeviceSettings.fast_layout).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from arpo.batch import DataBatch
from arpo.engine.weights import (BucketEntry, WeightBucket, bucket_size, pack_bucket, plan_buckets,
                                 transfer_dtype)
from arpo.trainer.actor_update import METRIC_KEYS, full_tensor, ppo_update
from arpo.trainer.device import cpu_has_native_bf16, device_settings_from_config
from arpo.trainer.logprobs import compute_logprobs_and_entropy
from arpo.trainer.lora import (MergedLinear, adapters_disabled, apply_lora, has_lora, lora_engine_tensors,
                              save_worker_adapter)
from arpo.trainer.micro_batches import dummy_micro_batch, plan_micro_batches
from arpo.trainer.memory import configure_allocator, keep_heap_top, memory_stats, release_memory
from arpo.trainer.optim import build_optimizer
from arpo.trainer.model_init import (compile_blocks, materialize_from_rank0, reshard_layers_after_forward,
                                     shard_model)
from arpo.trainer.tree_attention import use_tree_attention
from arpo.trainer.tree_packing import pack_micro_batch, packed_logprobs_and_entropy
from arpo.trainer.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

ROLES = ("actor", "ref")
__all__ = ["ActorWorker", "METRIC_KEYS"]


def open_store(host: str, port: int = 0, world_size: int = 1, is_master: bool = True) -> dist.TCPStore:
    """The process group's key-value store. The master binds ``port`` 0 and the OS hands it a free port
    atomically: a port probed free and bound later can be taken in between (by any socket's ephemeral source
    port), which failed runs with EADDRINUSE."""
    # the master must not wait for the other ranks here: they connect only once it has returned its port
    return dist.TCPStore(host, port, world_size, is_master, timeout=timedelta(minutes=30), wait_for_workers=False)


class ActorWorker:
    """One FSDP2 rank of the policy (``role="actor"``: optimizer, scheduler, updates) or of the frozen
    reference policy (``role="ref"``: log-probs only).

    ``config`` is the root config as a plain dict (``actor_rollout_ref.*``, ``trainer.*``). Call
    :meth:`init_model` on every rank together before anything else.
    """

    #: the roles this class runs; the config section its optimizer keys are read from (for error messages)
    ROLES: tuple[str, ...] = ROLES
    OPTIM_KEY = "actor_rollout_ref.actor.optim"

    def __init__(self, config: dict, role: str = "actor", rank: int = 0, world_size: int = 1):
        if role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {role!r}")
        configure_allocator()  # before the model and activations exist: RSS follows live memory
        self.config = config
        self.cfg = WorkerConfig.from_config(config, role)
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.settings = device_settings_from_config(config)
        # the tokens every row of a micro-batch begins with (the system prompt) run once; fast layout only
        self.share_prefix = self.cfg.model.share_prefix
        # a prompt group's tree as one sequence (tree_packing.py), when the worker group sends the tree columns
        self.tree_packing = self.cfg.model.packs_trees(self.settings.device_type)
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.device = torch.device("cpu")
        #: the current weight sync's tensors and bucket plan (:meth:`plan_weight_sync`)
        self._sync: tuple[dict[str, torch.Tensor], list[list[BucketEntry]]] | None = None
        #: CUDA: the page-locked bucket buffer, kept between weight syncs (:meth:`weight_bucket`)
        self._pinned: torch.Tensor | None = None
        #: the process group's store: rank 0 hosts it (:meth:`rendezvous_address`), the others connect
        self._store: dist.TCPStore | None = None

    # ------------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------------

    def rendezvous_address(self) -> tuple[str, int]:
        """Open the process group's store on this rank's node (rank 0) and return its (address, port) for
        every rank's :meth:`init_model`."""
        if self.cfg.nnodes == 1:
            address = "127.0.0.1"
        else:
            import ray

            address = ray.util.get_node_ip_address()
        self._store = open_store(address, world_size=self.world_size)
        return address, self._store.port

    def init_model(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict:
        """Join the process group, load the model (rank 0 reads the checkpoint; every rank builds it on the meta
        device, shards it with FSDP2 and receives its shards from rank 0, see :mod:`arpo.trainer.model_init`),
        build optimizer and scheduler. Returns this rank's set-up, with its resident memory before the load and
        at its peak during it (MiB)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if master_addr in ("127.0.0.1", "localhost"):
            # Keep gloo's sockets on loopback; by default it resolves the hostname to the eth0 address.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if not dist.is_initialized():
            if self._store is None:  # rank 0 without a rendezvous (a single rank) opens its own store
                self._store = (open_store(master_addr, world_size=self.world_size) if master_port is None else
                               open_store(master_addr, master_port, self.world_size, is_master=False))
            dist.init_process_group(self.settings.backend, store=self._store, rank=self.rank,
                                    world_size=self.world_size)
        if self.settings.device_type == "cuda":
            torch.cuda.set_device(self.settings.device(int(os.environ.get("LOCAL_RANK", 0))))
            self.device = torch.device("cuda", torch.cuda.current_device())

        model = self.empty_model()
        # measured after the imports the load needs (they are not the model)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict  # noqa: F401

        before = memory_stats(reset_peak=True)["rss_mb"]
        loaded = self.load_model() if self.rank == 0 else None
        if self.uses_lora:  # every rank wraps alike before sharding; rank 0's adapter init is broadcast
            m = self.cfg.model
            model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
            if loaded is not None:
                loaded = apply_lora(loaded, m.lora_rank, m.lora_alpha, m.target_modules, seed=self.cfg.seed)
        if self.tree_packing:  # packed trees attend segment by segment; every other forward is plain SDPA
            use_tree_attention(model)
        if self.trainable and self.cfg.model.enable_gradient_checkpointing:
            # Non-reentrant: the recompute re-runs FSDP2's pre-forward hooks (parameters are gathered
            # again) and autocast's state, and it works when the inputs do not require grad.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if (self.rank == 0 and self.settings.autocast and self.settings.compute_dtype == torch.bfloat16
                and not cpu_has_native_bf16()):
            logger.warning("actor_rollout_ref.model.dtype=bfloat16 on a CPU without avx512_bf16/AMX: bf16 "
                           "matmuls are emulated and slower than float32; set actor_rollout_ref.model.dtype=float32")

        mesh = init_device_mesh(self.settings.device_type, (self.world_size,))
        mp = None
        if self.settings.fsdp_mixed_precision:
            mp = MixedPrecisionPolicy(param_dtype=self.settings.compute_dtype, reduce_dtype=torch.float32)
        shard_model(model, mesh, mp)
        materialize_from_rank0(model, loaded, self.device)
        if self.cfg.use_torch_compile:
            compile_blocks(model)
        del loaded
        self.model = model

        if self.trainable:
            self._build_optimizer()
        else:
            model.requires_grad_(False)
            model.eval()
        release_memory(full=True)  # rank 0's host copy of the checkpoint
        load_peak = memory_stats()["peak_rss_mb"]
        keep_heap_top()  # the steps' activations reuse their freed heap pages instead of faulting new ones in
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("%s rank %d/%d: %s on %s (%s, %s), %.2fM params, load peak RSS %.0f MiB", self.role, self.rank,
                    self.world_size, type(model).__name__, self.device, self.settings.backend,
                    self.settings.compute_dtype, n_params / 1e6, load_peak)
        return {"rank": self.rank, "device": str(self.device), "backend": self.settings.backend,
                "dtype": str(self.settings.compute_dtype), "autocast": self.settings.autocast,
                "fast_layout": self.settings.fast_layout,
                "num_params": n_params, "torch_threads": torch.get_num_threads(),
                "rss_before_load_mb": before, "peak_rss_load_mb": load_peak}

    @property
    def trainable(self) -> bool:
        return self.role != "ref"

    @property
    def param_dtype(self) -> torch.dtype:
        """fp32 master weights to train; the frozen reference in the compute dtype, as verl keeps it (forwards only)."""
        return torch.float32 if self.trainable else self.settings.compute_dtype

    @property
    def uses_lora(self) -> bool:
        """The policy trains LoRA adapters (the reference and the critic stay full models)."""
        return self.role == "actor" and int(self.cfg.model.lora_rank) > 0

    def model_path(self) -> str:
        if not self.cfg.model.path:
            raise ValueError("actor_rollout_ref.model.path is not set: give an HF-format model directory")
        return str(self.cfg.model.path)

    def model_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_path())

    def load_model(self) -> torch.nn.Module:
        """The checkpoint's model on CPU in :attr:`param_dtype` (rank 0 only: it is broadcast from there); mixed
        precision casts fp32 master weights to bf16 for compute only (GPU: FSDP2 casts the parameters; CPU:
        autocast around each forward, see device.py)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            self.model_path(), config=self.model_config(), dtype=self.param_dtype,
            attn_implementation=self.cfg.model.attn_implementation)

    def empty_model(self) -> torch.nn.Module:
        """The same model on the meta device: its structure without memory (every rank shards it before any of its
        weights exist). In eval mode, as ``from_pretrained`` leaves a model."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.model_config(), dtype=self.param_dtype,
                                                     attn_implementation=self.cfg.model.attn_implementation)
        return model.eval()

    def _build_optimizer(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.optimizer, self.lr_scheduler = build_optimizer(params, self.cfg.optim, self.cfg.total_training_steps,
                                                            self.OPTIM_KEY)

    # ------------------------------------------------------------------------------------------------
    # forward passes
    # ------------------------------------------------------------------------------------------------

    def temperature(self, batch: DataBatch) -> float:
        return float(batch.meta.get("temperature", self.cfg.temperature))

    def packs_trees(self, batch: DataBatch) -> bool:
        return self.tree_packing and "tree_id" in batch.tensors

    def micro_batches(self, batch: DataBatch, micro_size: int, max_tokens: int | None = None) -> list[torch.Tensor]:
        """Row indices of each micro-batch of this worker's forwards (:func:`plan_micro_batches` with its layout)."""
        return plan_micro_batches(batch, micro_size, max_tokens, pack_trees=self.packs_trees(batch),
                                  fast_layout=self.settings.fast_layout)

    def micro_batch_count(self, micros: list[torch.Tensor]) -> int:
        """The most micro-batches any rank has: every forward and backward is a collective (FSDP2 gathers and
        reduces per call), so a rank with fewer trees runs
        :func:`~arpo.trainer.micro_batches.dummy_micro_batch` for the rest."""
        return int(self.all_reduce_max([len(micros)])[0])

    def forward(self, micro: DataBatch, temperature: float, calc_entropy: bool, entropy_grad: bool = True,
                head_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) of ``micro``'s responses, (B, R) each, in the compute dtype's autocast
        (CPU bf16) with the output head's forward in fp32. ``entropy_grad=False``: entropy as a metric only;
        ``head_mask``: only these positions are needed (0 elsewhere). A micro-batch of one tree runs packed."""
        dev = self.device
        chunk = int(self.cfg.policy.logprob_chunk_size)
        fast = self.settings.fast_layout  # fp32: laid out as one process runs the batch (device.py)
        trees = self.packs_trees(micro)
        group = pack_micro_batch(micro) if trees else None
        head_mask = head_mask.to(dev) if fast and head_mask is not None else None
        with self.settings.autocast_context():
            if group is not None:
                return packed_logprobs_and_entropy(
                    self.model, group, micro["responses"].shape[1], head_mask, chunk, temperature, calc_entropy,
                    entropy_grad)
            # one forward per micro-batch when packing trees: a shared-prefix pass would be a second collective
            return compute_logprobs_and_entropy(
                self.model, micro["input_ids"].to(dev), micro["attention_mask"].to(dev),
                micro["position_ids"].to(dev), response_length=micro["responses"].shape[1], chunk_size=chunk,
                temperature=temperature, calc_entropy=calc_entropy, entropy_grad=entropy_grad, pack=fast,
                head_mask=head_mask, share_prefix=fast and self.share_prefix and not trees)

    def compute_log_prob(self, batch: DataBatch, calc_entropy: bool | None = None,
                         base_model: bool = False) -> dict[str, torch.Tensor]:
        """Log-probs of ``responses`` under this rank's model (no grad), micro-batched, for this rank's rows:
        ``{"log_probs": (B, T)}`` plus ``"entropy"`` (B, T) when ``calc_entropy`` (default: on for the
        actor, whose old-log-prob pass gives verl's ``actor/entropy`` metric; off for the reference).
        Padding positions are 0. ``base_model``: with LoRA adapters disabled (the reference policy)."""
        if calc_entropy is None:
            calc_entropy = self.role == "actor"
        micro = self.cfg.log_prob_micro_batch_size
        max_tokens = self.cfg.log_prob_max_token_len if self.cfg.log_prob_use_dynamic_bsz else None
        temperature = self.temperature(batch)
        was_training = self.model.training
        self.model.eval()
        width = batch["responses"].shape[1]
        logps = torch.zeros(len(batch), width)
        ents = torch.zeros(len(batch), width) if calc_entropy else None
        micros = self.micro_batches(batch, micro, max_tokens)
        base = adapters_disabled(self.model) if base_model and has_lora(self.model) else contextlib.nullcontext()
        with torch.no_grad(), base:
            for i in range(self.micro_batch_count(micros)):
                if i >= len(micros):
                    self.forward(dummy_micro_batch(batch), temperature, False)
                    continue
                lp, ent = self.forward(batch.index(micros[i]), temperature, calc_entropy)
                logps[micros[i]] = lp.cpu()
                if calc_entropy:
                    ents[micros[i]] = ent.cpu()
        self.model.train(was_training)
        out = {"log_probs": logps}
        if calc_entropy:
            out["entropy"] = ents
        release_memory()
        return out

    # ------------------------------------------------------------------------------------------------
    # the PPO update (verl dp_actor.update_policy)
    # ------------------------------------------------------------------------------------------------

    def _all_reduce(self, values: list[float] | torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.cpu()

    def all_reduce_sum(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def all_reduce_max(self, values: list[float] | torch.Tensor) -> torch.Tensor:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def clip_and_step(self, grad_clip: float) -> float:
        """Clip the mini-batch's gradients to ``grad_clip`` (global norm) and take the optimizer step, or skip it
        when the norm is not finite; returns the norm before clipping."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=grad_clip))
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("%s: grad_norm is %s; skipping this mini-batch's optimizer step", self.role, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def update_policy(self, batch: DataBatch, keep_gradients: bool = False) -> dict[str, float]:
        """PPO epochs over mini-batches over micro-batches; one optimizer step per mini-batch, one scheduler
        step per call. Needs ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
        ``response_mask``, ``advantages``, ``old_log_probs`` unless the update is on-policy (one mini-batch,
        ``ppo_epochs`` = 1: then the update's own detached log-probs stand in, see
        :mod:`arpo.trainer.actor_update`), and ``ref_log_prob`` with use_kl_loss.

        This rank's rows must be its share of each global mini-batch in order (the worker group arranges it):
        ``ppo_mini_batch_size * rollout.n / world_size`` rows per mini-batch, the last possibly shorter.
        Rows with ``is_pad`` = 1 (padding added to split a short mini-batch evenly) carry no loss.
        Returns verl's metrics, averaged over mini-batches and epochs, equal on every rank; ``actor/entropy``
        is among them when ``entropy_coeff`` != 0 or the batch had no ``old_log_probs``.
        The gradients are freed at the end unless ``keep_gradients`` (for :meth:`full_gradients`).
        """
        if self.role != "actor" or self.optimizer is None:
            raise RuntimeError("update_policy needs a worker with role='actor' and init_model() called")
        # FSDP2 reshards each layer after its forward and gathers it again for the backward (and for gradient
        # checkpointing's recompute inside it). Kept gathered instead, one all-gather per layer and micro-batch is
        # saved; only around the update, whose every forward has a backward to reshard (a log-prob forward
        # without one would leave the whole model gathered).
        keep_gathered = not self.cfg.reshard_after_forward
        if keep_gathered:
            reshard_layers_after_forward(self.model, False)
        try:
            return ppo_update(self, batch, keep_gradients)
        finally:
            if keep_gathered:
                reshard_layers_after_forward(self.model, True)
            release_memory()

    # ------------------------------------------------------------------------------------------------
    # weights out: engine hand-over, HF export, inspection
    # ------------------------------------------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, torch.Tensor] | None:
        """The full (unsharded) state dict on CPU in HF names, on rank 0 (None elsewhere): DCP's full state dict,
        offloaded tensor by tensor. Collective. The whole model on rank 0's host: for the HF export only (weight
        syncs stream buckets, :meth:`weight_bucket`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if self._tied_head():
            state.pop("lm_head.weight", None)
        if has_lora(self.model):  # the merged model under the base names (full tensors here: no collective)
            state = {n: t.full(torch.float32) if isinstance(t, MergedLinear) else t
                     for n, t in lora_engine_tensors(self.model, state).items()}
        return state

    def _tied_head(self) -> bool:
        # A tied head is the embedding; HF checkpoints (and vLLM's loader) store it once.
        return bool(getattr(self.model.config, "tie_word_embeddings", False))

    def plan_weight_sync(self, engine_dtype: str, bucket_bytes: int) -> list[int]:
        """Cut the engine's weights (HF names, a tied head once, floating point in ``engine_dtype``) into buckets
        of at most ``bucket_bytes`` (a bigger tensor alone in its own), in state-dict order: layer by layer.
        Every rank plans the same from the parameters' global shapes; returns each bucket's size in bytes."""
        dtype = getattr(torch, engine_dtype)
        tensors = {n: t for n, t in self.model.state_dict().items()
                   if not (n == "lm_head.weight" and self._tied_head())}
        if has_lora(self.model):  # merged, under the base model's names
            tensors = lora_engine_tensors(self.model, tensors)
        self._sync = (tensors, plan_buckets(((n, t.shape, transfer_dtype(t.dtype, dtype)) for n, t in tensors.items()),
                                            bucket_bytes))
        return [bucket_size(entries) for entries in self._sync[1]]

    def weight_bucket(self, index: int, fresh: bool = False) -> WeightBucket | None:
        """Bucket ``index`` of the last :meth:`plan_weight_sync`, on rank 0 (None elsewhere). Collective: each
        parameter is cast to the bucket's dtype on its shards and gathered whole (FSDP2 ``full_tensor``), one at a
        time, so a rank holds at most one full parameter on its device.

        On CUDA the bucket is copied without waiting into a page-locked buffer kept between syncs (a pageable copy
        per tensor was most of a sync's GPU time on an H100; it grows to the largest bucket), one wait per bucket.
        The result shares that buffer, which is right for a Ray method: its result is copied into the object store
        on return. ``fresh``: a buffer of its own instead (an engine in this process keeps views of it)."""
        tensors, plan = self._sync
        entries = plan[index]
        pinned = self.device.type == "cuda" and not fresh
        out = None
        if self.rank == 0 and pinned:
            size = bucket_size(entries)
            if self._pinned is None or self._pinned.numel() < size:
                self._pinned = None
                self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            out = self._pinned
        gathered = (tensors[e.name].full(getattr(torch, e.dtype)) if isinstance(tensors[e.name], MergedLinear)
                    else full_tensor(tensors[e.name].detach().to(getattr(torch, e.dtype))) for e in entries)
        if self.rank != 0:
            for _ in gathered:  # this rank's part of each gather
                pass
            return None
        bucket = pack_bucket(entries, gathered, out)
        if pinned:
            torch.cuda.synchronize(self.device)
        if isinstance(bucket.data, torch.Tensor):
            bucket.data = bucket.data.numpy()  # out of band through Ray's object store
        return bucket

    def end_weight_sync(self) -> None:
        """Drop the plan (it holds the parameters) and the cached memory of the gathers."""
        self._sync = None
        release_memory()

    def save_lora_adapter(self, out_dir: str) -> str | None:
        """The adapters alone, peft layout, for engines serving LoRA (:func:`save_worker_adapter`). Collective."""
        return save_worker_adapter(self, out_dir)

    def export_hf(self, out_dir: str) -> str | None:
        """``save_pretrained`` of the full model (LoRA: merged; the adapter alone in ``lora_adapter/``) plus a copy
        of the tokenizer, loadable by transformers and vLLM. Collective; rank 0 writes."""
        from arpo.trainer.checkpoint import export_worker_hf

        return export_worker_hf(self, out_dir)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter unsharded, on CPU (collective; tests and debugging)."""
        return {n: full_tensor(p.detach()).cpu() for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Gradients of the last mini-batch, unsharded, on CPU, after ``update_policy(..., keep_gradients=True)``
        (collective; tests and debugging)."""
        return {n: full_tensor(p.grad.detach()).cpu() for n, p in self.model.named_parameters()
                if p.grad is not None}

    # ------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------

    def save_checkpoint(self, actor_dir: str, contents: list[str] | None = None) -> None:
        """Sharded model (+ optimizer, + scheduler/RNG as ``extra``, + ``hf_model``) into ``actor_dir`` via
        DCP. ``contents`` defaults to ``actor_rollout_ref.actor.checkpoint.save_contents``. Collective."""
        from arpo.trainer.checkpoint import save_sharded

        save_sharded(self, actor_dir, list(contents or self.cfg.save_contents))

    def load_checkpoint(self, actor_dir: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (whatever contents it has). Collective."""
        from arpo.trainer.checkpoint import load_sharded

        load_sharded(self, actor_dir)

    def barrier(self) -> None:
        dist.barrier()

    def memory_stats(self, reset_peak: bool = False) -> dict[str, float]:
        """This rank's resident memory now and at its peak (MiB) and CPU seconds, see
        :func:`arpo.trainer.memory.memory_stats`; on a GPU also its peak allocated GPU memory (MiB)."""
        out = {"rank": self.rank, **memory_stats(reset_peak)}
        if self.device.type == "cuda":
            out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def shutdown(self) -> None:
        """Leave the process group, free model, optimizer and buffers (CUDA cache too): a rank in the driver's
        process (LocalWorkerGroup: the cold-start SFT) would keep them beside the engine and actor started next."""
        self.model = self.optimizer = self.lr_scheduler = self._sync = self._pinned = self._store = None
        if dist.is_initialized():
            dist.destroy_process_group()
        release_memory(full=True)  # a full collection: FSDP2's hooks hold the modules in reference cycles
