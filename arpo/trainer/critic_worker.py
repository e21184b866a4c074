"""One FSDP2 rank of the value model (verl's critic): values for GAE and the clipped value-loss update.

The critic is the backbone of ``critic.model.path`` (by default the policy's starting checkpoint) with a one-output
token-classification head (``AutoModelForTokenClassification``, ``num_labels=1``, no dropout, as verl builds it).
It shares the actor's loading (rank 0 reads the checkpoint), sharding, optimizer/scheduler construction,
data-parallel scaling and checkpoint format (:class:`~arpo.trainer.fsdp_worker.ActorWorker`); only the model
class, the forward and the loss differ. The value of response token t is the head's output at the position
before it (the state the token was sampled from), and only model tokens carry one: tool results and padding get 0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from arpo.batch import DataBatch
from arpo.trainer import core_algos
from arpo.trainer.actor_update import global_batch_info
from arpo.trainer.micro_batches import mini_batch_indices, split_rows
from arpo.trainer.fsdp_worker import ActorWorker
from arpo.trainer.memory import release_memory


#: Metrics of :meth:`CriticWorker.update_critic` (verl's names).
CRITIC_METRIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr")


def init_value_head(head: torch.nn.Linear, seed: int, std: float) -> None:
    """The fresh value head drawn from ``trainer.seed`` (normal(0, std), bias 0), so that a run is reproducible
    (rank 0 draws it; the other ranks receive it with the rest of the model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
        if head.bias is not None:
            head.bias.zero_()


class CriticWorker(ActorWorker):
    """One FSDP2 rank of the value model; ``role`` is always ``"critic"``. Call :meth:`init_model` on every rank
    together first; every method that touches the model is a collective."""

    ROLES = ("critic",)
    OPTIM_KEY = "critic.optim"

    def __init__(self, config: dict, role: str = "critic", rank: int = 0, world_size: int = 1):
        super().__init__(config, role, rank, world_size)  # its WorkerConfig packs no trees: padded rows

    def model_path(self) -> str:
        if not self.cfg.model.path:
            raise ValueError("critic.model.path and actor_rollout_ref.model.path are not set: give an HF model "
                             "directory")
        return str(self.cfg.model.path)

    def model_config(self) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path())
        config.num_labels = 1
        config.classifier_dropout = 0.0  # a value target needs a deterministic forward
        return config

    def load_model(self) -> torch.nn.Module:
        """The backbone's checkpoint with a fresh value head, on CPU (rank 0 only: it is broadcast from there)."""
        from transformers import AutoModelForTokenClassification

        config = self.model_config()
        with self._no_head_error(config):
            model = AutoModelForTokenClassification.from_pretrained(
                self.model_path(), config=config, dtype=torch.float32,
                attn_implementation=self.cfg.model.attn_implementation)
        init_value_head(model.score, self.cfg.seed, float(getattr(config, "initializer_range", 0.02)))
        return model

    def empty_model(self) -> torch.nn.Module:
        from transformers import AutoModelForTokenClassification

        config = self.model_config()
        with self._no_head_error(config), torch.device("meta"):
            model = AutoModelForTokenClassification.from_config(
                config, dtype=torch.float32, attn_implementation=self.cfg.model.attn_implementation)
        return model.eval()

    @contextlib.contextmanager
    def _no_head_error(self, config: Any) -> Iterator[None]:
        try:
            yield
        except ValueError as e:
            raise ValueError(f"critic.model.path={self.model_path()}: {config.model_type} has no token-classification "
                             f"head in transformers, so it cannot be a critic ({e})") from None

    # ------------------------------------------------------------------------------------------------

    def values(self, micro: DataBatch) -> torch.Tensor:
        """(B, R) values of ``micro``'s response positions (fp32; 0 where ``response_mask`` is 0)."""
        dev = self.device
        width = micro["responses"].shape[1]
        with self.settings.autocast_context():
            out = self.model(input_ids=micro["input_ids"].to(dev), attention_mask=micro["attention_mask"].to(dev),
                             position_ids=micro["position_ids"].to(dev), use_cache=False)
        values = out.logits[:, -width - 1:-1, 0].float()
        return values * micro["response_mask"].to(dev)

    def compute_values(self, batch: DataBatch) -> dict[str, torch.Tensor]:
        """``{"values": (B, R)}`` for this rank's rows, no grad, ``critic.forward_micro_batch_size_per_gpu`` rows
        at a time."""
        micro = int(self.cfg.value.forward_micro_batch_size_per_gpu)
        out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for sl in split_rows(len(batch), micro):
                out[sl] = self.values(batch.index(sl)).cpu()
        self.model.train(was_training)
        release_memory()
        return {"values": out}

    def update_critic(self, batch: DataBatch) -> dict[str, float]:
        """Value-loss epochs over mini-batches over micro-batches (verl's dp_critic), scaled like the actor's
        update so that any number of ranks and micro-batches gives one process's gradient. Needs ``values``
        (the old ones, for the clip) and ``returns``; rows with ``is_pad`` = 1 carry no loss. Returns verl's
        critic metrics, averaged over mini-batches and epochs, equal on every rank."""
        if self.optimizer is None:
            raise RuntimeError("update_critic needs init_model() called first")
        try:
            return self._update(batch)
        finally:
            release_memory()

    def _update(self, batch: DataBatch) -> dict[str, float]:
        c = self.cfg.value
        missing = [k for k in ("values", "returns", "response_mask", "input_ids") if k not in batch.tensors]
        if missing:
            raise ValueError(f"update_critic: batch lacks {missing} (compute values and GAE returns first)")
        mini_rows = int(batch.meta.get("mini_batch_rows_per_rank", max(1, self.cfg.mini_batch_rows // self.world_size)))
        epochs, micro_size = int(c.ppo_epochs), int(c.ppo_micro_batch_size_per_gpu)
        clip, mode, grad_clip = float(c.cliprange_value), c.loss_agg_mode, float(c.grad_clip)
        scale_factor = batch.meta.get("max_response_length")
        lr = float(self.lr_scheduler.get_last_lr()[0])
        dev = self.device

        self.model.train()
        sums = dict.fromkeys(CRITIC_METRIC_KEYS, 0.0)
        n_updates = 0
        for _ in range(epochs):
            for rows in mini_batch_indices(batch, mini_rows):
                mb = batch.index(rows)
                real_rows = 1 - mb["is_pad"].float() if "is_pad" in mb.tensors else torch.ones(len(mb))
                resp_mask = mb["response_mask"].float() * real_rows.unsqueeze(-1)
                agg = global_batch_info(self, resp_mask, real_rows, scale_factor)
                self.optimizer.zero_grad(set_to_none=True)
                local = torch.zeros(3, dtype=torch.float64)  # [vf_loss, clipfrac·tok, vpred·tok]
                for sl in split_rows(len(mb), micro_size):
                    micro = mb.index(sl)
                    mask = resp_mask[sl].to(dev)
                    vpreds = self.values(micro)
                    vf_loss, clipfrac = core_algos.compute_value_loss(
                        vpreds=vpreds, returns=micro["returns"].to(dev), values=micro["values"].to(dev),
                        response_mask=mask, cliprange_value=clip, loss_agg_mode=mode, **agg)
                    vf_loss.backward()
                    n_tok = float(mask.sum())
                    local += torch.tensor([float(vf_loss.detach()), float(clipfrac) * n_tok,
                                           float((vpreds.detach() * mask).sum())], dtype=torch.float64)
                grad_norm = self.clip_and_step(grad_clip)
                tot = self.all_reduce_sum(local)
                per_tok = max(agg["batch_num_tokens"], 1.0)
                sums["critic/vf_loss"] += float(tot[0]) / self.world_size  # each rank's loss is scaled by it
                sums["critic/vf_clipfrac"] += float(tot[1]) / per_tok
                sums["critic/vpred_mean"] += float(tot[2]) / per_tok
                sums["critic/grad_norm"] += float(grad_norm)
                n_updates += 1
        self.optimizer.zero_grad(set_to_none=True)  # free the gradient shard until the next update
        self.lr_scheduler.step()
        metrics = {k: v / max(1, n_updates) for k, v in sums.items()}
        metrics["critic/lr"] = lr
        return metrics

    def save_checkpoint(self, critic_dir: str, contents: list[str] | None = None) -> None:
        """Sharded value model, optimizer, scheduler and RNG into ``critic_dir`` (the actor's format). Collective."""
        from arpo.trainer.checkpoint import save_sharded

        save_sharded(self, critic_dir, [c for c in (contents or ["model", "optimizer", "extra"]) if c != "hf_model"])
