"""``python -m arpo.data.release``: the public release into one data root, from a local copy (``--source``) and
through the real fetch path offline (the Hub client on a prebuilt cache, git on a local repository laid out like
the official one), then every default path of the configs resolves under ``ARPO_DATA``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arpo.data import release
from tests.conftest import REPO

SHAREGPT = REPO / "tests" / "fixtures" / "sft" / "sharegpt_arpo.json"
PARTS_WITHOUT_SFT = "rl-reasoning,rl-deepsearch,eval,search-cache"


def run_release(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arpo.data.release", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_a_local_copy_installs_the_layout_and_its_manifest_verifies(shared_data, tmp_path):
    root = tmp_path / "root"
    r = run_release("--only", PARTS_WITHOUT_SFT, "--source", str(shared_data), "--root", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((root / "manifest.json").read_text())
    files = manifest["files"]
    assert files["rl/train_10k.parquet"]["rows"] == 10000 and files["rl/valid.parquet"]["rows"] == 180
    assert files["search_cache/search_cache.json"]["rows"] == 1000
    assert {f"eval/{b}/test.jsonl" for b in release.EVAL_BENCHMARKS} <= set(files)
    for rel, entry in files.items():  # byte-identical copies, each hashed
        assert (root / rel).read_bytes() == (shared_data / rel).read_bytes()
        assert entry["sha256"] == release.sha256(root / rel) and entry["source"].startswith(("hub:", "github:"))
    assert "all verify" in r.stdout
    # a changed byte is found, named, and fails the check
    (root / "rl" / "valid.parquet").write_bytes(b"x" + (root / "rl" / "valid.parquet").read_bytes()[1:])
    r = run_release("--verify", "--root", str(root))
    assert r.returncode == 1 and "rl/valid.parquet: differs from the manifest" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "rl"], "--only rl: not a part of the release; the parts are sft, rl-reasoning"),
    (["--only", "eval", "--source", "/nonexistent/copy"], "--source /nonexistent/copy: no such directory"),
    (["--verify"], "manifest.json: no manifest; fetch the release first"),
])
def test_bad_input_is_one_line_naming_it(tmp_path, args, message):
    r = run_release(*args, "--root", str(tmp_path / "root"))
    assert r.returncode == 1 and message in r.stdout and len(r.stdout.strip().splitlines()) == 1


def test_a_file_that_is_not_what_its_part_needs_is_refused(tmp_path):
    src = tmp_path / "src" / "search_cache"
    src.mkdir(parents=True)
    (src / "search_cache.json").write_text("[1, 2]")
    with pytest.raises(release.ReleaseError, match="search cache must map queries to results"):
        release.fetch(["search-cache"], tmp_path / "root", tmp_path / "src")
    (src / "search_cache.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(release.ReleaseError, match="a git-lfs pointer, not the data"):
        release.fetch(["search-cache"], tmp_path / "root", tmp_path / "src")
    assert not (tmp_path / "root" / "search_cache").exists() or not any((tmp_path / "root" / "search_cache").iterdir())


def _hub_cache(cache: Path, repo: str, commit: str, files: dict[str, Path]) -> None:
    """A Hugging Face cache holding ``repo`` at ``commit`` as ``main``: what a finished download leaves."""
    base = cache / f"datasets--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    for name, src in files.items():
        dest = base / "snapshots" / commit / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


def _official_repo(path: Path, data: Path) -> str:
    """A git repository laid out as the official ARPO repository, from the release files; its commit."""
    for rel, dest in (("eval", "evaluation/data"), ("rl", "ARPO/rl_datasets"), ("search_cache", "ARPO/search_cache")):
        shutil.copytree(data / rel, path / dest)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "config", "uploadpack.allowFilter", "true"], check=True)
    subprocess.run([*git, "config", "uploadpack.allowAnySHA1InWant", "true"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_the_fetch_path_offline_fills_a_root_that_every_config_reads(shared_data, tmp_path):
    cache = tmp_path / "cache"
    _hub_cache(cache, "dongguanting/ARPO-RL-Reasoning-10K", "a" * 40,
               {"train_10k.parquet": shared_data / "rl" / "train_10k.parquet"})
    _hub_cache(cache, "dongguanting/ARPO-RL-DeepSearch-1K", "b" * 40,
               {"hard_search.parquet": shared_data / "rl" / "hard_search_1k.parquet"})
    _hub_cache(cache, "dongguanting/ARPO-SFT-54K", "c" * 40, {"arpo_sft.json": SHAREGPT})
    commit = _official_repo(tmp_path / "official", shared_data)
    root = tmp_path / "root"
    env = {"HF_HUB_OFFLINE": "1", "ARPO_RELEASE_GITHUB_URL": f"file://{tmp_path / 'official'}"}
    r = run_release("--root", str(root), "--cache-dir", str(cache), "--revision", f"dongguanting/ARPO={commit}",
                    env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    files = json.loads((root / "manifest.json").read_text())["files"]
    assert files["rl/train_10k.parquet"]["revision"] == "a" * 40
    assert files["rl/hard_search_1k.parquet"]["from"] == "hard_search.parquet"
    assert files["rl/valid.parquet"]["revision"] == commit and files["eval/gaia/test.jsonl"]["source"] == \
        f"github:{release.GITHUB_REPO}"
    # the SFT set is converted to parquet and reads as the ShareGPT trajectories it was
    from arpo.data.sft_dataset import load_trajectories
    from tests.test_sft_dataset import TARGETS

    converted = load_trajectories(root / "sft" / "train.parquet", "sharegpt", TARGETS)
    assert converted == load_trajectories(SHAREGPT, "sharegpt", TARGETS)
    assert len(converted) == files["sft/train.parquet"]["rows"]
    # a rerun reuses the git checkout and the Hub cache and installs the same bytes
    again = run_release("--root", str(root), "--cache-dir", str(cache), "--revision", f"dongguanting/ARPO={commit}",
                        env=env)
    assert again.returncode == 0 and json.loads((root / "manifest.json").read_text())["files"] == files

    # ARPO_DATA alone points every default at the root: the paper preset's RL, SFT and tools, the evaluation
    from arpo.config import load_config
    from arpo.pipeline import Pipeline
    from tools.registry import load_tools

    os.environ["ARPO_DATA"], before = str(root), os.environ.get("ARPO_DATA")
    try:
        pipeline = Pipeline(tmp_path / "out", "paper_qwen2.5_7b")
        rl, sft, ev = pipeline.config("arpo_trainer"), pipeline.config("sft"), load_config("eval", [])
    finally:
        os.environ.pop("ARPO_DATA") if before is None else os.environ.__setitem__("ARPO_DATA", before)
    for path in (rl.data.train_files, rl.data.val_files, sft.sft.train_file, *(
            Path(ev.eval.data_dir) / b / "test.jsonl" for b in ev.eval.benchmarks)):
        assert Path(path).is_file() and Path(path).is_relative_to(root), path
    tools = load_tools(ev.tools)
    try:
        assert tools["search"].call_text("who is the president").startswith("Page 1")
    finally:
        tools.close()


def test_a_missing_release_file_names_the_command_that_fetches_it(tmp_path):
    from arpo.data.rl_dataset import RLDataset

    with pytest.raises(FileNotFoundError, match=r"it is part of the ARPO release, fetched by python -m "
                                                r"arpo.data.release --only rl-deepsearch"):
        RLDataset(str(tmp_path / "rl" / "hle_test.parquet"), tokenizer=None, max_prompt_length=8)
    assert release.part_of("eval/hotpotqa/test.jsonl") == "eval" and release.part_of("mine.parquet") is None
