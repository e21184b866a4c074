"""configs/rollout/arpo.yaml documents exactly the generator's config, with the same defaults."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from arpo.rollout.config import SECTIONS, ARPORolloutConfig

YAML = Path(__file__).resolve().parents[2] / "configs" / "rollout" / "arpo.yaml"


def test_yaml_documents_every_key_with_the_dataclass_defaults():
    text = YAML.read_text()
    assert text.startswith("# @package actor_rollout_ref.rollout.arpo")
    loaded = yaml.safe_load(text)
    defaults = dataclasses.asdict(ARPORolloutConfig())
    assert loaded == defaults
    lines = text.splitlines()
    for key, value in defaults.items():  # every key is explained on its line, section keys under their section
        start = lines.index(next(ln for ln in lines if ln.startswith(f"{key}:")))
        assert "#" in lines[start], key
        for sub in value if isinstance(value, dict) else ():
            assert "#" in next(ln for ln in lines[start:] if ln.startswith(f"  {sub}:")), f"{key}.{sub}"
    cfg = ARPORolloutConfig.from_dict(loaded)
    assert cfg.num_initial == 8 and cfg.entropy.window == 20 and cfg.entropy.reduction == "mean"


def test_each_section_has_at_most_eight_keys():
    # the bound: a policy's own keys fit on one screen (top level: the mode, policy and budget)
    sizes = {name: len(dataclasses.fields(section)) for name, section in SECTIONS.items()}
    top = [f.name for f in dataclasses.fields(ARPORolloutConfig) if f.name not in SECTIONS]
    assert max(sizes.values()) <= 8 and len(top) <= 8, (sizes, top)
    assert sizes["aepo"] == 3 and sizes["tree_grpo"] == 1 and sizes["branching"] == 8


def test_nested_and_dotted_keys_give_the_same_config_and_updates_keep_the_rest():
    nested = ARPORolloutConfig.from_dict({"n": 4, "initial_rollouts": 2, "branching": {"rule": "paper"},
                                          "tools": {"call_limit": 1}})
    dotted = ARPORolloutConfig.from_dict({"n": 4, "initial_rollouts": 2, "branching.rule": "paper",
                                          "tools.call_limit": 1})
    assert nested == dotted and nested.branching.timing == "code"
    updated = nested.updated({"branching.timing": "paper", "sampling": {"temperature": 0.5}})
    assert (updated.branching.rule, updated.branching.timing, updated.sampling.temperature,
            updated.tools.call_limit) == ("paper", "paper", 0.5, 1)
    assert nested.branching.timing == "code"  # a copy


@pytest.mark.parametrize("values, message", [
    ({"entropy_window": 3}, "arpo.entropy_window: renamed to actor_rollout_ref.rollout.arpo.entropy.window"),
    ({"schedule": "rounds"}, "schedule is now a section; the value goes to actor_rollout_ref.rollout.arpo.schedule.mode"),
    ({"branching.rul": "x"}, "arpo.branching: unknown key(s) ['rul']; known keys: ['beam_size'"),
    ({"branching.rule": "x"}, "arpo.branching.rule='x': use one of ('code', 'paper')"),
    ({"tools": 3}, "arpo.tools=3: give a mapping of its keys"),
    ({"aepo.pre_monitoring": True}, "arpo.aepo.pre_monitoring=True: true only with actor_rollout_ref.rollout.arpo"
                                    ".policy=aepo"),
    ({"sampling.top_k": 0}, "arpo.sampling.top_k=0: use -1 (off) or an integer >= 1"),
    # the branching decision's keys (read by arpo/rollout/branching.py, which trusts these checks)
    ({"policy": "tree"}, "arpo.policy='tree': use one of ('arpo', 'aepo', 'tree_grpo')"),
    ({"branching.timing": "x"}, "arpo.branching.timing='x': use one of ('code', 'paper')"),
    ({"branching.beam_size": 0}, "arpo.branching.beam_size=0: use an integer >= 1"),
    ({"branching.branch_probability": 1.5}, "arpo.branching.branch_probability=1.5: use a probability in [0, 1]"),
    ({"branching.entropy_weight": math.nan}, "arpo.branching.entropy_weight=nan: use a finite number"),
    ({"branching.paper_tau": "0.5"}, "arpo.branching.paper_tau='0.5': use a finite number"),
    ({"entropy.window": 0}, "arpo.entropy.window=0: use an integer >= 1"),
    ({"entropy.topk_logprobs": 0}, "arpo.entropy.topk_logprobs=0: use an integer >= 1"),
    ({"entropy.reduction": "avg"}, "arpo.entropy.reduction='avg': use one of ('mean', 'sum')"),
    ({"entropy.initial_scope": "global"}, "arpo.entropy.initial_scope='global': use one of"),
    ({"aepo.penalty": -0.1}, "arpo.aepo.penalty=-0.1: use a number >= 0"),
])
def test_a_bad_key_or_value_is_one_line_naming_the_full_key(values, message):
    with pytest.raises(ValueError) as err:
        ARPORolloutConfig.from_dict(values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_from_omegaconf_node():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"n": 4, "initial_rollouts": 2, "sampling": {"extra_stop": ["</answer>"]}})
    cfg = ARPORolloutConfig.from_dict(node)
    assert cfg.n == 4 and cfg.sampling.extra_stop == ["</answer>"] and isinstance(cfg.sampling.extra_stop, list)
