"""Rollout policies: how a prompt group's budget M (``n``) is spent, behind one interface.

A policy starts a group's first trajectories and tops the group up as its trajectories move; the tree
(:mod:`arpo.rollout.tree`) does the rest the same way for every policy — requests, tool calls, entropy
windows, branching decisions where the policy makes them, the output format — so soft/hard advantage and the
trainer work unchanged. Chosen by ``actor_rollout_ref.rollout.arpo.policy`` (``mode: single``: sampling):

* :class:`Sampling` — plain GRPO sampling: M independent roots.
* :class:`Arpo` — ARPO (arXiv 2507.19849): N roots, forks after tool results by the entropy rule
  (:mod:`arpo.rollout.branching`), groups left short filled (``fill``).
* :class:`Aepo` — AEPO (arXiv 2510.14545): ARPO's rule damped after consecutive forks (in the rule), and
  optionally its entropy pre-monitoring, which sets N per group from a probe trajectory.
* :class:`TreeGrpo` — Tree-GRPO (arXiv 2509.21240): N trees grown by continuing sampled nodes; no entropy.

A new policy is a subclass registered by name with :func:`register_policy` (as advantage estimators are with
``register_adv_est``), or named in the config as ``"module:ClassName"`` without registering
(``examples/margin_policy.py`` is a worked example).
"""

from __future__ import annotations

import importlib
import random
from typing import TYPE_CHECKING, Callable

from arpo.rollout.branch import Branch, Phase
from arpo.rollout.branch_slots import canonical
from arpo.rollout.branching import aepo_initial_rollouts, derive_seed
from arpo.rollout.config import CONFIG_PREFIX, ARPORolloutConfig

if TYPE_CHECKING:
    from arpo.rollout.tree import RolloutTree

#: ``actor_rollout_ref.rollout.arpo.policy`` name -> policy class (filled by :func:`register_policy`)
POLICY_REGISTRY: dict[str, type["Sampling"]] = {}


def register_policy(name: str) -> Callable[[type["Sampling"]], type["Sampling"]]:
    """Class decorator registering a rollout policy under ``actor_rollout_ref.rollout.arpo.policy: name``."""

    def decorator(cls: type[Sampling]) -> type[Sampling]:
        if name in POLICY_REGISTRY and POLICY_REGISTRY[name] is not cls:
            raise ValueError(f"rollout policy {name!r} is already registered")
        POLICY_REGISTRY[name] = cls
        return cls

    return decorator


def get_policy_class(name: str) -> type["Sampling"]:
    """The class ``name`` selects: a registered name, or ``"module:ClassName"`` imported (a subclass of
    :class:`Sampling`). Anything else is one error line naming the field and the registered names."""
    field = f"{CONFIG_PREFIX}.policy={name!r}"
    if name in POLICY_REGISTRY:
        return POLICY_REGISTRY[name]
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{field}: use one of {tuple(POLICY_REGISTRY)} or 'module:ClassName' "
                         f"(a subclass of arpo.rollout.policies.Sampling)")
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}: cannot import it ({e}); give 'module:ClassName' of an importable class, "
                         f"or one of {tuple(POLICY_REGISTRY)}") from e
    if not (isinstance(cls, type) and issubclass(cls, Sampling)):
        raise ValueError(f"{field}: {attr} is not a subclass of arpo.rollout.policies.Sampling")
    return cls


class Sampling:
    """Plain sampling (GRPO's rollout): ``n`` independent roots per group, the whole budget at the start."""

    def __init__(self, cfg: ARPORolloutConfig):
        self.cfg = cfg

    def start(self, tree: "RolloutTree", g: int) -> None:
        """The group's first trajectories."""
        self.start_roots(tree, g, self.cfg.num_initial)

    def start_roots(self, tree: "RolloutTree", g: int, n: int) -> None:
        for _ in range(tree.budgets[g].reserve(n)):
            tree.new_root(g, "initial")

    def top_up(self, tree: "RolloutTree", g: int) -> None:
        """Called whenever a trajectory of the group has moved: start what the group needs next."""

    def window_uncertainty(self, tree: "RolloutTree", step_logprobs: list[dict[int, float]]) -> float:
        """The uncertainty of a window's top-k logprobs that branching decisions compare (ΔH = now − initial):
        the normalised window entropy. A policy may measure something else; it must stay within
        ``[0, tree.lookahead.h_max]``, the range the fork look-ahead assumes."""
        return tree.lookahead.window_entropy(step_logprobs)


