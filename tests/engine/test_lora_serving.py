"""``actor_rollout_ref.rollout.lora_serving`` is resolved once, at start-up validation, into the config itself and
logged once; the engine config, the trainer and the memory plan read that decision instead of resolving again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import arpo.engine.config
import arpo.engine.lora_serving as lora_serving
from arpo.engine.config import EngineConfig
from arpo.engine.lora_serving import describe, lora_serving_from_cfg, resolve_lora_serving_in_cfg

QWEN7B = Path(__file__).parents[1] / "fixtures" / "models" / "qwen2.5-7b"


def _cfg(model_dir: Path, rank: int, serving: str | None):
    return OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(model_dir), "lora_rank": rank},
                                                   "rollout": {"name": "vllm", "lora_serving": serving,
                                                               "sleep_level": 1}}})


def _no_second_resolution(*args, **kwargs):
    raise AssertionError("lora_serving resolved again after start-up")


@pytest.mark.parametrize("device,expect", [("cuda", "adapter"), ("cpu", "merged")])
def test_null_is_resolved_once_into_the_config_and_read_as_it_is(tmp_path, monkeypatch, caplog, device, expect):
    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: device)
    cfg = _cfg(tmp_path, 8, None)
    with caplog.at_level(logging.INFO, logger=lora_serving.__name__):
        assert resolve_lora_serving_in_cfg(cfg) == expect
    assert cfg.actor_rollout_ref.rollout.lora_serving == expect
    assert [r.getMessage() for r in caplog.records] == [f"{describe(expect)}; null resolved for this machine"]
    # the readers take the decision as it is: even a process on the other kind of device reads the same value
    caplog.clear()
    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: "cpu" if device == "cuda" else "cuda")
    monkeypatch.setattr(lora_serving, "resolve_lora_serving", _no_second_resolution)
    with caplog.at_level(logging.INFO, logger=lora_serving.__name__):
        assert lora_serving_from_cfg(cfg) == expect
        assert EngineConfig.from_cfg(cfg).lora_rank == (8 if expect == "adapter" else 0)
    assert not caplog.records  # logged once, at resolution


def test_without_lora_nothing_is_decided_or_logged(tmp_path, caplog):
    cfg = _cfg(tmp_path, 0, "adapter")
    with caplog.at_level(logging.INFO, logger=lora_serving.__name__):
        assert resolve_lora_serving_in_cfg(cfg) is None
    assert cfg.actor_rollout_ref.rollout.lora_serving is None and not caplog.records
    assert EngineConfig.from_cfg(cfg).lora_rank == 0


def test_an_unresolved_config_is_still_resolved_for_its_reader(tmp_path, monkeypatch):
    """Configs that never went through start-up (benches, tests, ``python -m arpo.plan``) keep null's meaning."""
    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: "cpu")
    cfg = _cfg(tmp_path, 8, None)
    assert lora_serving_from_cfg(cfg) == "merged"
    assert lora_serving_from_cfg(cfg, "cuda") == "adapter"  # the planner's GPU plan
    assert cfg.actor_rollout_ref.rollout.lora_serving is None  # reading decides nothing for the run


def test_the_memory_plan_reads_the_start_up_decision(monkeypatch):
    """A run resolved on a CPU machine serves merged weights, and its plan says so even when drawn for a GPU."""
    from arpo.config import load_config
    from arpo.plan import build_plan

    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: "cpu")
    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={QWEN7B}", "actor_rollout_ref.model.lora_rank=8"])
    resolve_lora_serving_in_cfg(cfg)
    monkeypatch.setattr(lora_serving, "resolve_lora_serving", _no_second_resolution)
    plan = build_plan(cfg, 80 * 2**30)
    assert (plan.settings.lora_serving, plan.settings.engine_lora, plan.engine.lora) == ("merged", None, 0)


def test_start_up_validation_resolves_and_logs_it_once(tiny_model_dir, synthetic_dir, monkeypatch, caplog):
    from arpo.config import load_config
    from arpo.main_arpo import validate_config

    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: "cpu")
    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={tiny_model_dir}",
                                       f"synthetic.out_dir={synthetic_dir}", "actor_rollout_ref.model.lora_rank=4"])
    with caplog.at_level(logging.INFO):
        validate_config(cfg)
    assert cfg.actor_rollout_ref.rollout.lora_serving == "merged"
    assert sum(describe("merged") in r.getMessage() for r in caplog.records) == 1
