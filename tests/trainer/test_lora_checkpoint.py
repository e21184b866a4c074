"""LoRA checkpoints hold the adapters only and resume exactly on a base reloaded from the model path; the HF export
carries the adapter in peft's layout beside the merged model."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.trainer.workers_helpers import (add_training_columns, base_config, max_abs_diff,  # noqa: F401
                                           one_process_group, random_batch, small_model)

CONTENTS = ["model", "optimizer", "extra"]


def _cfg(model_dir, rank: int = 4) -> dict:
    cfg = base_config(model_dir, world=1)
    cfg["actor_rollout_ref"]["model"].update(dtype="float32", lora_rank=rank, lora_alpha=8)
    # a warm-up: the scheduler's position must come back too
    cfg["actor_rollout_ref"]["actor"]["optim"].update(warmup_style="cosine", lr_warmup_steps=2, total_training_steps=5)
    return cfg


def _worker(cfg: dict):
    from arpo.trainer.fsdp_worker import ActorWorker

    worker = ActorWorker(cfg, "actor", 0, 1)
    worker.init_model()
    return worker


def _params(worker) -> dict[str, torch.Tensor]:
    # in one process a gathered parameter may be the shard's own storage, which FSDP2 frees and reuses
    return {n: t.clone() for n, t in worker.full_parameters().items()}


def _train(worker, seed: int):
    batch = random_batch(8, seed=seed)
    return add_training_columns(batch, worker.compute_log_prob(batch)["log_probs"], seed=seed + 1)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_lora_checkpoint_holds_adapters_only_and_resumes_exactly(small_model, one_process_group, tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = _cfg(small_model)
    worker = _worker(cfg)
    train1, train2 = _train(worker, 21), _train(worker, 31)
    worker.update_policy(train1)
    worker.update_policy(train1)
    worker.save_checkpoint(str(tmp_path / "lora"), CONTENTS)
    saved = _params(worker)
    m3 = worker.update_policy(train2)
    params3 = _params(worker)

    keys = list(dcp.FileSystemReader(str(tmp_path / "lora")).read_metadata().state_dict_metadata)
    weights = [k for k in keys if k.startswith(("model.", "optim.state."))]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    plain = _worker(_cfg(small_model, rank=0))  # the same contents of a full fine-tuning run
    plain.save_checkpoint(str(tmp_path / "full"), CONTENTS)
    assert _bytes(tmp_path / "lora") * 4 < _bytes(tmp_path / "full")

    # a restart: the base from the model path, the adapters (A from trainer.seed, B zero) replaced by the checkpoint's
    resumed = _worker(cfg)
    assert max_abs_diff(_params(resumed), saved) > 0
    resumed.load_checkpoint(str(tmp_path / "lora"))
    assert max_abs_diff(_params(resumed), saved) == 0.0
    m3_resumed = resumed.update_policy(train2)
    # adapters, AdamW moments, scheduler position and RNG restored: the next update is the same to the bit
    assert max_abs_diff(_params(resumed), params3) == 0.0
    assert m3_resumed["actor/lr"] == m3["actor/lr"]
    assert m3_resumed["actor/pg_loss"] == m3["actor/pg_loss"]


def test_lora_and_full_checkpoints_refuse_the_other_kind_of_worker(small_model, one_process_group, tmp_path):
    import pytest

    lora, full = _worker(_cfg(small_model)), _worker(_cfg(small_model, rank=0))
    lora.save_checkpoint(str(tmp_path / "lora"), ["model"])
    full.save_checkpoint(str(tmp_path / "full"), ["model"])
    with pytest.raises(ValueError, match="holds LoRA adapters only"):
        full.load_checkpoint(str(tmp_path / "lora"))
    with pytest.raises(ValueError, match="holds a full model written without LoRA"):
        lora.load_checkpoint(str(tmp_path / "full"))
    full.load_checkpoint(str(tmp_path / "full"))  # each kind still loads its own
    lora.load_checkpoint(str(tmp_path / "lora"))


def test_lora_hf_export_has_a_peft_adapter_beside_the_merged_model(small_model, one_process_group, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from arpo.trainer.logprobs import compute_logprobs_and_entropy

    worker = _worker(_cfg(small_model))
    worker.update_policy(_train(worker, 41))
    batch = random_batch(8, seed=43)
    adapted = worker.compute_log_prob(batch)["log_probs"]
    out = Path(worker.export_hf(str(tmp_path / "hf")))
    assert (out / "model.safetensors").exists() or list(out.glob("model*.safetensors"))
    adapter = out / "lora_adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}

    def log_probs(model) -> torch.Tensor:
        with torch.no_grad():
            lp, _ = compute_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"],
                                                 batch["position_ids"], batch["responses"].shape[1], pack=False)
        return lp * batch["response_mask"]

    base = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
    base_lp = log_probs(base)
    peft_lp = log_probs(PeftModel.from_pretrained(base, str(adapter)).get_base_model().eval())
    assert torch.allclose(peft_lp, adapted * batch["response_mask"], atol=1e-5)
    assert not torch.allclose(peft_lp, base_lp, atol=1e-4)  # the adapter is what moves them
