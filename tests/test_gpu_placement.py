"""GPU placement (arpo/runtime/placement.py): the plan's arithmetic, and real placement groups on a Ray cluster of logical
GPUs (no GPU needed): colocated ranks and engine share a GPU, split engines hold their own, a cluster too small is
one clear error. The trainer end to end on logical GPUs: tests/test_main_arpo.py (the DAPO run on two nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from arpo.config import REPO_ROOT
from arpo.runtime.placement import PlacementPlan


def plan(**kw) -> PlacementPlan:
    values = dict(roles=("actor", "ref"), nnodes=1, gpus_per_node=2, cpus_per_rank=1.0, replicas=1,
                  tensor_parallel=1, hybrid=True)
    return PlacementPlan(**{**values, **kw}).validate()


def test_colocated_bundles_hold_every_role_and_an_engine():
    p = plan(roles=("actor", "ref", "critic"))
    assert p.share == 0.25  # actor, ref, critic and the engine share each GPU
    assert p.training_bundles(0) == [{"GPU": 1.0, "CPU": 4.0}, {"GPU": 1.0, "CPU": 3.0}]  # the engine in bundle 0
    assert p.engine_bundles() == [] and p.gpus_needed() == 2
    assert plan(roles=("actor", "ref")).share == 0.3333  # three sharers: Ray counts GPU fractions to 1e-4


def test_split_engines_get_gpus_of_their_own():
    p = plan(hybrid=False, replicas=2, tensor_parallel=2)
    assert p.share == 0.5 and p.training_bundles(0) == [{"GPU": 1.0, "CPU": 2.0}] * 2
    assert p.engine_bundles() == [{"GPU": 2.0, "CPU": 1.0}] * 2 and p.gpus_needed() == 6


@pytest.mark.parametrize("kw, message", [
    ({"tensor_parallel": 2}, "hybrid_engine=true runs each engine replica in one training GPU's bundle, so "
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=2 cannot be placed"),
    ({"replicas": 3}, "actor_rollout_ref.rollout.num_replicas=3 colocated engine replicas need as many training GPUs"),
])
def test_a_plan_that_cannot_be_colocated_names_the_keys(kw, message):
    with pytest.raises(ValueError, match=message):
        plan(**kw)


PROBE = r"""
import json, sys
import ray
from ray.util.placement_group import placement_group
import arpo.runtime.placement as pl
from arpo.runtime.placement import GpuPlacement, PlacementPlan

ray.init(num_cpus=8, num_gpus=3, include_dashboard=False, log_to_driver=False)

@ray.remote
class Probe:
    def where(self):
        return [str(g) for g in ray.get_gpu_ids()]

def placed(hybrid):
    p = PlacementPlan(("actor", "ref"), 1, 2, 1.0, 1, 1, hybrid).validate()
    g = GpuPlacement(p, None)
    probes = {f"{role}{r}": Probe.options(**g.rank(r, 1.0).options()).remote() for role in p.roles for r in range(2)}
    probes["engine0"] = Probe.options(**g.engine(0).options()).remote()
    out = {k: ray.get(v.where.remote()) for k, v in probes.items()}
    for v in probes.values():
        ray.kill(v)
    g.remove()
    return {"gpus": out, "describe": g.describe()}

result = {"colocated": placed(True), "split": placed(False)}
from omegaconf import OmegaConf
from arpo.main_arpo import uses_gpu_placement
# trainer.device=cpu keeps a run's actors out of the GPUs even on a cluster that has them
result["uses"] = {d: uses_gpu_placement(OmegaConf.create({"trainer": {"device": d}})) for d in ("cpu", "auto", "cuda")}
try:  # 4 GPUs on a cluster of 3
    GpuPlacement(PlacementPlan(("actor",), 1, 4, 1.0, 1, 1, True), None)
except ValueError as e:
    result["too_few"] = str(e)
pl.READY_TIMEOUT_S = 2
try:  # enough GPUs in all, but another job holds 2 of the 3
    blocker = placement_group([{"GPU": 2.0}])
    ray.get(blocker.ready())
    GpuPlacement(PlacementPlan(("actor",), 1, 2, 1.0, 1, 1, True), None)
