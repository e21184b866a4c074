"""Entropy measurement and the branching decision of ARPO's entropy-based adaptive rollout.

ARPO (arXiv 2507.19849, "Agentic Reinforced Policy Optimization") forks a trajectory after a tool call when
the model became *more uncertain* than it was at the start. Uncertainty is the entropy of the first ``k``
generated tokens of a segment (a *window*), computed from the top-k logprobs the engine returns:

* per token: ``H_t = −Σ_j p_j·log p_j`` over the top-k entries (``p_j = exp(logprob_j)``, not renormalised —
  the same quantity the released code uses);
* per window: ``reduction="mean"`` (ours, the default) averages ``H_t`` over the window's tokens,
  ``reduction="sum"`` (compatibility with the released code, RUC-NLPIR/ARPO) sums them; both are then divided
  by ``log|V|``. Mean is the default because the summed value grows with the number of tokens in the window:
  a segment that stops after 3 tokens looks far *less* uncertain than a 20-token one with the same per-token
  entropy, so ΔH (and the branch rate) would depend on segment length rather than on uncertainty, and the
  scale of ``entropy_weight`` would depend on ``window``. With the mean, ΔH lives in [−1, 1] for any window.

``ΔH = H_now − H_initial``, where ``H_initial`` is the window entropy of the first segment of the
trajectory's root (measured per prompt group in one rollout call and discarded afterwards; a branch inherits
its parent's). Two decision rules, chosen by ``rule``:

* ``code`` — the rule of the released code: draw ``U ~ Uniform(0, 1)``,
  ``prob = clip(U − entropy_weight·ΔH, 0, 1)``, branch iff ``prob ≤ branch_probability``. So with ΔH = 0 a
  fork happens with probability ``branch_probability``, and ΔH > 0 raises the chance.
* ``paper`` — the rule as written in the paper (Sec. 3.2): ``P = α + β·ΔH``, branch iff ``P > τ``
  (``paper_alpha``, ``paper_beta``, ``paper_tau``). It is deterministic given ΔH.

Two timings of ``H_now``, chosen by ``timing`` (applied by the rollout tree, :mod:`arpo.rollout.tree`):

* ``code`` — the released code measures the window of the segment *just generated*, i.e. the segment that
  ends with the tool call, before the tool result is seen;
* ``paper`` — the paper measures after the tool result is appended: generate ``k`` tokens, measure them,
  then decide (the ``k`` tokens are kept as the parent's continuation).

Each fork candidate (``beam_size − 1`` per branch point, the parent being the ``beam_size``-th continuation)
is decided by one :func:`should_branch` call and granted a slot by the prompt's :class:`GroupBudget`, so a
group never exceeds its budget M.

Policies (``policy``):

* ``arpo`` — the rules above.
* ``aepo`` — AEPO's entropy-balanced adaptive rollout (arXiv 2510.14545; released code
  ``AEPO/verl_aepo_entropy/.../vllm_rollout_with_tools.py``): the same ΔH, damped after consecutive forks so
  that the budget does not pile up along one path ("high-entropy rollout collapse"). With ``c`` the number of
  consecutive decisions just before this one, on this trajectory's path, that asked for a fork,
  ``f = max(0, 1 − aepo.penalty·c)`` and a candidate forks iff ``clip((U + entropy_weight·ΔH)·f, 0, 1) ≥
  branch_probability`` (rule ``code``, the released code's form: at c = 0 it forks with probability
  ``1 − p + w·ΔH``, ARPO's ``p + w·ΔH`` at the default p = 0.5) or ``(α + β·ΔH)·f > τ`` (rule ``paper``). The
  released code keeps ``c`` per prompt group and counts rounds in which the group gained a trajectory, which
  depends on completion order; here it follows the path (the paper's wording), from draws only, so the batch
  is the same under every schedule. AEPO's entropy pre-monitoring (``aepo.pre_monitoring``, off in both
  released scripts) splits M between roots and branches per prompt: see :func:`aepo_initial_rollouts`.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # config.py imports this module's constants
    from arpo.rollout.config import ARPORolloutConfig

#: the built-in policies (``arpo.rollout.policies.POLICY_REGISTRY`` holds these and any registered later)
POLICIES = ("arpo", "aepo", "tree_grpo")
RULES = ("code", "paper")
TIMINGS = ("code", "paper")
REDUCTIONS = ("mean", "sum")
INITIAL_ENTROPY_SCOPES = ("trajectory", "group")


def token_entropy(top_logprobs: dict[int, float]) -> float:
    """−Σ p·log p over the top-k entries of one generated token (p = exp(logprob); not renormalised)."""
    total = 0.0
    for lp in top_logprobs.values():
        if lp == -math.inf or lp != lp:  # p = 0 contributes nothing; NaN means the engine had no value
            continue
        total -= math.exp(lp) * lp
    return total


def window_entropy(
    step_logprobs: list[dict[int, float]], window: int, vocab_size: int, reduction: str = "mean"
) -> float:
    """Entropy of the first ``window`` generated tokens, normalised by ``log(vocab_size)``.

    ``reduction="mean"`` averages per-token entropies (our default); ``"sum"`` sums them (released ARPO code).
    An empty window has entropy 0.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 to normalise by log|V| (got {vocab_size})")
    if reduction not in REDUCTIONS:
        raise ValueError(f"entropy reduction must be one of {REDUCTIONS} (got {reduction!r})")
    steps = step_logprobs[:window]
    if not steps:
        return 0.0
    total = sum(token_entropy(s) for s in steps)
    if reduction == "mean":
        total /= len(steps)
    return total / math.log(vocab_size)


