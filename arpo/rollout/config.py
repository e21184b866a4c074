"""``actor_rollout_ref.rollout.arpo.*``: the rollout's typed config, validated once at start-up (every key is
documented in ``configs/rollout/arpo.yaml``).

The section has a few top-level keys (mode, policy, budget) and one sub-section per concern, each a dataclass
below: ``branching`` (ARPO's fork rule), ``entropy`` (its measurement), ``aepo`` and ``tree_grpo`` (those
policies' own keys), ``schedule`` (fills and who gets contended slots), ``sampling`` and ``tools``. Keys may be
given nested, as in the YAML, or dotted (``branching.timing``), as on the command line."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from arpo.protocol import CALL_FORMATS
from arpo.rollout.branch_slots import GRANTS
from arpo.rollout.branching import INITIAL_ENTROPY_SCOPES, REDUCTIONS, RULES, TIMINGS

CONFIG_PREFIX = "actor_rollout_ref.rollout.arpo"
MODES = ("arpo", "single")
FILLS = ("fresh", "released", "duplicate")
SCHEDULES = ("async", "rounds")


class _Checker:
    """Collects nothing: raises the first failed check as one line naming the full key and the fix."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, ok: bool, key: str, value: Any, fix: str) -> None:
        if not ok:
            raise ValueError(f"{self.prefix}.{key}={value!r}: {fix}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclass
class BranchRuleConfig:
    """``branching``: when a trajectory forks after a tool result (policies arpo and aepo)."""

    rule: str = "code"
    timing: str = "code"
    beam_size: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    paper_alpha: float = 0.5
    paper_beta: float = 0.2
    paper_tau: float = 0.5

    def validate(self, need: _Checker) -> None:
        need(self.rule in RULES, "rule", self.rule, f"use one of {RULES}")
        need(self.timing in TIMINGS, "timing", self.timing, f"use one of {TIMINGS}")
        need(_int(self.beam_size, 1), "beam_size", self.beam_size, "use an integer >= 1 (1 disables branching)")
        need(_number(self.branch_probability) and 0 <= self.branch_probability <= 1, "branch_probability",
             self.branch_probability, "use a probability in [0, 1]")
        for key in ("entropy_weight", "paper_alpha", "paper_beta", "paper_tau"):
            need(_number(getattr(self, key)), key, getattr(self, key), "use a finite number")


@dataclass
class EntropyConfig:
    """``entropy``: how the window entropy that branching compares is measured."""

    window: int = 20
    topk_logprobs: int = 10
    reduction: str = "mean"
    initial_scope: str = "trajectory"
    vocab_size: int | None = None

    def validate(self, need: _Checker) -> None:
        need(_int(self.window, 1), "window", self.window, "use an integer >= 1 (tokens measured; ARPO uses 20)")
        need(_int(self.topk_logprobs, 1), "topk_logprobs", self.topk_logprobs, "use an integer >= 1 (ARPO uses 10)")
        need(self.reduction in REDUCTIONS, "reduction", self.reduction, f"use one of {REDUCTIONS}")
        need(self.initial_scope in INITIAL_ENTROPY_SCOPES, "initial_scope", self.initial_scope,
             f"use one of {INITIAL_ENTROPY_SCOPES}")
        need(self.vocab_size is None or _int(self.vocab_size, 2), "vocab_size", self.vocab_size,
             "leave null (tokenizer length) or give an integer >= 2")


@dataclass
class AepoConfig:
    """``aepo``: AEPO's keys (policy aepo; its fork rule is ``branching``'s, damped)."""

    penalty: float = 0.05
    pre_monitoring: bool = False
    beta: float = 0.5

    def validate(self, need: _Checker) -> None:
        need(_number(self.penalty) and self.penalty >= 0, "penalty", self.penalty,
             "use a number >= 0 (AEPO's released code: 0.05)")
        need(isinstance(self.pre_monitoring, bool), "pre_monitoring", self.pre_monitoring, "use true or false")
        need(_number(self.beta) and self.beta > 0, "beta", self.beta, "use a number > 0 (AEPO's released code: 0.5)")


@dataclass
class TreeGrpoConfig:
    """``tree_grpo``: Tree-GRPO's keys (policy tree_grpo)."""

    expansions: int = 2

    def validate(self, need: _Checker) -> None:
        need(_int(self.expansions, 1), "expansions", self.expansions,
             "use an integer >= 1 (Tree-GRPO's N; its scripts: 2)")


@dataclass
class ScheduleConfig:
    """``schedule``: the order work runs in and how groups short of M are filled (never what a seed's batch
    holds, except ``fill``)."""

    mode: str = "async"
    branch_grant: str = "ordered"
    speculative_forks: bool = True
    fill: str = "fresh"
    speculative_fill: int = 0
    fill_probability: float | None = 0.35

    def validate(self, need: _Checker) -> None:
        need(self.mode in SCHEDULES, "mode", self.mode, f"use one of {SCHEDULES}")
        need(self.branch_grant in GRANTS, "branch_grant", self.branch_grant, f"use one of {GRANTS}")
        need(isinstance(self.speculative_forks, bool), "speculative_forks", self.speculative_forks,
             "use true or false")
        need(self.fill in FILLS, "fill", self.fill, f"use one of {FILLS}")
        need(_int(self.speculative_fill, 0), "speculative_fill", self.speculative_fill,
             "use an integer >= 0 (0: off)")
        need(self.speculative_fill == 0 or self.fill == "fresh", "speculative_fill", self.speculative_fill,
             "needs schedule.fill=fresh (duplicates cannot be speculated)")
        p = self.fill_probability
        need(p is None or (_number(p) and 0 < p <= 1), "fill_probability", p,
             "give a probability in (0, 1], or null (off)")


@dataclass
class SamplingConfig:
    """``sampling``: the engine's sampling parameters and the response length."""

    max_response_length: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    extra_stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self, need: _Checker) -> None:
        need(_int(self.max_response_length, 1), "max_response_length", self.max_response_length,
             "use an integer >= 1")
        need(_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "use a number >= 0")
        need(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "use a number in (0, 1]")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
             "use -1 (off) or an integer >= 1")
        need(_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             self.repetition_penalty, "use a number > 0 (1.0: off)")