except ValueError as e:
    result["not_placed"] = str(e)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_placement_groups_on_logical_gpus():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_USAGE_STATS_ENABLED": "0",
                            "RAY_AUTH_MODE": "disabled"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    colocated, split = out["colocated"]["gpus"], out["split"]["gpus"]
    assert out["uses"] == {"cpu": False, "auto": True, "cuda": True}
    # colocated: rank r of each role on GPU r, the engine on rank 0's GPU; 3 logical GPUs, 2 used
    assert colocated["actor0"] == colocated["ref0"] == colocated["engine0"] and len(colocated["actor0"]) == 1
    assert colocated["actor1"] == colocated["ref1"] != colocated["actor0"]
    assert "colocated (hybrid engine)" in out["colocated"]["describe"]
    # split: the engine on the third GPU, alone
    assert split["actor0"] == split["ref0"] and split["actor1"] == split["ref1"] != split["actor0"]
    assert split["engine0"] not in (split["actor0"], split["actor1"]) and "split" in out["split"]["describe"]
    assert out["too_few"] == ("the Ray cluster has 3 GPU(s), fewer than the run's 4 GPUs (1 node(s) x 4 training "
                              "GPUs): add GPUs or lower trainer.n_gpus_per_node / "
                              "actor_rollout_ref.rollout.num_replicas")
    assert out["not_placed"].startswith("the Ray cluster could not place the run's 2 GPUs (1 node(s) x 2 training "
                                        "GPUs) within 2 s (free GPUs per node too few, or taken by other jobs)")


def _trainer_cfg(*overrides: str):
    from arpo.config import load_config

    return load_config("arpo_trainer", ["actor_rollout_ref.model.path=unused", *overrides])


@pytest.mark.parametrize("overrides, gpus, replicas, sleeps", [
    (["trainer.n_gpus_per_node=8"], True, 8, True),  # colocated on 8 GPUs: every GPU generates, and sleeps
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=4"], True, 8, True),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.hybrid_engine=false",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], True, 1, False),  # split: extra GPUs, 1 unless set
    (["trainer.n_gpus_per_node=8"], False, 1, False),  # no GPUs: one engine on the cores, no sleep mode
    (["trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.num_replicas=3",
      "actor_rollout_ref.rollout.free_cache_engine=false"], True, 3, False),  # set values stay
])
def test_auto_replicas_and_sleep_are_resolved_once_by_placement(overrides, gpus, replicas, sleeps, caplog):
    from arpo.runtime.placement import resolve_rollout_auto

    cfg = _trainer_cfg(*overrides)
    assert cfg.actor_rollout_ref.rollout.num_replicas is None or "num_replicas=3" in " ".join(overrides)
    with caplog.at_level("INFO", logger="arpo.runtime.placement"):
        assert resolve_rollout_auto(cfg, gpus) == {"num_replicas": replicas, "free_cache_engine": sleeps}
    r = cfg.actor_rollout_ref.rollout
    assert (r.num_replicas, r.free_cache_engine) == (replicas, sleeps)  # every later reader sees the numbers
    if "num_replicas=3" not in " ".join(overrides):
        assert f"num_replicas: null (auto) -> {replicas}" in caplog.text
    if gpus:
        p = PlacementPlan.from_config(cfg, ["actor"])
        assert p.replicas == replicas
        assert sum(b["CPU"] for n in range(p.nnodes) for b in p.training_bundles(n)) == \
            p.world_size + replicas * p.hybrid  # a colocated replica's CPU in each training GPU's bundle


def test_unresolved_auto_replicas_follow_the_placement():
    from arpo.runtime.placement import planned_num_replicas

    cfg = _trainer_cfg("trainer.n_gpus_per_node=4")
    assert PlacementPlan.from_config(cfg, ["actor"]).replicas == 4
    assert planned_num_replicas(cfg, gpus=False) == 1
    cfg.actor_rollout_ref.rollout.ray_actor = False  # an engine in the caller's process is one engine
    assert planned_num_replicas(cfg, gpus=True) == 1


def test_hybrid_tensor_parallel_is_still_refused_with_auto_replicas():
    cfg = _trainer_cfg("trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 cannot be placed"):
        PlacementPlan.from_config(cfg, ["actor"])
