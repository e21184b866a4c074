"""Checkpoint retention (trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep): old step directories go, the
critic shards of older ones go, and the checkpoint a resume would read is never removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo.config import load_config
from arpo.trainer.checkpoint import TRACKER_FILE, CheckpointManager, save_checkpoint


class _Group:
    """Writes what a real worker group writes first (contents.json), enough for the manager's bookkeeping."""

    def save_checkpoint(self, out: str, contents=None) -> None:
        Path(out).mkdir(parents=True)
        (Path(out) / "contents.json").write_text(json.dumps({"contents": contents}))


def _save(mgr: CheckpointManager, *steps: int) -> None:
    for step in steps:
        save_checkpoint(mgr, step, _Group(), critic_group=_Group())


def test_default_keeps_the_newest_two():
    t = load_config("arpo_trainer", ["actor_rollout_ref.model.path=unused"]).trainer
    assert (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) == (2, 2)


def test_old_steps_go_and_older_critics_go_first(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=3, max_critic_to_keep=1)
    _save(mgr, 10, 20, 30, 40)
    assert mgr.complete_steps() == [20, 30, 40]
    assert [s for s in mgr.complete_steps() if (mgr.step_dir(s) / "critic").is_dir()] == [40]
    assert all((mgr.step_dir(s) / "actor" / "contents.json").exists() for s in (20, 30, 40))
    assert mgr.resolve_resume("auto") == mgr.step_dir(40)


def test_the_checkpoint_resume_would_use_is_never_removed(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1, max_critic_to_keep=1)
    _save(mgr, 10, 20, 30)
    assert mgr.complete_steps() == [30]
    # A run resumed from an older checkpoint (step 10, given as a path) writes step 20 again while step 30 of the
    # abandoned run is still there: the step just written (the tracker's) stays, and so does step 30, which
    # resume_mode auto reads (the newest complete directory), each with its critic.
    _save(CheckpointManager(tmp_path), 10)
    resumed = CheckpointManager(tmp_path, max_to_keep=1, max_critic_to_keep=1)
    assert resumed.resolve_resume(str(tmp_path / "global_step_10")) == tmp_path / "global_step_10"
    _save(resumed, 20)
    assert (tmp_path / TRACKER_FILE).read_text() == "20"
    assert resumed.complete_steps() == [20, 30] and resumed.resolve_resume("auto") == tmp_path / "global_step_30"
    assert all((resumed.step_dir(s) / "critic" / "contents.json").exists() for s in (20, 30))
    _save(resumed, 40)  # the run moves past it: retention applies again
    assert resumed.complete_steps() == [40]


@pytest.mark.parametrize("key", ["max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"])
def test_bad_retention_is_one_error_naming_the_key(tmp_path, key):
    from arpo.config import ConfigError
    from arpo.trainer.actor_config import validate_actor_config

    cfg = load_config("arpo_trainer", ["actor_rollout_ref.model.path=unused", f"trainer.{key}=0"])
    with pytest.raises(ConfigError, match=f"trainer.{key} must be null \\(keep all\\) or >= 1, got 0"):
        validate_actor_config(cfg)
    with pytest.raises(ValueError, match=f"trainer.{key} must be null"):
        CheckpointManager(tmp_path, **{"max_to_keep" if "actor" in key else "max_critic_to_keep": 0})
