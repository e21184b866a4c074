import subprocess
import sys

import pytest

from arpo.config import REPO_ROOT, ConfigError, load_config


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match="unknown config key 'synthetic.sizes.trian'"):
        load_config("synthetic_data", ["synthetic.sizes.trian=5"])


def test_a_moved_rollout_key_names_its_new_place():
    with pytest.raises(ConfigError, match="'actor_rollout_ref.rollout.arpo.entropy_window' is now "
                                          "'actor_rollout_ref.rollout.arpo.entropy.window'"):
        load_config("arpo_trainer", ["actor_rollout_ref.rollout.arpo.entropy_window=5"])


def test_overrides_apply():
    cfg = load_config("sft", ["sft.epochs=1", "synthetic.out_dir=/x"])
    assert cfg.sft.epochs == 1 and cfg.sft.train_file == "/x/train.parquet"


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_missing_model_path_fails_with_one_line(tmp_path):
    r = _run("arpo.sft", f"actor_rollout_ref.model.path={tmp_path}/nope")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "actor_rollout_ref.model.path" in lines[0] and "arpo.models.tiny" in lines[0]


def test_cli_missing_data_file_fails_with_one_line(tiny_model_dir, tmp_path):
    r = _run("arpo.sft", f"actor_rollout_ref.model.path={tiny_model_dir}", f"sft.train_file={tmp_path}/none.parquet")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "sft.train_file" in lines[0] and "arpo.data.synthetic" in lines[0]


def test_cli_unknown_key_fails_with_one_line():
    r = _run("arpo.models.tiny", "tiny_model.hiden_size=3")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny_model.hiden_size" in lines[0]


def test_ray_address_defaults_to_ray_s_own_variable(monkeypatch):
    # Ray's convention (`ray job submit` sets it for the job's driver): a run joins $RAY_ADDRESS; a key beats it
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert load_config("arpo_trainer", []).ray_init.address is None  # a private cluster
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert load_config("arpo_trainer", []).ray_init.address == "127.0.0.1:6379"
    assert load_config("arpo_trainer", ["ray_init.address=10.0.0.1:6379"]).ray_init.address == "10.0.0.1:6379"
    assert load_config("arpo_trainer", ["ray_init.address=null"]).ray_init.address is None
