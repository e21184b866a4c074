"""``actor_rollout_ref.rollout.arpo.*``: the rollout's typed config, validated once at start-up (every key is
documented in ``configs/rollout/arpo.yaml``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from arpo.rollout.branch_slots import GRANTS
from arpo.rollout.branching import BranchingConfig

CONFIG_PREFIX = "actor_rollout_ref.rollout.arpo"
MODES = ("arpo", "single")
FILLS = ("fresh", "released", "duplicate")
SCHEDULES = ("async", "rounds")


@dataclass
class ARPORolloutConfig:
    """``actor_rollout_ref.rollout.arpo.*`` (every key is documented in ``configs/rollout/arpo.yaml``)."""

    mode: str = "arpo"
    policy: str = "arpo"
    aepo_penalty: float = 0.05
    aepo_pre_monitoring: bool = False
    aepo_beta: float = 0.5
    tree_expansions: int = 2
    schedule: str = "async"
    branch_grant: str = "ordered"
    n: int = 16
    initial_rollouts: int = 8
    beam_size: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    rule: str = "code"
    timing: str = "code"
    paper_alpha: float = 0.5
    paper_beta: float = 0.2
    paper_tau: float = 0.5
    entropy_window: int = 20
    topk_logprobs: int = 10
    entropy_reduction: str = "mean"
    initial_entropy_scope: str = "trajectory"
    vocab_size: int | None = None
    tool_call_limit: int = 3
    max_response_length: int = 4096
    fill: str = "fresh"
    speculative_fill: int = 0
    speculative_fill_probability: float | None = 0.35
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    extra_stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    return_entropy: bool = False
    calculate_log_probs: bool = False
    tool_workers: int = 64
    tool_timeout_s: float = 120.0
    tool_retries: int = 3
    retry_on_empty: bool = True
    max_result_chars: int | None = None
    show_progress: bool = False

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None) -> "ARPORolloutConfig":
        """Build from a dict or OmegaConf node; an unknown key is an error naming it."""
        if cfg is None:
            return cls().validate()
        if hasattr(cfg, "items") and not isinstance(cfg, dict):
            try:
                from omegaconf import OmegaConf

                cfg = OmegaConf.to_container(cfg, resolve=True)
            except (ImportError, ValueError):
                cfg = dict(cfg)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"{CONFIG_PREFIX}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**cfg).validate()

    def validate(self) -> "ARPORolloutConfig":
        p = CONFIG_PREFIX

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.mode in MODES, f"{p}.mode={self.mode!r}: use one of {MODES}")
        need(self.schedule in SCHEDULES, f"{p}.schedule={self.schedule!r}: use one of {SCHEDULES}")
        need(self.branch_grant in GRANTS, f"{p}.branch_grant={self.branch_grant!r}: use one of {GRANTS}")
        need(isinstance(self.n, int) and self.n >= 1, f"{p}.n={self.n!r}: the per-prompt budget M must be >= 1")
        need(isinstance(self.initial_rollouts, int) and self.initial_rollouts >= 1,
             f"{p}.initial_rollouts={self.initial_rollouts!r}: must be >= 1")
        need(self.mode == "single" or self.initial_rollouts <= self.n,
             f"{p}.initial_rollouts ({self.initial_rollouts}) > {p}.n ({self.n}): the initial rollouts N cannot "
             f"exceed the budget M; lower initial_rollouts or raise n (ARPO uses N = M/2)")
        need(self.fill in FILLS, f"{p}.fill={self.fill!r}: use one of {FILLS}")
        need(isinstance(self.tree_expansions, int) and self.tree_expansions >= 1,
             f"{p}.tree_expansions={self.tree_expansions!r}: must be an integer >= 1 (Tree-GRPO's N; its scripts: 2)")
        need(self.mode == "single" or self.policy != "tree_grpo" or self.n % self.initial_rollouts == 0,
             f"{p}.n ({self.n}) is not a multiple of {p}.initial_rollouts ({self.initial_rollouts}): policy "
             f"tree_grpo grows initial_rollouts trees of n / initial_rollouts trajectories each")
        need(isinstance(self.aepo_pre_monitoring, bool) and (not self.aepo_pre_monitoring or self.policy == "aepo"),
             f"{p}.aepo_pre_monitoring={self.aepo_pre_monitoring!r}: true only with {p}.policy=aepo (else false)")
        need(isinstance(self.aepo_beta, (int, float)) and 0 < self.aepo_beta < float("inf"),
             f"{p}.aepo_beta={self.aepo_beta!r}: must be a number > 0 (AEPO's released code: 0.5)")
        need(isinstance(self.speculative_fill, int) and self.speculative_fill >= 0,
             f"{p}.speculative_fill={self.speculative_fill!r}: must be an integer >= 0 (0: off)")
        need(self.speculative_fill == 0 or self.fill == "fresh",
             f"{p}.speculative_fill={self.speculative_fill} needs {p}.fill=fresh (duplicates cannot be speculated)")
        sfp = self.speculative_fill_probability
        need(sfp is None or (isinstance(sfp, (int, float)) and 0 < sfp <= 1),
             f"{p}.speculative_fill_probability={sfp!r}: give a probability in (0, 1], or null (off)")
        need(isinstance(self.tool_call_limit, int) and self.tool_call_limit >= 0,
             f"{p}.tool_call_limit={self.tool_call_limit!r}: must be an integer >= 0")
        need(isinstance(self.max_response_length, int) and self.max_response_length >= 1,
             f"{p}.max_response_length={self.max_response_length!r}: must be an integer >= 1")
        need(self.vocab_size is None or self.vocab_size >= 2,
             f"{p}.vocab_size={self.vocab_size!r}: leave null (tokenizer length) or give an integer >= 2")
        need(self.temperature >= 0, f"{p}.temperature={self.temperature!r}: must be >= 0")
        need(0 < self.top_p <= 1, f"{p}.top_p={self.top_p!r}: must be in (0, 1]")
        need(self.tool_workers >= 1, f"{p}.tool_workers={self.tool_workers!r}: must be >= 1")
        need(self.tool_timeout_s > 0, f"{p}.tool_timeout_s={self.tool_timeout_s!r}: must be > 0")
        need(self.tool_retries >= 0, f"{p}.tool_retries={self.tool_retries!r}: must be >= 0")
        need(self.max_result_chars is None or self.max_result_chars >= 1,
             f"{p}.max_result_chars={self.max_result_chars!r}: leave null (no limit) or give an integer >= 1")
        try:
            self.branching()
        except ValueError as exc:
            raise ValueError(str(exc).replace("branching config: ", f"{p}.").replace("window=", "entropy_window="))
        return self

    def branching(self) -> BranchingConfig:
        """The branching decision's parameters (validated)."""
        return BranchingConfig(
            policy=self.policy, aepo_penalty=self.aepo_penalty, rule=self.rule, timing=self.timing, beam_size=self.beam_size,
            branch_probability=self.branch_probability, entropy_weight=self.entropy_weight,
            paper_alpha=self.paper_alpha, paper_beta=self.paper_beta, paper_tau=self.paper_tau,
            window=self.entropy_window, topk_logprobs=self.topk_logprobs,
            entropy_reduction=self.entropy_reduction, initial_entropy_scope=self.initial_entropy_scope,
        ).validate()

    @property
    def num_initial(self) -> int:
        return self.n if self.mode == "single" else self.initial_rollouts

    @property
    def branching_enabled(self) -> bool:
        """Entropy-driven forks after tool results (ARPO, AEPO); Tree-GRPO expands its trees instead."""
        return self.mode == "arpo" and self.beam_size > 1 and self.policy != "tree_grpo"

    @property
    def pre_monitoring(self) -> bool:
        """AEPO's entropy pre-monitoring sets each group's number of roots from a probe trajectory."""
        return self.mode == "arpo" and self.policy == "aepo" and self.aepo_pre_monitoring