@dataclass
class ToolsConfig:
    """``tools``: how tool calls run (one executor for every rollout mode, so identical result tokens)."""

    call_limit: int = 3
    workers: int = 64
    timeout_s: float = 120.0
    retries: int = 3
    retry_on_empty: bool = True
    max_result_chars: int | None = None
    format: str = "tags"

    def validate(self, need: _Checker) -> None:
        need(self.format in CALL_FORMATS, "format", self.format,
             f"use one of {CALL_FORMATS} (tags: <search>q</search>; hermes: <tool_call>{{json}}</tool_call>, which "
             f"needs a tokenizer with a chat template)")
        need(_int(self.call_limit, 0), "call_limit", self.call_limit, "use an integer >= 0")
        need(_int(self.workers, 1), "workers", self.workers, "use an integer >= 1")
        need(_number(self.timeout_s) and self.timeout_s > 0, "timeout_s", self.timeout_s, "use a number > 0")
        need(_int(self.retries, 0), "retries", self.retries, "use an integer >= 0")
        need(self.max_result_chars is None or _int(self.max_result_chars, 1), "max_result_chars",
             self.max_result_chars, "leave null (no limit) or give an integer >= 1")


SECTIONS: dict[str, type] = {"branching": BranchRuleConfig, "entropy": EntropyConfig, "aepo": AepoConfig,
                             "tree_grpo": TreeGrpoConfig, "schedule": ScheduleConfig, "sampling": SamplingConfig,
                             "tools": ToolsConfig}


