"""The one registry of metric names a training run logs, and what each means.

The docs' metrics glossary is generated from it (:mod:`arpo.reference.docs_gen`), and the end-to-end training tests check
every name a run writes to ``metrics.jsonl`` against it (:func:`unknown_metrics`), so a new metric without an
entry here fails the suite instead of reaching users unexplained. Names follow verl's where verl has one.
A name may be a pattern: ``*`` matches any run of characters (``/`` included), so ``critic/score/*`` covers
``critic/score/mean``, ``/max`` and ``/min``. The first matching entry gives the meaning, so specific entries
come before general ones.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class MetricEntry:
    """A metric name (or pattern), the section of the glossary it belongs to, and its meaning."""

    name: str
    group: str
    meaning: str

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.name)


_TRACKER = "Tracker fields"
_ACTOR = "Policy update (actor/*)"
_CRITIC = "Batch statistics and the value model (critic/*)"
_CORR = "Rollout correction (rollout_corr/*, training/rollout_probs_*)"
_ROLLOUT = "Rollout (rollout/*)"
_REWARD = "Rewards (reward/*)"
_DATA = "Lengths, throughput and data (response_length/*, prompt_length/*, perf/*, train/*, training/*)"
_TIME = "Time (timing_s/*, seconds a step)"
_VAL = "Validation (val-core/*)"
_AGENT = "Agent loops (agent_loop/*, with actor_rollout_ref.rollout.mode=agent_loop)"

GLOSSARY: tuple[MetricEntry, ...] = (
    MetricEntry("step", _TRACKER, "the training step the record belongs to (0: validation before training)"),
    MetricEntry("time", _TRACKER, "wall-clock time the record was written (Unix seconds)"),
    # the policy update, token means over each mini-batch averaged over the step's updates (verl's names)
    MetricEntry("actor/pg_loss", _ACTOR, "policy-gradient loss (PPO clipped surrogate, aggregated by "
                "`actor_rollout_ref.actor.loss_agg_mode`)"),
    MetricEntry("actor/pg_clipfrac", _ACTOR, "share of loss tokens whose ratio was clipped at 1 ± clip_ratio"),
    MetricEntry("actor/pg_clipfrac_lower", _ACTOR, "share of loss tokens clipped by the dual clip "
                "(negative advantage, ratio above `clip_ratio_c`)"),
    MetricEntry("actor/ppo_kl", _ACTOR, "mean of old − new log-prob over loss tokens (how far the update moved)"),
    MetricEntry("actor/entropy", _ACTOR, "mean token entropy of the policy over response tokens"),
    MetricEntry("actor/kl_loss", _ACTOR, "KL loss to the reference policy (`use_kl_loss`, before "
                "`kl_loss_coef`)"),
    MetricEntry("actor/grad_norm", _ACTOR, "global gradient norm before clipping (`grad_clip`)"),
    MetricEntry("actor/lr", _ACTOR, "learning rate of the step"),
    MetricEntry("actor/reward_kl_penalty", _ACTOR, "KL to the reference subtracted from the reward "
                "(`algorithm.use_kl_in_reward`)"),
    MetricEntry("actor/reward_kl_penalty_coeff", _ACTOR, "the KL-in-reward coefficient of the step (fixed or "
                "adaptive `algorithm.kl_ctrl`)"),
    # batch statistics (verl's compute_data_metrics)
    MetricEntry("critic/score/*", _CRITIC, "sequence score from the reward functions (mean / max / min over "
                "trajectories)"),
    MetricEntry("critic/rewards/*", _CRITIC, "sequence reward after shaping (overlong penalty, KL in reward)"),
    MetricEntry("critic/advantages/*", _CRITIC, "advantages over response tokens"),
    MetricEntry("critic/returns/*", _CRITIC, "returns over response tokens"),
    MetricEntry("critic/values/*", _CRITIC, "the value model's values over response tokens (PPO with a critic)"),
    MetricEntry("critic/vf_explained_var", _CRITIC, "1 − var(returns − values) / var(returns)"),
    MetricEntry("critic/vf_loss", _CRITIC, "clipped value loss"),
    MetricEntry("critic/vf_clipfrac", _CRITIC, "share of value predictions clipped by `critic.cliprange_value`"),
    MetricEntry("critic/vpred_mean", _CRITIC, "mean value prediction in the update"),
    MetricEntry("critic/grad_norm", _CRITIC, "the value model's gradient norm before clipping"),
    MetricEntry("critic/lr", _CRITIC, "the value model's learning rate"),
    # rollout correction (verl 0.9's names)
    MetricEntry("rollout_corr/kl", _CORR, "mean of rollout − trainer log-prob over response tokens "
                "(`rollout.calculate_log_probs=true`)"),
    MetricEntry("rollout_corr/k3_kl", _CORR, "k3 estimate of the rollout-vs-trainer KL"),
    MetricEntry("rollout_corr/ratio_max", _CORR, "largest exp(trainer − rollout) log-prob ratio of the step"),
    MetricEntry("rollout_corr/rollout_is_mean", _CORR, "mean truncated importance weight "
                "(`algorithm.rollout_correction.rollout_is`)"),
    MetricEntry("training/rollout_probs_diff_mean", _CORR, "mean |p_trainer − p_rollout| over response tokens"),
    MetricEntry("training/rollout_probs_diff_max", _CORR, "largest |p_trainer − p_rollout| of the step"),
    # rollout
    MetricEntry("rollout/trajectories", _ROLLOUT, "trajectories in the batch (prompts × M)"),
    MetricEntry("rollout/requests", _ROLLOUT, "engine requests made (one per segment between tool calls)"),
    MetricEntry("rollout/rounds", _ROLLOUT, "generation rounds (`schedule.mode: rounds` only)"),
    MetricEntry("rollout/branches", _ROLLOUT, "forks made (trajectories started from a parent's tool result)"),
    MetricEntry("rollout/branch_points", _ROLLOUT, "branching decisions taken (tool calls where a fork was "
                "considered)"),
    MetricEntry("rollout/branch_wants", _ROLLOUT, "fork candidates the branching rule said yes to, whether or not "
                "the budget M had a slot left (wants / branch_points: the rule's fork rate)"),
    MetricEntry("rollout/branch_points_damped", _ROLLOUT, "decisions damped by AEPO's consecutive-fork penalty"),
    MetricEntry("rollout/branch_decisions_waited", _ROLLOUT, "decisions that waited for their turn in the fixed "
                "grant order"),
    MetricEntry("rollout/branches_speculative", _ROLLOUT, "forks started before their decision's turn "
                "(`schedule.speculative_forks`)"),
    MetricEntry("rollout/branches_dropped", _ROLLOUT, "speculative forks that then got no slot"),
    MetricEntry("rollout/fill_fresh", _ROLLOUT, "fresh roots that filled groups short of M (`schedule.fill: "
                "fresh`)"),
    MetricEntry("rollout/fill_duplicate", _ROLLOUT, "copies that padded groups short of M (`schedule.fill: "
                "duplicate`)"),
    MetricEntry("rollout/fill_predicted", _ROLLOUT, "fills started early by fill prediction "
                "(`schedule.fill_probability`)"),
    MetricEntry("rollout/fill_discarded", _ROLLOUT, "early fills dropped because a fork took their slot"),
    MetricEntry("rollout/tokens/generated", _ROLLOUT, "tokens the engine generated, dropped work included"),
    MetricEntry("rollout/tokens/discarded", _ROLLOUT, "generated tokens of dropped fills and forks"),
    MetricEntry("rollout/tokens/monitor", _ROLLOUT, "tokens of AEPO's pre-monitoring probes"),
    MetricEntry("rollout/tokens/tool_result", _ROLLOUT, "tokens of tool results in the batch"),
    MetricEntry("rollout/tokens/response_model_total", _ROLLOUT, "model-written response tokens in the batch "
                "(shared prefixes counted once per row)"),
    MetricEntry("rollout/tokens/prefilled", _ROLLOUT, "prompt tokens the engine computed (not served by its "
                "prefix cache)"),
    MetricEntry("rollout/tokens_per_s", _ROLLOUT, "generated tokens per second of the rollout call"),
    MetricEntry("rollout/prefix_cache/hit_rate", _ROLLOUT, "share of request prompt tokens served by the "
                "engine's prefix cache"),
    MetricEntry("rollout/prefix_cache/branch_hit_rate", _ROLLOUT, "the same for forks' requests"),
    MetricEntry("rollout/engine_idle_fraction", _ROLLOUT, "share of the call with no request in flight"),
    MetricEntry("rollout/requests_in_flight_mean", _ROLLOUT, "requests in flight on average while any was"),
    MetricEntry("rollout/last_start_frac", _ROLLOUT, "when the last row made its first request, as a share of the "
                "call (late forks and fills)"),
    MetricEntry("rollout/tail_after_half_done_frac", _ROLLOUT, "how long the call ran after half its rows had "
                "finished, as a share of the call"),
    MetricEntry("rollout/tool_calls/total", _ROLLOUT, "tool calls executed (a fork reuses its parent's results, "
                "so ARPO executes fewer than its trajectories hold)"),
    MetricEntry("rollout/tool_calls/in_trajectory_mean", _ROLLOUT, "tool calls per trajectory as the batch holds "
                "them"),
    MetricEntry("rollout/tool_calls/errors", _ROLLOUT, "tool calls that returned an error"),
    MetricEntry("rollout/tool_calls/malformed", _ROLLOUT, "calls the model wrote that could not be parsed (hermes: "
                "also bad JSON, an unknown tool, a missing argument)"),
    MetricEntry("rollout/tool_calls/hit_limit", _ROLLOUT, "calls refused at `tools.call_limit`"),
    MetricEntry("rollout/tool_calls/*", _ROLLOUT, "tool calls executed per tool (`search`, `python`, …; "
                "`invalid_call`: hermes calls naming no loaded tool)"),
    MetricEntry("rollout/tool_calls_per_traj", _ROLLOUT, "tool calls executed per trajectory"),
    MetricEntry("rollout/finish/*", _ROLLOUT, "trajectories by how they ended: `stop` (EOS or answer), `length` "
                "(the response cap), `tool_limit`"),
    MetricEntry("rollout/entropy/initial_mean", _ROLLOUT, "mean initial window entropy of the roots (H_initial)"),
    MetricEntry("rollout/entropy/before_tool_mean", _ROLLOUT, "mean window entropy of segments ending in a tool "
                "call"),
    MetricEntry("rollout/entropy/after_tool_mean", _ROLLOUT, "mean window entropy after tool results"),
    MetricEntry("rollout/entropy/delta_mean", _ROLLOUT, "mean ΔH that drove the branching decisions (the "
                "console's `dH`)"),
    MetricEntry("rollout/aepo/initial_rollouts_mean", _ROLLOUT, "AEPO pre-monitoring: roots started per prompt "
                "(N) on average"),
    MetricEntry("rollout/aepo/h_root_mean", _ROLLOUT, "AEPO pre-monitoring: the probes' root entropy"),
    MetricEntry("rollout/aepo/h_tool_mean", _ROLLOUT, "AEPO pre-monitoring: the probes' entropy after tool results"),
    MetricEntry("rollout/weight_sync_probe", _ROLLOUT, "the engine's log-prob of a fixed probe after the weight "
                "push (changes every update: the engine got the weights)"),
    MetricEntry("rollout/weight_sync_replica_gap", _ROLLOUT, "largest difference of the replicas' probes after a "
                "push (0: every replica got the weights)"),
    # the agent-loop path (arpo/agent_loop/manager.py); it logs rollout/trajectories and rollout/tool_calls/total too
    MetricEntry("agent_loop/num_trajectories", _AGENT, "trajectories the agent loops returned"),
    MetricEntry("agent_loop/num_turns/*", _AGENT, "turns per trajectory (mean / max / min)"),
    MetricEntry("agent_loop/branched_fraction", _AGENT, "share of trajectories that are forks (`arpo_agent`)"),
    # rewards (reward_fns/manager.py)
    MetricEntry("reward/errors", _REWARD, "rows whose reward function raised (scored `reward.error_score`)"),
    MetricEntry("reward/overlong/fraction", _REWARD, "share of rows given the overlong penalty "
                "(`reward.overlong_buffer`)"),
    MetricEntry("reward/overlong/penalty_mean", _REWARD, "mean overlong penalty"),
    MetricEntry("reward/*/score/mean", _REWARD, "mean score per `data_source` (e.g. `reward/synthetic/chain/"
                "score/mean`)"),
    MetricEntry("reward/*/mean", _REWARD, "batch mean of a reward diagnostic: `score`, `acc`, `f1`, `em`, "
                "`format_ok`, `tool_bonus`, `num_search`, `num_python`, …"),
    # lengths, throughput, data
    MetricEntry("response_length/clip_ratio", _DATA, "share of responses at `data.max_response_length`"),
    MetricEntry("response_length/model_tokens_mean", _DATA, "model-written tokens per response (tool results "
                "excluded)"),
    MetricEntry("response_length/*", _DATA, "response tokens per row, tool results included (mean / max / min)"),
    MetricEntry("prompt_length/clip_ratio", _DATA, "share of prompts at `data.max_prompt_length`"),
    MetricEntry("prompt_length/*", _DATA, "prompt tokens per row (mean / max / min)"),
    MetricEntry("perf/packed_token_ratio", _DATA, "the batch's tokens once each group's tree is packed, over its "
                "tokens as rows (what tree packing saves)"),
    MetricEntry("perf/total_num_tokens", _DATA, "tokens in the batch (prompts and responses)"),
    MetricEntry("perf/throughput", _DATA, "tokens of the batch per second of the step"),
    MetricEntry("train/num_gen_batches", _DATA, "generation rounds of dynamic sampling this step"),
    MetricEntry("train/num_groups_kept", _DATA, "prompt groups kept by dynamic sampling"),
    MetricEntry("train/num_groups_dropped", _DATA, "prompt groups dropped (no variation in the metric)"),
    MetricEntry("train/num_groups_surplus", _DATA, "informative groups beyond `data.train_batch_size`"),
    MetricEntry("training/global_step", _DATA, "the global step"),
    MetricEntry("training/epoch", _DATA, "the data epoch"),
    # time
    MetricEntry("timing_s/step", _TIME, "the whole step"),
    MetricEntry("timing_s/gen", _TIME, "the rollout (generation and tools)"),
    MetricEntry("timing_s/reward", _TIME, "scoring"),
    MetricEntry("timing_s/old_log_prob", _TIME, "the old-log-prob pass"),
    MetricEntry("timing_s/ref", _TIME, "the reference policy's log-probs"),
    MetricEntry("timing_s/values", _TIME, "the value model's forward"),
    MetricEntry("timing_s/adv", _TIME, "advantages"),
    MetricEntry("timing_s/update_critic", _TIME, "the critic update"),
    MetricEntry("timing_s/update_actor", _TIME, "the policy update"),
    MetricEntry("timing_s/update_weights", _TIME, "pushing the new weights to the engine(s)"),
    MetricEntry("timing_s/rollout_total", _TIME, "the rollout call"),
    MetricEntry("timing_s/rollout_generate", _TIME, "time with at least one engine request in flight"),
    MetricEntry("timing_s/rollout_tools", _TIME, "time with at least one tool call running"),
    MetricEntry("timing_s/rollout_grant_wait", _TIME, "seconds waiting decisions waited for their turn, summed"),
    # validation
    MetricEntry("val-core/all/acc/mean", _VAL, "validation accuracy over all questions (sampled as "
                "`actor_rollout_ref.rollout.val_kwargs` says)"),
    MetricEntry("val-core/all/reward/mean", _VAL, "validation reward over all questions"),
    MetricEntry("val-core/*/acc/mean@*", _VAL, "validation accuracy per `data_source`, @n samples"),
    MetricEntry("val-core/*/reward/mean@*", _VAL, "validation reward per `data_source`, @n samples"),
)


def meaning(key: str) -> str | None:
    """The meaning of a logged metric name, or None when the glossary lacks it."""
    for entry in GLOSSARY:
        if entry.matches(key):
            return entry.meaning
    return None


def unknown_metrics(keys: Iterable[str]) -> list[str]:
    """The names among ``keys`` that no glossary entry covers, sorted."""
    return sorted({k for k in keys if meaning(k) is None})
