"""configs/rollout/arpo.yaml documents exactly the generator's config, with the same defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from arpo.rollout.config import ARPORolloutConfig

YAML = Path(__file__).resolve().parents[2] / "configs" / "rollout" / "arpo.yaml"


def test_yaml_documents_every_key_with_the_dataclass_defaults():
    text = YAML.read_text()
    assert text.startswith("# @package actor_rollout_ref.rollout.arpo")
    loaded = yaml.safe_load(text)
    defaults = dataclasses.asdict(ARPORolloutConfig())
    assert loaded == defaults
    for key in defaults:  # every key is explained on its line
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{key}:"))
        assert "#" in line, key
    cfg = ARPORolloutConfig.from_dict(loaded)
    assert cfg.num_initial == 8 and cfg.branching().window == 20


def test_from_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"n": 4, "initial_rollouts": 2, "extra_stop": ["</answer>"]})
    cfg = ARPORolloutConfig.from_dict(node)
    assert cfg.n == 4 and cfg.extra_stop == ["</answer>"] and isinstance(cfg.extra_stop, list)
