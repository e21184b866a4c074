"""Committed text says what the project is and how to use it: no notes about how a change was made (work
sessions, lent machines, numbered stops or issues, agents, internal goals) and no paths of one developer's
machine, in docs, READMEs, code and its comments, notebooks, YAML and scripts.

Result files (JSON, JSONL, CSV run records, figures' text chunks) are scanned for machine paths only: they record
how and where a run ran, with paths relative to the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from arpo.config import REPO_ROOT

TEXT_SUFFIXES = (".md", ".py", ".yaml", ".yml", ".ipynb", ".sh", ".txt", ".toml", ".cfg", ".ini")
TEXT_NAMES = ("Makefile", "run")

#: rule name -> pattern (case-insensitive)
RULES = {
    "a work session": r"\b(this|these) sessions?\b|\bsessions?['’] (machines?|fixes|CPUs?)\b",
    "a lent machine": r"\blent\b|\bloans?\b",
    "a numbered stop": r"\bstops? \d+\b",
    "an issue number": r"\bissues? #?\d+\b",
    "agents": r"\b(other|coding|AI|four|helper) agents?\b",
    "an internal goal": r"\bthe [\d.]+ ?(s|GB|x) goal\b|\bgoal (is|was) (still )?(not )?met\b",
    "a local path": r"/work/|/root/|/home/[a-z]|\.\./shared\b",
}
#: files that must name host paths: the sandbox's docs and tests list what it hides (/root, /home)
ALLOWED = {
    "a local path": ("tools/python_sandbox/", "tests/tools/test_python_sandbox"),
}
THIS_FILE = "tests/test_project_text.py"


def committed_text_files(root: Path = REPO_ROOT) -> list[str]:
    """Tracked files that are text a reader sees."""
    listed = subprocess.run(["git", "ls-files", "--cached"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return sorted(f for f in set(listed) if (f.endswith(TEXT_SUFFIXES) or Path(f).name in TEXT_NAMES)
                  and f != THIS_FILE and (root / f).is_file())


def violations(root: Path, files: list[str]) -> list[str]:
    """``path:line: [rule] text`` for every line of ``files`` a rule matches."""
    compiled = {name: re.compile(pattern, re.I) for name, pattern in RULES.items()}
    found = []
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for name, rx in compiled.items():
                if rx.search(line) and not rel.startswith(ALLOWED.get(name, ("\0",))):
                    found.append(f"{rel}:{lineno}: [{name}] {line.strip()[:160]}")
    return found


def test_committed_text_has_no_build_notes_or_local_paths():
    found = violations(REPO_ROOT, committed_text_files())
    assert not found, ("say what the project is, not how it was built; no local paths:\n" + "\n".join(found))


def test_the_rules_catch_each_kind(tmp_path):
    """Each rule fires on a line of its kind and not on the project's own words for similar things."""
    bad = {"a work session": "measured in this session", "a lent machine": "an H100 lent for 15 minutes",
           "a numbered stop": "CI at stop 33 took", "an issue number": "fixed (issue 24)",
           "agents": "other agents edit this file", "an internal goal": "the 40 s goal is not met",
           "a local path": "see ../shared/docs/notes.md or /home/alice/x"}
    good = ["a Ray session's temp dir", "pytest session fixture", "kill that session only", "ARPO_DATA (default data/arpo)",
            "the tool_agent loop", "equivalent", "issue tracker"]
    (tmp_path / "bad.md").write_text("\n".join(bad.values()) + "\n")
    (tmp_path / "good.md").write_text("\n".join(good) + "\n")
    hits = violations(tmp_path, ["bad.md", "good.md"])
    assert sorted(h.split("[")[1].split("]")[0] for h in hits) == sorted(bad)
    assert all(h.startswith("bad.md:") for h in hits)
    # a default that points at a sibling folder of one machine's checkout is a local path too
    (tmp_path / "sibling.md").write_text("ARPO_DATA (default ../shared/data/arpo)\n")
    assert [h.split("[")[1].split("]")[0] for h in violations(tmp_path, ["sibling.md"])] == ["a local path"]


#: an absolute path of one machine: a home, temp or checkout folder (the repository's own among them)
MACHINE_PATH = re.compile(r"(?<![\w.])/(work|root|tmp|Users|home/[a-z])/|" + re.escape(str(REPO_ROOT)))
RESULT_SUFFIXES = (".json", ".jsonl", ".csv", ".md", ".txt", ".ipynb", ".png")


def machine_paths(root: Path, files: list[str]) -> list[str]:
    """``path: text`` for every machine path in ``files``: text lines, and a PNG's text chunks (figure metadata)."""
    from PIL import Image

    found = []
    for rel in files:
        if rel.endswith(".png"):
            with Image.open(root / rel) as im:
                texts = [f"{k}: {v}" for k, v in getattr(im, "text", {}).items()]
        else:
            texts = (root / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        found += [f"{rel}: {t.strip()[:160]}" for t in texts if MACHINE_PATH.search(t)]
    return found


def test_committed_results_and_figures_hold_repo_relative_paths():
    listed = subprocess.run(["git", "ls-files", "--cached", "experiments/results", "docs", "notebooks"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    files = [f for f in listed if f.endswith(RESULT_SUFFIXES) and (REPO_ROOT / f).is_file()]
    assert len(files) > 100
    found = machine_paths(REPO_ROOT, files)
    assert not found, "results must hold repo-relative paths:\n" + "\n".join(found[:40])


def test_the_machine_path_scan_reads_text_and_png_chunks(tmp_path):
    from PIL import Image, PngImagePlugin

    meta = PngImagePlugin.PngInfo()
    meta.add_text("Description", f"python experiments/ablation.py --out {REPO_ROOT}/outputs/x")
    Image.new("RGB", (2, 2)).save(tmp_path / "fig.png", pnginfo=meta)
    Image.new("RGB", (2, 2)).save(tmp_path / "clean.png")
    (tmp_path / "run.json").write_text('{"model": "/tmp/smollm2-hf", "ok": "outputs/x", "url": "a/tmp/b"}\n')
    hits = machine_paths(tmp_path, ["fig.png", "clean.png", "run.json"])
    assert [h.split(":")[0] for h in hits] == ["fig.png", "run.json"]

