"""An evaluation on several engine replicas: samples spread over all of them (each sample whole on one), the records
the same as on one engine, the bar counting every replica's tokens, and ``python -m arpo.eval`` starting one
replica per GPU (Ray actors) or one engine in this process without GPUs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from arpo.evaluation import evaluate as evaluate_module
from arpo.evaluation import runner as runner_module
from arpo.evaluation.records import SampleWriter, load_samples, samples_path
from arpo.evaluation.runner import EvalRunner, Grader
from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.tool_executor import ToolExecutor
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, ToyTokenizer
from reward_fns.registry import build_compute_score
from tests.eval.test_runner import AddingPython, EchoSearch, _specs

#: what differs between two runs of the same samples whatever the engines: the clock and the writing process
VOLATILE = ("time_s", "session")


def _evaluate(tmp_path, engines, tok, specs, concurrency, max_response_length=600):
    """Run ``specs`` on ``engines`` (one engine or a list); return the runner and its records by sample key."""
    executor = ToolExecutor([AddingPython(), EchoSearch()], max_workers=4, retries=0)
    cfg = ARPORolloutConfig.from_dict({"mode": "single", "n": 1, "tools.call_limit": 6,
                                       "sampling.max_response_length": max_response_length,
                                       "sampling.temperature": 0.6, "sampling.top_p": 0.95, "sampling.top_k": 20,
                                       "sampling.repetition_penalty": 1.1})
    try:
        with SampleWriter(tmp_path) as writer:
            runner = EvalRunner(engines, tok, executor, cfg, {"python": 2, "search": 2}, ("search",),
                                Grader(build_compute_score(None)), writer, method="m", seed=3,
                                concurrency=concurrency, show_progress=False)
            assert asyncio.run(runner.run(specs)) == len(specs)
    finally:
        executor.close()
    records = load_samples(samples_path(tmp_path, specs[0].item.benchmark))
    return runner, {(r["index"], r["run"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in records}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_samples_spread_over_replicas_and_match_one_engine(tmp_path, concurrency):
    tok = ToyTokenizer()
    policy = ScriptPolicy(call_prob=0.8)
    specs = _specs(tok, n_questions=6, runs=2)
    _, alone = _evaluate(tmp_path / "one", ScriptedEngine(tok, policy, latency_s=0.001), tok, specs, concurrency)
    replicas = [ScriptedEngine(tok, policy, latency_s=0.001) for _ in range(2)]
    runner, spread = _evaluate(tmp_path / "two", replicas, tok, specs, concurrency)

    # every replica generated
    assert all(e.requests for e in replicas)
    assert runner.replica_samples[0] > 0 and runner.replica_samples[1] > 0
    assert sum(runner.replica_samples) == len(specs)
    if concurrency == 1:  # samples one at a time: every replica idle at each start, so they take turns
        assert runner.replica_samples == [6, 6]
    # a request's seed derives from the sample alone, so the records do not depend on where a sample ran
    assert spread == alone and len(spread) == len(specs)
    assert any(r["tool_calls"]["total"] for r in spread.values())  # multi-turn samples were among them


def test_each_sample_stays_on_one_replica(tmp_path):
    tok = ToyTokenizer()
    specs = _specs(tok, n_questions=4, runs=2)
    replicas = [ScriptedEngine(tok, ScriptPolicy(call_prob=0.9), latency_s=0.001) for _ in range(3)]
    runner, records = _evaluate(tmp_path, replicas, tok, specs, concurrency=3)
    # a sample is one rollout call, whose request ids all carry the call's nonce (arpo-<nonce>-g..-t..-r..)
    owner: dict[str, int] = {}
    for i, engine in enumerate(replicas):
        for request in engine.requests:
            assert owner.setdefault(request.request_id.split("-")[1], i) == i, "a sample ran on two replicas"
    # every replica ran samples, each sample on one
    assert len(owner) == len(specs) and sum(runner.replica_samples) == len(specs) and min(runner.replica_samples) > 0
    assert any(len(e.requests) > runner.replica_samples[i] for i, e in enumerate(replicas))  # multi-turn samples
    assert len(records) == len(specs)


@pytest.fixture
def bars(monkeypatch) -> list:
    """The progress bars the runs make (the runner drops its own when a run ends)."""
    made = []

    class KeptProgress(runner_module.EvalProgress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(runner_module, "EvalProgress", KeptProgress)
    return made


def test_bar_counts_the_tokens_of_every_replica(tmp_path, bars):
    tok = ToyTokenizer()
    specs = _specs(tok, n_questions=3, runs=2)
    replicas = [ScriptedEngine(tok, ScriptPolicy(call_prob=0.8), latency_s=0.001) for _ in range(2)]
    _evaluate(tmp_path, replicas, tok, specs, concurrency=2)
    generated = [sum(r.output_len for r in e.requests) for e in replicas]
    assert all(generated) and bars[0].tokens == sum(generated)


class ListeningEngine(ScriptedEngine):
    """A scripted engine that streams its tokens to a listener, as the in-process vLLM engine does."""

    token_listener = None

    async def generate(self, prompt_ids, sampling_params, request_id):
        out = await super().generate(prompt_ids, sampling_params, request_id)
        if self.token_listener is not None:
            self.token_listener(len(out.token_ids))
        return out


def test_streaming_replicas_each_get_the_bar_as_listener(tmp_path, bars):
    tok = ToyTokenizer()
    replicas = [ListeningEngine(tok, latency_s=0.001) for _ in range(2)]
    _evaluate(tmp_path, replicas, tok, _specs(tok, n_questions=2, runs=2), concurrency=2)
    assert all(e.token_listener == bars[0].generated for e in replicas)
    assert bars[0].tokens == sum(r.output_len for e in replicas for r in e.requests) > 0


@pytest.mark.slow
def test_hf_replicas_give_the_records_of_one_engine(tmp_path, tiny_model_dir):
    """Two real HF engines against one: at concurrency 1 each request decodes alone on whichever replica runs it,
    so the records must match exactly (seeded sampling, no state carried between requests). Concurrent requests
    would share a padded batch, whose different padding may move a sampled token near a top-p edge: replicas
    change who shares a batch, so exact equality is asserted only here."""
    from transformers import AutoTokenizer

    from arpo.engine.config import EngineConfig
    from arpo.engine.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = EngineConfig(model_path=str(tiny_model_dir), name="hf", seed=0)
    specs = _specs(tok, n_questions=1, runs=2)
    one = HFEngine(cfg)
    try:
        _, alone = _evaluate(tmp_path / "one", one, tok, specs, concurrency=1, max_response_length=24)
    finally:
        one.shutdown()
    replicas = [HFEngine(cfg) for _ in range(2)]
    try:
        runner, spread = _evaluate(tmp_path / "two", replicas, tok, specs, concurrency=1, max_response_length=24)
    finally:
        for e in replicas:
            e.shutdown()
    assert runner.replica_samples == [1, 1]
    assert spread == alone


class RemoteClient:
    """Stands in for a Ray replica's client (arpo.engine.ray_engine.RayEngineClient): every public name is an awaitable
    remote call, so it seems to have any attribute, ``token_listener`` included."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args, **kwargs):
            return await getattr(self.engine, name)(*args, **kwargs)
        return call