@dataclass
class ARPORolloutConfig:
    """``actor_rollout_ref.rollout.arpo.*`` (every key is documented in ``configs/rollout/arpo.yaml``)."""

    mode: str = "arpo"
    policy: str = "arpo"
    n: int = 16
    initial_rollouts: int = 8
    seed: int = 0
    return_entropy: bool = False
    calculate_log_probs: bool = False
    show_progress: bool = False
    branching: BranchRuleConfig = field(default_factory=BranchRuleConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    aepo: AepoConfig = field(default_factory=AepoConfig)
    tree_grpo: TreeGrpoConfig = field(default_factory=TreeGrpoConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None) -> "ARPORolloutConfig":
        """Build from a dict or OmegaConf node, nested or with dotted keys; an unknown key is an error naming it
        and the known ones."""
        return cls._build(_nest(_plain(cfg or {})))

    def updated(self, values: Mapping[str, Any]) -> "ARPORolloutConfig":
        """A validated copy with ``values`` (nested or dotted keys) replacing this config's."""
        return self._build(_nest(dataclasses.asdict(self), _plain(values)))

    @classmethod
    def _build(cls, values: dict[str, Any]) -> "ARPORolloutConfig":
        _reject_unknown(values, {f.name for f in dataclasses.fields(cls)}, CONFIG_PREFIX)
        sections = {}
        for name, section in SECTIONS.items():
            given = values.pop(name, None) or {}
            if not isinstance(given, Mapping):
                if RENAMED.get(name):
                    raise ValueError(f"{CONFIG_PREFIX}.{name}={given!r}: {name} is now a section; the value goes to "
                                     f"{CONFIG_PREFIX}.{RENAMED[name]}")
                raise ValueError(f"{CONFIG_PREFIX}.{name}={given!r}: give a mapping of its keys "
                                 f"{sorted(f.name for f in dataclasses.fields(section))}")
            _reject_unknown(given, {f.name for f in dataclasses.fields(section)}, f"{CONFIG_PREFIX}.{name}")
            sections[name] = section(**given)
        return cls(**values, **sections).validate()

    def validate(self) -> "ARPORolloutConfig":
        need = _Checker(CONFIG_PREFIX)
        need(self.mode in MODES, "mode", self.mode, f"use one of {MODES}")
        from arpo.rollout.policies import get_policy_class  # policies.py imports this module

        get_policy_class(self.policy)  # a registered name or an importable "module:ClassName", else one error line
        need(_int(self.n, 1), "n", self.n, "the per-prompt budget M must be an integer >= 1")
        need(_int(self.initial_rollouts, 1), "initial_rollouts", self.initial_rollouts, "use an integer >= 1")
        need(self.mode == "single" or self.initial_rollouts <= self.n, "initial_rollouts", self.initial_rollouts,
             f"the initial rollouts N cannot exceed the budget M ({CONFIG_PREFIX}.n={self.n}); lower "
             f"initial_rollouts or raise n (ARPO uses N = M/2)")
        need(self.mode == "single" or self.policy != "tree_grpo" or self.n % self.initial_rollouts == 0,
             "n", self.n, f"policy tree_grpo grows initial_rollouts ({self.initial_rollouts}) trees of "
                          f"n / initial_rollouts trajectories each: use a multiple of initial_rollouts")
        for name in SECTIONS:
            getattr(self, name).validate(_Checker(f"{CONFIG_PREFIX}.{name}"))
        need(not self.aepo.pre_monitoring or self.policy == "aepo", "aepo.pre_monitoring", True,
             f"true only with {CONFIG_PREFIX}.policy=aepo (else false)")
        return self

    @property
    def num_initial(self) -> int:
        return self.n if self.mode == "single" else self.initial_rollouts

    @property
    def branching_enabled(self) -> bool:
        """Entropy-driven forks after tool results (ARPO, AEPO); Tree-GRPO expands its trees instead."""
        return self.mode == "arpo" and self.branching.beam_size > 1 and self.policy != "tree_grpo"

    @property
    def pre_monitoring(self) -> bool:
        """AEPO's entropy pre-monitoring sets each group's number of roots from a probe trajectory."""
        return self.mode == "arpo" and self.policy == "aepo" and self.aepo.pre_monitoring


#: keys of the flat section before the sub-sections (2026-11): a config written for it gets the new name
RENAMED = {
    "aepo_penalty": "aepo.penalty", "aepo_pre_monitoring": "aepo.pre_monitoring", "aepo_beta": "aepo.beta",
    "tree_expansions": "tree_grpo.expansions", "schedule": "schedule.mode", "branch_grant": "schedule.branch_grant",
    "fill": "schedule.fill", "speculative_fill": "schedule.speculative_fill",
    "speculative_fill_probability": "schedule.fill_probability", "entropy_window": "entropy.window",
    "topk_logprobs": "entropy.topk_logprobs", "entropy_reduction": "entropy.reduction",
    "initial_entropy_scope": "entropy.initial_scope", "vocab_size": "entropy.vocab_size",
    "tool_call_limit": "tools.call_limit", "tool_workers": "tools.workers", "tool_timeout_s": "tools.timeout_s",
    "tool_retries": "tools.retries", "retry_on_empty": "tools.retry_on_empty",
    "max_result_chars": "tools.max_result_chars",
    **{k: f"branching.{k}" for k in ("rule", "timing", "beam_size", "branch_probability", "entropy_weight",
                                     "paper_alpha", "paper_beta", "paper_tau")},
    **{k: f"sampling.{k}" for k in ("max_response_length", "temperature", "top_p", "top_k", "repetition_penalty",
                                    "extra_stop", "stop_token_ids")},
}


def _plain(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    if hasattr(cfg, "items") and not isinstance(cfg, dict):  # an OmegaConf node
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def _nest(*cfgs: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys (``branching.timing``) into nested dicts; later mappings win, key by key within a section."""
    out: dict[str, Any] = {}
    for cfg in cfgs:
        for key, value in cfg.items():
            *parents, leaf = str(key).split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ValueError(f"{CONFIG_PREFIX}.{p}: a section, but a value was given for it")
            if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
                node[leaf].update(_nest(value))
            else:
                node[leaf] = _nest(value) if isinstance(value, Mapping) else value
    return out


def _reject_unknown(values: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(set(values) - known)
    if not unknown:
        return
    key = unknown[0]
    moved = RENAMED.get(key) if prefix == CONFIG_PREFIX else None
    if moved:
        raise ValueError(f"{prefix}.{key}: renamed to {prefix}.{moved} (the section has one sub-section per "
                         f"concern, configs/rollout/arpo.yaml)")
    raise ValueError(f"{prefix}: unknown key(s) {unknown}; known keys: {sorted(known)}")
