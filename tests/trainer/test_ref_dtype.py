"""The frozen reference policy is kept in the compute dtype (bf16 under mixed precision, as verl keeps it), not in
fp32 master weights like the trained actor; its log-probs still come out in fp32 and close to the fp32 model's."""

from __future__ import annotations

import pytest
import torch

from arpo.trainer.device import fast_dtype
from tests.trainer.test_fsdp_update import _hf_log_probs
from tests.trainer.workers_helpers import base_config, one_process_group, random_batch, small_model  # noqa: F401

pytestmark = pytest.mark.slow


def _config(model_dir, dtype: str) -> dict:
    cfg = base_config(model_dir, world=1)
    cfg["actor_rollout_ref"]["model"]["dtype"] = dtype
    return cfg


def _log_probs(cfg: dict, role: str, batch) -> tuple[set[torch.dtype], torch.Tensor]:
    """The parameter dtypes of one in-process rank of ``role`` and its log-probs of ``batch``."""
    from arpo.trainer.worker_group import LocalWorkerGroup

    group = LocalWorkerGroup(cfg, role)
    try:
        dtypes = {p.dtype for p in group.worker.model.parameters()}
        return dtypes, group.compute_log_prob(batch, calc_entropy=False)["log_probs"]
    finally:
        group.shutdown()


def test_bf16_reference_is_bf16_and_its_log_probs_agree_with_fp32(small_model, one_process_group):  # noqa: F811
    """dtype=bfloat16 on CPU: the reference's parameters are bf16 (the actor's stay fp32 master weights), and its
    fp32 log-probs are within two bf16 roundings (u = 2^-8) of the largest logit of the fp32 model's, the bound
    the bf16 actor meets (tests/trainer/test_fsdp_update.py)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(small_model, "bfloat16")
    batch = random_batch(8, seed=11, system=20)  # a shared system prompt: the fast layout's shared-prefix pass too
    batch.meta["temperature"] = 0.7
    ref_dtypes, ref = _log_probs(cfg, "ref", batch)
    actor_dtypes, actor = _log_probs(cfg, "actor", batch)
    assert ref_dtypes == {torch.bfloat16}
    assert actor_dtypes == {torch.float32}
    assert ref.dtype == torch.float32

    model = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
    with torch.no_grad():
        max_logit = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                position_ids=batch["position_ids"]).logits.abs().max()) / 0.7
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    exact = _hf_log_probs(small_model, batch, temperature=0.7)
    err = float((ref - exact)[valid].abs().max())
    print(f"bf16 reference vs fp32: max |dlogp| {err:.3g} (bound {2 * 2.0 ** -8 * max_logit:.3g}); bf16 actor "
          f"{float((actor - exact)[valid].abs().max()):.3g}")
    assert 0 < err <= 2 * 2.0 ** -8 * max_logit
    assert bool((ref[~valid] == 0).all())


@pytest.mark.parametrize("dtype", ["float32", "fast"])
def test_reference_dtype_is_the_resolved_compute_dtype(small_model, one_process_group, dtype):  # noqa: F811
    """float32 keeps an fp32 reference with the fp32 model's log-probs; ``fast`` gives bf16 on a CPU with native bf16
    (avx512_bf16/AMX) and float32 elsewhere, and the reference follows."""
    expected = torch.float32 if dtype == "float32" else fast_dtype("cpu")
    batch = random_batch(5, seed=5)
    dtypes, ref = _log_probs(_config(small_model, dtype), "ref", batch)
    assert dtypes == {expected}
    if expected == torch.float32:
        assert torch.allclose(ref, _hf_log_probs(small_model, batch), atol=1e-5)
