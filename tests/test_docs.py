"""The docs site and the pages generated from the code: the site builds in strict mode (broken internal links,
anchors and missing nav pages fail it); every key of the composed training config has a YAML comment (the
configuration reference is built from them); every metric the rollout and the trainer's batch statistics log has a
glossary entry (a training step's own metrics: tests/test_examples.py; the end-to-end training runs check theirs
in tests/test_main_arpo.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo.config import REPO_ROOT


def test_site_builds_in_strict_mode_with_generated_pages(tmp_path):
    site = tmp_path / "site"  # no --quiet: it drops the warnings that --strict turns into a failure
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                        str(REPO_ROOT / "mkdocs.yml"), "-d", str(site)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    config_page = (site / "configuration" / "index.html").read_text()
    assert "actor_rollout_ref.rollout.arpo.branching.beam_size" in config_page
    assert "val-core/all/acc/mean" in (site / "metrics" / "index.html").read_text()
    assert "make_policy" in (site / "api" / "rollout" / "index.html").read_text()  # mkdocstrings rendered


def test_every_training_config_key_has_a_yaml_comment():
    import importlib

    from arpo.reference.docs_gen import TYPED_SECTIONS, undocumented_keys

    for target in TYPED_SECTIONS.values():  # the reference names the classes that validate each section
        module, _, name = target.rpartition(".")
        assert hasattr(importlib.import_module(module), name), target
    missing = undocumented_keys()
    assert not missing, ("config keys without a comment (the configuration reference is built from them):\n"
                         + "\n".join(missing))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_yaml_comments_are_read_inline_continued_and_from_a_block_above(tmp_path):
    """The comment forms of configs/: inline with continuation lines, a block over a run of sibling keys, a
    group file's package; block lists and the defaults list are skipped."""
    from arpo.reference.docs_gen import collect_config_docs, undocumented_keys

    _write(tmp_path / "main.yaml", "defaults:\n  - grp: one\n  - _self_\n\ntop:\n"
           "  lr: 1.0    # learning rate\n             #   (continued)\n"
           "  # PPO clip bounds\n  low: 0.2\n  high: 0.3\n\n  bare: 1\n"
           "  tools:\n    - class_name: x.Y\n      config: {a: 1}\n")
    _write(tmp_path / "grp" / "one.yaml", "size: 3   # rows\nnested:\n  deep: true\n")
    docs = collect_config_docs(tmp_path)
    assert docs.by_key["top.lr"][0].comment == "learning rate (continued)"
    assert docs.by_key["top.low"][0].comment == docs.by_key["top.high"][0].comment == "PPO clip bounds"
    assert docs.by_key["grp.size"][0].comment == "rows"
    assert "top.bare" not in docs.by_key and "top.tools.class_name" not in docs.written_at
    cfg = {"top": {"lr": 1.0, "low": 0.2, "high": 0.3, "bare": 1, "tools": [{"class_name": "x.Y"}]},
           "grp": {"size": 3, "nested": {"deep": True}}}
    from omegaconf import OmegaConf

    missing = undocumented_keys(OmegaConf.create(cfg), docs)
    assert [m.split(":")[0] for m in missing] == ["top.bare", "top.tools", "grp.nested.deep"]
    assert "main.yaml:12" in missing[0] and "grp/one.yaml:3" in missing[2]  # where to add the comment


@pytest.mark.parametrize("overrides", [["policy=arpo"], ["policy=aepo", "aepo.pre_monitoring=true"],
                                       ["policy=tree_grpo"], ["mode=single"], ["schedule.mode=rounds"]])
def test_glossary_covers_the_rollout_and_batch_metrics_of_every_policy(overrides):
    """Rollout metrics of each policy (scripted engine, fake tools) and the trainer's batch statistics of the
    batch it makes: every name has a glossary entry."""
    import torch

    from arpo.config import load_config
    from arpo.reference.metrics_glossary import unknown_metrics
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.testing.scripted_engine import ScriptedEngine
    from arpo.trainer.metrics import Timer, compute_data_metrics
    from tests.rollout.fake_tools import FakePython, FakeSearch

    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.rollout.arpo.{o}" for o in overrides])
    r = cfg.actor_rollout_ref.rollout
    engine = ScriptedEngine()
    gen = ARPORollout(engine, engine.tokenizer, {**dict(r.arpo), "sampling.max_response_length": 200},
                      tools=[FakeSearch(), FakePython()])
    try:
        batch = gen.generate([engine.tokenizer.encode(f"Question {i}?") for i in range(3)], seed=0)
    finally:
        gen.close()
    rollout = {k if "/" in k else f"rollout/{k}": v for k, v in batch.meta["metrics"].items()}
    scores = torch.zeros_like(batch.tensors["response_mask"], dtype=torch.float32)
    batch.tensors["token_level_scores"] = batch.tensors["token_level_rewards"] = scores
    batch.tensors["advantages"] = batch.tensors["returns"] = scores
    timer = Timer()
    with timer.phase("step"):
        pass
    names = {*rollout, *compute_data_metrics(batch), *timer.metrics(100)}
    assert len(rollout) > 20
    assert not unknown_metrics(names), f"add these to arpo/reference/metrics_glossary.py: {unknown_metrics(names)}"