def max_window_entropy(window: int, topk: int, vocab_size: int, reduction: str = "mean") -> float:
    """The largest value :func:`window_entropy` can take for top-``topk`` logprobs of a real distribution.

    An engine returns at most ``topk + 1`` entries per token (vLLM adds the sampled token when it is not in
    the top k) whose probabilities sum to at most 1; over ``K`` such entries ``−Σ p·log p`` is at most
    ``max_{s ≤ 1} s·log(K/s)`` (``log K`` once ``K ≥ e``). The rollout clips measured entropies into
    ``[0, this]`` so that its look-ahead over future decisions (:func:`could_branch`) is never wrong, even
    for an engine whose logprobs are not a distribution."""
    k = max(1, min(topk + 1, vocab_size))
    mass = min(1.0, k / math.e)
    per_token = mass * math.log(k / mass)
    return per_token * (window if reduction == "sum" else 1) / math.log(vocab_size)


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any printable parts (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def decision_rng(seed: int, group: int, key: tuple, depth: int) -> random.Random:
    """The generator of one branching decision: the one of trajectory ``key`` of prompt ``group`` after its
    ``depth``-th tool call. Its own generator (not one per group consumed in arrival order), so no draw
    depends on the order decisions are taken in, and a decision's draws are known before it is taken."""
    return random.Random(derive_seed(seed, "branch", group, key, depth))


def _branches(cfg: ARPORolloutConfig, delta_h: float, u: float, damping: float = 1.0) -> bool:
    b = cfg.branching
    if cfg.policy == "aepo":
        if b.rule == "code":
            return min(1.0, max(0.0, (u + b.entropy_weight * delta_h) * damping)) >= b.branch_probability
        return (b.paper_alpha + b.paper_beta * delta_h) * damping > b.paper_tau
    if b.rule == "code":
        return min(1.0, max(0.0, u - b.entropy_weight * delta_h)) <= b.branch_probability
    return b.paper_alpha + b.paper_beta * delta_h > b.paper_tau


def aepo_damping(cfg: ARPORolloutConfig, streak: int) -> float:
    """AEPO's factor after ``streak`` consecutive forks on the path (1 for ARPO)."""
    return max(0.0, 1.0 - cfg.aepo.penalty * streak) if cfg.policy == "aepo" else 1.0


def aepo_initial_rollouts(budget: int, h_root: float, h_tool: float, beta: float) -> int:
    """AEPO's entropy pre-monitoring (arXiv 2510.14545, Sec. 3.1: m = k·σ(β·(H_root − H̄_tool))): the number
    of global samples (roots) out of the budget ``budget``; the rest is left to branching. A question more
    uncertain than the tool results it leads to gets more roots; one whose tool results raise uncertainty
    keeps more budget for forks. Rounded as the released code does (``int(k·σ) + 1``, clamped to [1, k];
    its β is 0.5). The entropies are window entropies normalised by log|V|, measured by one discarded probe
    trajectory per prompt (:mod:`arpo.rollout.tree`). The released code (``_calculate_initial_rollouts_
    dynamical``) samples H_root from a second, 50-token probe and averages H_tool over every segment of its
    probe, the first included; here one probe gives both and H̄_tool covers the windows after tool results
    only, as the paper defines it (the same expectation for H_root, one probe's cost)."""
    sigma = 1.0 / (1.0 + math.exp(-beta * (h_root - h_tool)))
    return max(1, min(budget, int(budget * sigma) + 1))


def should_branch(cfg: ARPORolloutConfig, delta_h: float, rng: random.Random, streak: int = 0) -> bool:
    """Decide one fork candidate from the entropy change ``delta_h`` (H_now − H_initial) and, for AEPO, the
    number of consecutive decisions before it on the path that asked for a fork.

    ``code`` draws one uniform number from ``rng`` per call; ``paper`` draws none (it is deterministic).
    """
    u = rng.random() if cfg.branching.rule == "code" else 0.0
    return _branches(cfg, delta_h, u, aepo_damping(cfg, streak))


def could_branch(cfg: ARPORolloutConfig, delta_lo: float, delta_hi: float, rng: random.Random) -> bool:
    """Whether :func:`should_branch`, from the same ``rng`` state, says yes for some ΔH in
    ``[delta_lo, delta_hi]`` and any path history. It draws exactly what :func:`should_branch` draws, so a
    rollout can replay a future decision's draws before its ΔH is known. Every rule is monotone in ΔH and
    linear in AEPO's damping factor f ∈ [0, 1], so the ends of both ranges suffice."""
    u = rng.random() if cfg.branching.rule == "code" else 0.0
    dampings = (1.0, 0.0) if cfg.policy == "aepo" else (1.0,)
    return any(_branches(cfg, dh, u, f) for dh in (delta_lo, delta_hi) for f in dampings)


class InitialEntropy:
    """H_initial, what ΔH compares against, for one rollout call (reset every call; forks inherit their parent's):
    a root's own first window (scope ``trajectory``, the released code's) or, scope ``group``, the mean of the
    first windows of the group's initial roots once every one of them is back (none has one: no fork)."""

    def __init__(self, scope: str, n_groups: int):
        self.by_group = scope == "group"
        self.mean: list[float | None] = [None] * n_groups
        self.settled = [False] * n_groups

    def of_new_root(self, group: int) -> float | None:
        return self.mean[group] if self.by_group else None

    def root_measured(self, b: Any, h: float) -> None:
        b.own_h0 = h
        if not self.by_group:
            b.h_initial = h

    def settle(self, groups: Any, branches_by_group: list[list[Any]]) -> list[int]:
        """Scope ``group``: set H_initial in every group whose initial roots are all back; returns those groups."""
        settled = []
        for g in groups if self.by_group else ():
            roots = [b for b in branches_by_group[g] if b.kind == "initial"]
            if self.settled[g] or not roots or not all(b.started for b in roots):
                continue
            hs = [b.own_h0 for b in roots if b.own_h0 is not None]
            self.mean[g] = sum(hs) / len(hs) if hs else None
            for b in branches_by_group[g]:
                b.h_initial = self.mean[g]
            self.settled[g] = True
            settled.append(g)
        return settled

    def pending(self, b: Any) -> bool:
        """Scope ``group``: ``b``'s H_initial is still to come."""
        return self.by_group and b.h_initial is None and not self.settled[b.group]


class GroupBudget:
    """The trajectory budget M of one prompt group: slots are reserved, never returned, never exceeded.

    ``reserve`` holds a :class:`threading.Lock` only for a few arithmetic operations and never awaits, so it
    is safe from threads and from coroutines on one event loop alike.
    """

    def __init__(self, total: int):
        if total < 0:
            raise ValueError(f"budget total must be >= 0 (got {total})")
        self._total = total
        self._used = 0
        self._lock = threading.Lock()

    def reserve(self, n: int = 1) -> int:
        """Reserve up to ``n`` slots; return how many were granted (0 when the budget is spent)."""
        if n < 0:
            raise ValueError(f"cannot reserve a negative number of slots ({n})")
        with self._lock:
            granted = min(n, self._total - self._used)
            self._used += granted
            return granted

    @property
    def total(self) -> int:
        return self._total

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    @property
    def remaining(self) -> int:
        with self._lock:
            return self._total - self._used