@register_policy("arpo")
class Arpo(Sampling):
    """ARPO: N roots; forks come from the tree's branching decisions; fills give short groups their M.

    ``fresh`` fills start as soon as the budget left exceeds what branching could still take (so they need
    not wait for the group to finish; fill roots never branch, so every branching decision sees the same
    budget as with filling at the end). ``released`` (the released code's loop): a group with nothing left
    running gets one more root, which may branch, until it has M. ``duplicate``: copies of the group's last
    trajectory once it has finished."""

    def start_roots(self, tree: "RolloutTree", g: int, n: int) -> None:
        super().start_roots(tree, g, n)
        if self.cfg.schedule.fill == "fresh":
            for _ in range(min(self.cfg.schedule.speculative_fill, tree.budgets[g].remaining)):
                tree.new_root(g, "fill").speculative = True

    def top_up(self, tree: "RolloutTree", g: int) -> None:
        group, budget = tree.by_group[g], tree.budgets[g]
        if budget.remaining == 0 and not any(b.speculative and b.kind == "fill" for b in group):
            return
        if self.cfg.schedule.fill == "fresh":
            self._fill_fresh(tree, g)
            return
        idle = not any(b.phase is not Phase.DONE and not b.speculative for b in group) and not tree.slots[g].pending
        if not idle:
            return
        if self.cfg.schedule.fill == "released":  # one late root at a time, which branches like the first ones
            budget.reserve(1)
            tree.new_root(g, "initial")
            return
        granted = budget.reserve(budget.remaining)
        last = max((b for b in group if b.in_batch), key=lambda b: canonical(b.key))
        for _ in range(granted):
            dup = tree.fork(last, len(last.response_ids), self.cfg.tools.call_limit + 1, kind="duplicate")
            dup.phase, dup.finish_reason = Phase.DONE, last.finish_reason
            if tree.progress is not None:
                tree.progress.update(1)
        tree.m.count["fill_duplicate"] += granted

    def _fill_fresh(self, tree: "RolloutTree", g: int) -> None:
        spec = [b for b in tree.by_group[g] if b.speculative and b.kind == "fill"]
        plan = tree.slots[g].plan_fills(len(spec), self.cfg.schedule.fill_probability, tree.call_rates.reach(g),
                                        lambda b: b.phase in (Phase.TOOL, Phase.PROBE))
        for b in spec[: plan.confirm]:
            tree.confirm(b)
        for _ in range(plan.start):
            tree.new_root(g, "fill")
        tree.m.count["fill_fresh"] += plan.confirm + plan.start
        for b in spec[len(spec) - plan.drop:]:
            tree.drop(b)
        for _ in range(plan.predict):
            tree.new_root(g, "fill").speculative = True
        tree.m.count["fill_predicted"] += plan.predict


@register_policy("aepo")
class Aepo(Arpo):
    """AEPO: ARPO whose rule is damped after consecutive forks (:func:`arpo.rollout.branching.aepo_damping`)
    and, with ``aepo.pre_monitoring``, entropy pre-monitoring: a probe trajectory per group (tools included,
    never a row of the batch) runs first; its entropies set the group's N
    (:func:`arpo.rollout.branching.aepo_initial_rollouts`), and the roots start once it has finished."""

    def start(self, tree: "RolloutTree", g: int) -> None:
        if self.cfg.aepo.pre_monitoring:
            tree.new(g, "monitor", ("monitor", 0))
        else:
            super().start(tree, g)

    def top_up(self, tree: "RolloutTree", g: int) -> None:
        group = tree.by_group[g]
        if len(group) == 1 and group[0].kind == "monitor":  # the roots wait for the probe
            if group[0].phase is not Phase.DONE:
                return
            self.start_roots(tree, g, self._monitored_initial(tree, group[0]))
        super().top_up(tree, g)

    def _monitored_initial(self, tree: "RolloutTree", probe: Branch) -> int:
        """N from the probe: H_root its first window, H̄_tool the mean of its windows after tool results (none:
        H_root, so N = int(M/2) + 1); a probe without logprobs leaves ``initial_rollouts``."""
        n = self.cfg.initial_rollouts
        if probe.own_h0 is not None:
            after = probe.samples["entropy_after_tool"]
            h_tool = sum(after) / len(after) if after else probe.own_h0
            n = aepo_initial_rollouts(self.cfg.n, probe.own_h0, h_tool, self.cfg.aepo.beta)
            tree.m.values["aepo_h_root"].append(probe.own_h0)
            tree.m.values["aepo_h_tool"].append(h_tool)
        tree.m.values["aepo_initial_rollouts"].append(float(n))
        return n


@register_policy("tree_grpo")
class TreeGrpo(Sampling):
    """Tree-GRPO (arXiv 2509.21240; released code AMAP-ML/Tree-GRPO, ``tree_node.get_expand_node``): N trees;
    once every chain of a tree has finished, pick ``tree_grpo.expansions`` nodes of it uniformly with replacement
    from {its root} ∪ {the end of every tool result some chain continued after}, and continue each: a picked
    root is one more chain from the prompt, a picked node a fork that copies the chain up to there. Iterations
    go on until the tree holds n / initial_rollouts chains. Picks draw from a generator seeded by the tree and
    its size, so they do not depend on completion order."""

    def top_up(self, tree: "RolloutTree", g: int) -> None:
        quota = self.cfg.n // self.cfg.num_initial
        members = [b for b in tree.by_group[g] if b.in_batch]
        for t in sorted({b.tree for b in members}):
            chains = sorted((b for b in members if b.tree == t), key=lambda b: canonical(b.key))
            if len(chains) >= quota or any(b.phase is not Phase.DONE for b in chains):
                continue
            nodes: list[tuple[Branch, int] | None] = [None]  # None: the root
            for b in chains:
                nodes += [(b, d + 1) for d, c in enumerate(b.tool_calls)
                          if c["end"] > b.branch_pos and c["end"] < len(b.response_ids)]
            rng = random.Random(derive_seed(tree.seed, tree.group_ids[g], "tree", t, len(chains)))
            picks = rng.choices(nodes, k=min(self.cfg.tree_grpo.expansions, quota - len(chains)))
            tree.budgets[g].reserve(len(picks))
            for pick in picks:
                if pick is None:
                    tree.new_root(g, "initial", tree_root=chains[0])
                else:
                    parent, depth = pick
                    tree.fork(parent, parent.tool_calls[depth - 1]["end"], depth)
                    tree.m.count["branches"] += 1


def make_policy(cfg: ARPORolloutConfig) -> Sampling:
    """The policy of ``cfg`` (``mode: single`` is plain sampling whatever ``policy`` says)."""
    if cfg.mode == "single":
        return Sampling(cfg)
    return get_policy_class(cfg.policy)(cfg)
