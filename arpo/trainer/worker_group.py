"""N :class:`~arpo.trainer.fsdp_worker.ActorWorker` ranks (for the critic,
:class:`~arpo.trainer.critic_worker.CriticWorker`) as Ray actors, called together (:class:`RayWorkerGroup`),
or one rank in this process without Ray (:class:`LocalWorkerGroup`).

Every model method is a collective (FSDP2 all-gathers parameters in each forward), so a call goes to *all*
actors at once and is awaited with one ``ray.get([...])``; calling rank by rank would deadlock gloo/nccl.

Batches are split by rank so that the result does not depend on the world size: for ``update_policy`` the
global batch is cut into PPO mini-batches of ``ppo_mini_batch_size * rollout.n`` rows first, and rank r gets
the r-th slice of *each* mini-batch, so every optimizer step sees exactly the rows one process would see.
A mini-batch (or batch) that does not split evenly is padded with copies of its last row marked
``is_pad`` = 1, which carry no loss and are dropped from the results. Ranks computing in low precision
get rows dealt by length (``balance``; fp32 keeps one process's order, see DeviceSettings.fast_layout):
every collective waits for the slowest rank, so each rank's i-th micro-batch should cost about the same;
the loss is a sum over rows, so which rank holds a row changes the update only by rounding.
With tree packing (``actor_rollout_ref.model.tree_packing``) whole prompt groups are dealt instead, balanced by
their packed tokens (:func:`split_trees_for_ranks`), so that a tree is never split over ranks.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from arpo.batch import DataBatch
from arpo.runtime.placement import GpuPlacement
from arpo.trainer.actor_config import to_plain, world_size as config_world_size
from arpo.trainer.memory import allocator_env
from arpo.trainer.tree_packing import tree_columns, tree_micro_batches, unique_token_count
from arpo.trainer.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


def pad_to_multiple(batch: DataBatch, multiple: int) -> tuple[DataBatch, int]:
    """``batch`` padded with copies of its last row (``is_pad`` = 1) to a multiple of ``multiple`` rows;
    returns the padded batch and the number of pad rows."""
    n = len(batch)
    if n == 0:
        raise ValueError("cannot split an empty batch over the training ranks")
    pad = (-n) % multiple
    is_pad = torch.zeros(n, dtype=torch.long)
    if "is_pad" in batch.tensors:
        is_pad = batch["is_pad"].clone()
    out = DataBatch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
    out.tensors["is_pad"] = is_pad
    if pad:
        filler = out.index([n - 1] * pad)
        filler.tensors["is_pad"] = torch.ones(pad, dtype=torch.long)
        out = DataBatch.concat([out, filler])
    return out, pad


def balanced_order(attention_mask: torch.Tensor, world_size: int) -> torch.Tensor:
    """Row order whose ``world_size`` equal contiguous chunks hold about equal tokens, each longest first:
    rows sorted by length are dealt to the ranks in snake order (0, 1, ..., W-1, W-1, ..., 0, ...)."""
    by_length = torch.argsort(attention_mask.sum(dim=1), descending=True, stable=True).tolist()
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i, row in enumerate(by_length):
        lap, pos = divmod(i, world_size)
        ranks[pos if lap % 2 == 0 else world_size - 1 - pos].append(row)
    return torch.tensor([row for rank in ranks for row in rank], dtype=torch.long)


def split_for_ranks(batch: DataBatch, world_size: int, mini_batch_rows: int | None = None,
                    balance: bool = False) -> tuple[list[DataBatch], int]:
    """Per-rank shares of ``batch``. With ``mini_batch_rows``: rank r gets the r-th slice of every
    mini-batch (each padded to a multiple of ``world_size``); returns (shares, rows per rank per full
    mini-batch). Without: contiguous equal chunks of the padded batch; returns (shares, 0).

    ``balance`` deals each (mini-)batch's rows by length instead (:func:`balanced_order`); the shares of
    the plain split then carry ``row_index`` (the row's place in the padded batch) for :func:`gather_rows`."""
    if mini_batch_rows is None:
        padded, _ = pad_to_multiple(batch, world_size)
        if balance:
            order = balanced_order(padded["attention_mask"], world_size)
            padded = padded.index(order)
            padded.tensors["row_index"] = order
        return padded.chunk(world_size), 0
    pieces: list[list[DataBatch]] = [[] for _ in range(world_size)]
    per_rank = math.ceil(mini_batch_rows / world_size)
    for start in range(0, len(batch), mini_batch_rows):
        mb, _ = pad_to_multiple(batch.index(slice(start, min(len(batch), start + mini_batch_rows))), world_size)
        if balance:
            mb = mb.index(balanced_order(mb["attention_mask"], world_size))
        for r, chunk in enumerate(mb.chunk(world_size)):
            pieces[r].append(chunk)
    return [DataBatch.concat(p) for p in pieces], per_rank


def split_trees_for_ranks(batch: DataBatch, world_size: int, mini_batch_rows: int | None = None) -> list[DataBatch]:
    """Per-rank shares of ``batch`` (which carries :data:`~arpo.trainer.tree_packing.TREE_COLUMNS`) made of whole
    trees: within each mini-batch (``mini_batch_rows`` consecutive rows, or the whole batch), trees go largest
    first to the rank with the fewest packed tokens so far. Shares differ in size; every row carries
    ``mini_batch_id`` and ``row_index`` (its place in ``batch``, for :func:`gather_rows`), and a rank that gets
    no tree in a mini-batch gets one pad row (``is_pad`` = 1) so that it still takes part in it."""
    if len(batch) == 0:
        raise ValueError("cannot split an empty batch over the training ranks")
    size = mini_batch_rows or len(batch)
    pieces: list[list[DataBatch]] = [[] for _ in range(world_size)]
    for mb_id, start in enumerate(range(0, len(batch), size)):
        rows = torch.arange(start, min(len(batch), start + size))
        mb = batch.index(rows)
        mb.tensors["is_pad"] = mb["is_pad"] if "is_pad" in mb.tensors else torch.zeros(len(mb), dtype=torch.long)
        trees = tree_micro_batches(mb)
        loads, dealt = [0] * world_size, [[] for _ in range(world_size)]
        sized = [(unique_token_count(mb, t.tolist()), t.tolist()) for t in trees]
        for tokens, tree in sorted(sized, key=lambda st: -st[0]):  # stable: equal sizes keep their order
            rank = loads.index(min(loads))
            loads[rank] += tokens
            dealt[rank].extend(tree)
        for rank in range(world_size):
            chosen = sorted(dealt[rank]) or [len(mb) - 1]
            share = mb.index(chosen)
            share.tensors["is_pad"] = mb["is_pad"][chosen] if dealt[rank] else torch.ones(1, dtype=torch.long)
            share.tensors["row_index"] = rows[chosen]
            share.tensors["mini_batch_id"] = torch.full((len(chosen),), mb_id, dtype=torch.long)
            pieces[rank].append(share)
    return [DataBatch.concat(p) for p in pieces]


def gather_rows(results: list[dict[str, torch.Tensor]], is_pad: list[torch.Tensor],
                row_index: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Concatenate per-rank row tensors in rank order (or back into ``row_index`` order), dropping pad rows."""
    pads = torch.cat(is_pad)
    if row_index is not None:
        order = torch.argsort(torch.cat(row_index))
        pads = pads[order]
    else:
        order = torch.arange(len(pads))
    keep = order[pads == 0]
    return {k: torch.cat([r[k] for r in results])[keep] for k in results[0]}


def _node_id(worker: Any) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def worker_class(role: str) -> type:
    """The worker class of ``role``: actor and ref ranks, the critic's, or SFT's (:mod:`arpo.trainer.sft_step`)."""
    if role == "critic":
        from arpo.trainer.critic_worker import CriticWorker

        return CriticWorker
    if role == "sft":
        from arpo.trainer.sft_step import SFTWorker

        return SFTWorker
    from arpo.trainer.fsdp_worker import ActorWorker

    return ActorWorker


def _tensors_only(batch: DataBatch) -> DataBatch:
    """The workers read tensors only; leaving the object columns behind keeps the Ray transfers small."""
    return DataBatch(dict(batch.tensors), {}, dict(batch.meta))


class WorkerGroup:
    """The trainer's calls on N ranks of one role: batches split by rank, results gathered in row order.

    Subclasses say how a call reaches the ranks (:meth:`execute_all`, :meth:`execute_split`)."""

    config: dict
    cfg: WorkerConfig
    role: str
    world_size: int
    init_info: list[dict]

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank together; results in rank order."""
        raise NotImplementedError

    def execute_split(self, method: str, shares: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(shares[r], *args, **kwargs)`` on rank r, all ranks together."""
        raise NotImplementedError

    # -- the trainer's calls ----------------------------------------------------------------------------

    def _balance(self) -> bool:
        """Deal rows to ranks by length, except in the exact mode (see DeviceSettings.fast_layout)."""
        return bool(self.init_info[0].get("fast_layout", False))

    def _packs_trees(self) -> bool:
        return self.cfg.model.packs_trees(str(self.init_info[0].get("device", "cpu")).split(":")[0])

    def _with_trees(self, batch: DataBatch) -> DataBatch:
        out = _tensors_only(batch)
        out.tensors.update(tree_columns(batch))
        return out

    def compute_log_prob(self, batch: DataBatch, calc_entropy: bool | None = None,
                         base_model: bool = False) -> dict[str, torch.Tensor]:
        """``{"log_probs": (B, T)}`` (+ ``"entropy"``; by default for the actor role) in ``batch`` row order;
        ``base_model``: LoRA adapters disabled (the reference policy). See :meth:`ActorWorker.compute_log_prob`."""
        kwargs = {"calc_entropy": calc_entropy, "base_model": base_model}
        if self._packs_trees():
            shares = split_trees_for_ranks(self._with_trees(batch), self.world_size)
            results = self.execute_split("compute_log_prob", shares, **kwargs)
            return gather_rows(results, [s["is_pad"] for s in shares], [s["row_index"] for s in shares])
        balance = self._balance()
        shares, _ = split_for_ranks(_tensors_only(batch), self.world_size, balance=balance)
        results = self.execute_split("compute_log_prob", shares, **kwargs)
        return gather_rows(results, [s["is_pad"] for s in shares],
                           [s["row_index"] for s in shares] if balance else None)

    def update_shares(self, batch: DataBatch) -> list[DataBatch]:
        """Each rank's rows of ``batch`` for :meth:`update_policy`: whole trees when packing them, else its slice of
        every mini-batch (benchmarks read them to see the micro-batches each rank runs)."""
        if self._packs_trees():
            return split_trees_for_ranks(self._with_trees(batch), self.world_size, self.cfg.mini_batch_rows)
        shares, per_rank = split_for_ranks(_tensors_only(batch), self.world_size, self.cfg.mini_batch_rows,
                                           balance=self._balance())
        for s in shares:
            s.meta["mini_batch_rows_per_rank"] = per_rank
        return shares

    def update_policy(self, batch: DataBatch, keep_gradients: bool = False) -> dict[str, float]:
        """One PPO update on ``batch`` (see :meth:`ActorWorker.update_policy`); returns verl's metrics."""
        return self.execute_split("update_policy", self.update_shares(batch), keep_gradients)[0]

    def compute_values(self, batch: DataBatch) -> dict[str, torch.Tensor]:
        """``{"values": (B, T)}`` of the critic in ``batch`` row order (:meth:`CriticWorker.compute_values`)."""
        shares, _ = split_for_ranks(_tensors_only(batch), self.world_size)
        results = self.execute_split("compute_values", shares)
        return gather_rows(results, [s["is_pad"] for s in shares])

    def update_critic(self, batch: DataBatch) -> dict[str, float]:
        """One value-loss update on ``batch`` (:meth:`CriticWorker.update_critic`); returns verl's critic metrics."""
        shares, per_rank = split_for_ranks(_tensors_only(batch), self.world_size, self.cfg.mini_batch_rows)
        for s in shares:
            s.meta["mini_batch_rows_per_rank"] = per_rank
        return self.execute_split("update_critic", shares)[0]

    def sft_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                 shared_prefix: int = 0) -> dict[str, float]:
        """One SFT optimizer step on a global batch (:meth:`SFTWorker.sft_step`): rank r gets the r-th of
        ``world_size`` contiguous equal shares of the rows (the batch size must be a multiple of the ranks)."""
        rows = input_ids.shape[0]
        if rows % self.world_size:
            raise ValueError(f"an SFT batch of {rows} rows does not split over {self.world_size} ranks")
        per = rows // self.world_size
        shares = [{"input_ids": input_ids[sl], "attention_mask": attention_mask[sl], "labels": labels[sl]}
                  for sl in (slice(r * per, (r + 1) * per) for r in range(self.world_size))]
        from arpo.trainer.sft_step import trained_tokens

        global_tokens = trained_tokens(labels)
        return self.execute_split("sft_step", shares, shared_prefix, global_tokens)[0]

    def export_hf(self, out_dir: str) -> str:
        return self.execute_all("export_hf", out_dir)[0]

    def save_checkpoint(self, actor_dir: str, contents: list[str] | None = None) -> None:
        self.execute_all("save_checkpoint", actor_dir, contents)

    def load_checkpoint(self, actor_dir: str) -> None:
        self.execute_all("load_checkpoint", actor_dir)

    def plan_weight_sync(self, engine_dtype: str, bucket_bytes: int) -> list[int]:
        """Plan the buckets of a weight sync on every rank (:mod:`arpo.trainer.weight_sync`); their sizes."""
        return self.execute_all("plan_weight_sync", engine_dtype, bucket_bytes)[0]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.execute_all("full_parameters")[0]

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self.execute_all("full_gradients")[0]


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors running :class:`ActorWorker` with one role; every call reaches all of them.

    ``num_cpus`` / ``num_gpus`` per actor default to ``trainer.cpus_per_worker`` and (on GPU) 1. With a
    ``placement`` (a cluster with GPUs) rank r runs in its GPU's bundle, sharing the GPU with rank r of the other
    groups (:mod:`arpo.runtime.placement`). Else, with ``trainer.nnodes`` > 1, the ranks are pinned to nodes,
    ``trainer.n_gpus_per_node`` on each (:func:`arpo.runtime.ray_utils.rank_nodes`); on one node Ray places them.
    """

    def __init__(self, config: Any, role: str = "actor", world_size: int | None = None,
                 num_cpus: float | None = None, num_gpus: float | None = None, name_prefix: str | None = None,
                 placement: GpuPlacement | None = None):
        import ray

        from arpo.runtime.ray_utils import init_ray, node_strategy, rank_nodes

        self.config = to_plain(config)
        self.cfg = WorkerConfig.from_config(self.config, role)
        init_ray(self.config)
        self.role = role
        self.world_size = world_size or config_world_size(self.config)
        device = self.cfg.device
        on_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        num_cpus = float(num_cpus if num_cpus is not None else self.cfg.cpus_per_worker)
        num_gpus = float(num_gpus if num_gpus is not None else (1 if on_gpu else 0))
        # Ray gives each actor OMP_NUM_THREADS = its num_cpus and the driver's sys.path (so `arpo` imports).
        # glibc reads its tunables at process start: huge pages for the ranks' large blocks (memory.py).
        env = {**(ray.get_runtime_context().runtime_env.get("env_vars") or {}), **allocator_env()}
        remote_cls = ray.remote(worker_class(role))
        nnodes = self.cfg.nnodes
        nodes = (rank_nodes(nnodes, self.world_size // nnodes, num_cpus, num_gpus)
                 if world_size is None and placement is None else None)
        self.workers = []
        #: the non-zero ranks' results of the weight sync's gathers, checked when it ends
        self._sync_refs: list[Any] = []
        for rank in range(self.world_size):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "runtime_env": {"env_vars": env},
                                       "scheduling_strategy": node_strategy(nodes[rank] if nodes else None)}
            if placement is not None:
                options.update(placement.rank(rank, num_cpus).options())
            if name_prefix:
                options["name"] = f"{name_prefix}_{role}_{rank}"
            self.workers.append(remote_cls.options(**options).remote(self.config, role, rank, self.world_size))
        self.node_ids = ray.get([w.__ray_call__.remote(_node_id) for w in self.workers])
        master_addr, master_port = ray.get(self.workers[0].rendezvous_address.remote())
        self.init_info = self.execute_all("init_model", master_addr, master_port)
        logger.info("%s worker group: %d ranks on Ray nodes %s, %s", role, self.world_size, self.node_ids,
                    self.init_info[0])

    # -- calling ----------------------------------------------------------------------------------------

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def execute_split(self, method: str, shares: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        if len(shares) != self.world_size:
            raise ValueError(f"{len(shares)} shares for {self.world_size} ranks")
        return ray.get([getattr(w, method).remote(s, *args, **kwargs) for w, s in zip(self.workers, shares)])

    def weight_bucket(self, index: int) -> Any:
        """Bucket ``index`` of the weight sync (collective; :meth:`ActorWorker.weight_bucket`), as the
        ``ray.ObjectRef`` of rank 0's result, left in the object store: an engine actor given the reference fetches
        it to its own node (the driver never holds it). Returns once the gather is under way."""
        refs = [w.weight_bucket.remote(index) for w in self.workers]
        self._sync_refs.extend(refs[1:])
        return refs[0]

    def end_weight_sync(self) -> None:
        import ray

        refs, self._sync_refs = self._sync_refs, []
        ray.get(refs)  # the other ranks' part of every gather is done (they return None), or its error raised
        self.execute_all("end_weight_sync")

    def shutdown(self) -> None:
        """Leave the process group and end the actors."""
        import ray

        try:
            self.execute_all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []


class LocalWorkerGroup(WorkerGroup):
    """One rank of one role in this process, without Ray: a single-GPU box whose Python has only torch and
    transformers, a notebook, a debugger. The batch goes through the same split and gather as on N ranks."""

    def __init__(self, config: Any, role: str = "actor"):
        self.config = to_plain(config)
        self.cfg = WorkerConfig.from_config(self.config, role)
        if config_world_size(self.config) != 1:
            raise ValueError(f"LocalWorkerGroup runs one rank, but trainer.nnodes x trainer.n_gpus_per_node = "
                             f"{config_world_size(self.config)}; set both to 1 or use RayWorkerGroup")
        self.role, self.world_size = role, 1
        self.worker = worker_class(role)(self.config, role, 0, 1)
        self.init_info = [self.worker.init_model(*self.worker.rendezvous_address())]
        logger.info("%s worker group: 1 rank in this process, %s", role, self.init_info[0])

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_split(self, method: str, shares: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if len(shares) != 1:
            raise ValueError(f"{len(shares)} shares for 1 rank")
        return [getattr(self.worker, method)(shares[0], *args, **kwargs)]

    def weight_bucket(self, index: int) -> Any:
        """Bucket ``index`` of the weight sync, in a buffer of its own (an engine in this process may keep views)."""
        return self.worker.weight_bucket(index, fresh=True)

    def end_weight_sync(self) -> None:
        self.worker.end_weight_sync()

    def shutdown(self) -> None:
        """Leave the process group (this process can then start another)."""
        self.worker.shutdown()
