"""Shutting down a rank that runs in the driver's process (LocalWorkerGroup: the cold-start SFT on one GPU) frees its
model and optimizer and then the CUDA cache, so the engine and actor the pipeline starts next get that memory."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from tests.trainer.workers_helpers import small_model  # noqa: F401

pytestmark = pytest.mark.slow


def test_local_sft_group_shutdown_frees_model_optimizer_and_cuda_cache(small_model, monkeypatch):  # noqa: F811
    from arpo.sft import worker_config
    from arpo.trainer.worker_group import LocalWorkerGroup

    s = {"num_ranks": 1, "num_threads": 1, "dtype": "float32", "device": "cpu", "seed": 0, "lr": 1e-3,
         "weight_decay": 0.0, "warmup_ratio": 0.1, "grad_clip": 1.0}
    group = LocalWorkerGroup(worker_config(s, small_model, 2), role="sft")
    ids = torch.randint(5, 400, (2, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    group.sft_step(ids, torch.ones_like(ids), labels)  # the optimizer now holds AdamW state beside the model
    worker = group.worker
    assert worker.optimizer.state
    model, optimizer = weakref.ref(worker.model), weakref.ref(worker.optimizer)

    emptied = []
    # CUDA as the driver has it after a GPU SFT: initialised, with the freed blocks still cached
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(model() is None and optimizer() is None))
    group.shutdown()

    assert not dist.is_initialized()
    assert model() is None and optimizer() is None  # gone on return: shutdown collected FSDP2's reference cycles
    assert emptied and all(emptied)  # the cache was emptied once they were gone, so their blocks went back