def test_bar_counts_the_tokens_of_ray_replicas(tmp_path, bars):
    tok = ToyTokenizer()
    engines = [ScriptedEngine(tok, latency_s=0.001) for _ in range(2)]
    _evaluate(tmp_path, [RemoteClient(e) for e in engines], tok, _specs(tok, n_questions=2, runs=2), concurrency=2)
    assert bars[0].tokens == sum(r.output_len for e in engines for r in e.requests) > 0


def _eval_cfg(**rollout):
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"num_replicas": None, "ray_actor": False,
                                                               "tensor_model_parallel_size": 1, **rollout}}})


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("gpus, tp, set_replicas, expected", [
    (0, 1, None, 1),     # CPU: one engine
    (8, 1, None, 8),     # every GPU generates
    (8, 2, None, 4),     # one replica per tensor-parallel group
    (8, 1, 1, 1),        # a number is taken as set
    (0, 1, 2, 2),
])
def test_eval_replicas_by_visible_gpus(monkeypatch, gpus, tp, set_replicas, expected):
    _gpus(monkeypatch, gpus)
    cfg = _eval_cfg(tensor_model_parallel_size=tp, num_replicas=set_replicas)
    assert evaluate_module.eval_replicas(cfg) == expected


def test_start_engines_uses_ray_actors_only_for_several_replicas(monkeypatch):
    from arpo.engine import factory

    calls = []
    monkeypatch.setattr(factory, "create_engines",
                        lambda cfg, replicas=None: calls.append((bool(cfg.actor_rollout_ref.rollout.ray_actor),
                                                                 replicas)) or ["engine"] * replicas)
    _gpus(monkeypatch, 8)
    assert len(evaluate_module.start_engines(_eval_cfg())) == 8
    _gpus(monkeypatch, 0)
    assert evaluate_module.start_engines(_eval_cfg()) == ["engine"]
    assert calls == [(True, 8), (False, 1)]


def test_a_bad_replica_count_names_the_key():
    from arpo.config import ConfigError

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.num_replicas=0"):
        evaluate_module.eval_replicas(_eval_cfg(num_replicas=0))


def test_ray_replicas_are_killed_not_called():
    events = []

    class Client:  # a Ray replica's client: every other name is a remote call, kill stops the actor
        def kill(self):
            events.append("kill")

        def __getattr__(self, name):
            async def call(*args, **kwargs):
                events.append(name)
            return call

    evaluate_module._shutdown(Client())
    assert events == ["kill"]
