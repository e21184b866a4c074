"""The public ARPO release, fetched into one data root: ``python -m arpo.data.release``.

The release lives in two places: the Hugging Face Hub (the SFT set and the two RL training sets) and the official
GitHub repository (the evaluation sets, the validation and deep-search test splits, the recorded search cache).
Each part is fetched with the tool made for its host (``huggingface_hub.snapshot_download``; git, sparse and
shallow), both resumable, then installed under the data root in the layout every config reads::

    <root>/rl/train_10k.parquet  rl/valid.parquet  rl/hard_search_1k.parquet  rl/gaia_test.parquet  rl/hle_test.parquet
    <root>/eval/<benchmark>/test.jsonl      <root>/search_cache/search_cache.json      <root>/sft/train.parquet
    <root>/manifest.json                    (per file: where it came from, the revision, size, sha256)

``--source DIR`` installs from a local copy instead (a mirror of the Hub/GitHub files or of this layout): the
same locate–check–install path, no network. The root is ``--root``, else ``$ARPO_DATA``, else ``data/arpo``
under the repository (``data.root`` in the configs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from arpo.config import REPO_ROOT

logger = logging.getLogger("arpo.release")

MANIFEST = "manifest.json"
#: the official repository's commit the GitHub files are read at (its newest when this was written)
GITHUB_REPO, GITHUB_COMMIT = "dongguanting/ARPO", "e257337d1f105ba685057cb662c75e509d1c7b34"


@dataclass(frozen=True)
class Source:
    """Where files come from: a Hub dataset repository or the official GitHub repository."""
    host: str       # hub | github
    repo: str
    revision: str


SFT_HUB = Source("hub", "dongguanting/ARPO-SFT-54K", "main")
RL_REASONING_HUB = Source("hub", "dongguanting/ARPO-RL-Reasoning-10K", "main")
RL_DEEPSEARCH_HUB = Source("hub", "dongguanting/ARPO-RL-DeepSearch-1K", "main")
GITHUB = Source("github", GITHUB_REPO, GITHUB_COMMIT)


@dataclass(frozen=True)
class ReleaseFile:
    """One installed file: its path under the root, and the patterns that find it in its source (first match
    wins; the second layout is this one's, so a copy of an installed root is a valid ``--source``)."""
    dest: str
    source: Source
    patterns: tuple[str, ...]
    kind: str                  # rl (verl parquet) | eval (jsonl) | cache (json mapping) | sft (converted to parquet)
    required: bool = True


def _eval_file(bench: str, required: bool = True) -> ReleaseFile:
    return ReleaseFile(f"eval/{bench}/test.jsonl", GITHUB, (f"evaluation/data/{bench}/test.jsonl",
                                                             f"eval/{bench}/test.jsonl"), "eval", required)


def _rl_github(name: str) -> ReleaseFile:
    return ReleaseFile(f"rl/{name}", GITHUB, (f"ARPO/rl_datasets/{name}", f"rl/{name}"), "rl")


#: Table 1 and Table 2 benchmarks (plus SimpleQA); MATH and HLE's jsonl are large files the repository may hold
#: only as LFS pointers, so they are taken when present (HLE's parquet, rl/hle_test.parquet, is always there).
EVAL_BENCHMARKS = ("aime24", "aime25", "math500", "gsm8k", "hotpotqa", "2wiki", "musique", "bamboogle", "gaia",
                   "webwalker", "xbench", "SimpleQA")
PARTS: dict[str, tuple[ReleaseFile, ...]] = {
    "sft": (ReleaseFile("sft/train.parquet", SFT_HUB, ("*.json", "*.jsonl", "*.parquet", "**/*.json*",
                                                        "sft/train.parquet"), "sft"),),
    "rl-reasoning": (ReleaseFile("rl/train_10k.parquet", RL_REASONING_HUB,
                                 ("train_10k.parquet", "**/train_10k.parquet", "rl/train_10k.parquet"), "rl"),
                     _rl_github("valid.parquet")),
    "rl-deepsearch": (ReleaseFile("rl/hard_search_1k.parquet", RL_DEEPSEARCH_HUB,
                                  ("hard_search*.parquet", "**/hard_search*.parquet", "rl/hard_search_1k.parquet"),
                                  "rl"),
                      _rl_github("gaia_test.parquet"), _rl_github("hle_test.parquet")),
    "eval": tuple(_eval_file(b) for b in EVAL_BENCHMARKS) + (_eval_file("math", False), _eval_file("hle", False)),
    "search-cache": (ReleaseFile("search_cache/search_cache.json", GITHUB, ("ARPO/search_cache/search_cache.json",
                                                                            "search_cache/search_cache.json"),
                                 "cache"),),
}
#: the command that installs the part holding each file (for "no such file" errors anywhere in the project)
FETCH_HINT = "python -m arpo.data.release --only {part}"


def data_root(root: str | Path | None = None) -> Path:
    """The data root: ``root``, else ``$ARPO_DATA``, else ``data/arpo`` under the repository."""
    value = root or os.environ.get("ARPO_DATA")
    return Path(value).expanduser().resolve() if value else REPO_ROOT / "data" / "arpo"


def part_of(path: str | Path) -> str | None:
    """The release part that installs ``path`` (matched by its tail, e.g. ``.../rl/valid.parquet``), or None."""
    posix = Path(path).as_posix()
    for name, files in PARTS.items():
        if any(posix == f.dest or posix.endswith("/" + f.dest) for f in files):
            return name
    return None


def missing_file_hint(path: str | Path) -> str:
    """The end of a "no such file" message: the command that fetches it, when it is part of the release."""
    part = part_of(path)
    if part is None:
        return ""
    return f"; it is part of the ARPO release, fetched by {FETCH_HINT.format(part=part)} (into $ARPO_DATA)"


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# -- fetching -----------------------------------------------------------------------------------------------------

def fetch_hub(source: Source, patterns: list[str], cache_dir: Path | None) -> tuple[Path, str]:
    """Download the files matching ``patterns`` of a Hub dataset repo (resumable); its local snapshot and commit."""
    from huggingface_hub import snapshot_download

    local = Path(snapshot_download(repo_id=source.repo, repo_type="dataset", revision=source.revision,
                                   allow_patterns=patterns, cache_dir=str(cache_dir) if cache_dir else None))
    # a snapshot folder is named by the commit it holds
    return local, local.name


def fetch_github(source: Source, patterns: list[str], cache_dir: Path | None) -> tuple[Path, str]:
    """A shallow, blob-less, sparse checkout of ``source`` at its commit holding ``patterns``; reused on a rerun."""
    base = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arpo" / "release"
    repo = base / "github" / source.repo.replace("/", "+")
    url = os.environ.get("ARPO_RELEASE_GITHUB_URL", f"https://github.com/{source.repo}.git")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)

    if not (repo / ".git").is_dir():
        repo.mkdir(parents=True, exist_ok=True)
        git("init", "-q")
        git("remote", "add", "origin", url)
    git("sparse-checkout", "set", "--no-cone", *patterns)
    git("fetch", "-q", "--depth", "1", "--filter=blob:none", "origin", source.revision)
    git("checkout", "-q", "--force", "FETCH_HEAD")
    return repo, source.revision


def locate(base: Path, f: ReleaseFile) -> Path | None:
    """The first file under ``base`` matching ``f``'s patterns (the largest, when one pattern matches several)."""
    for pattern in f.patterns:
        hits = [p for p in base.glob(pattern) if p.is_file()]
        if hits:
            return max(hits, key=lambda p: p.stat().st_size)
    return None


# -- checking and installing --------------------------------------------------------------------------------------

class ReleaseError(RuntimeError):
    """A release file is missing, malformed or does not match the manifest; the message names it and the fix."""


def check(path: Path, f: ReleaseFile) -> int:
    """The row count of a located file, after checking it is what ``f`` needs (errors name the file)."""
    head = path.read_bytes()[:200]
    if head.startswith(b"version https://git-lfs"):
        raise ReleaseError(f"{path}: a git-lfs pointer, not the data ({f.dest}); fetch the LFS object or give "
                           f"--source a copy that holds it")
    if f.kind == "rl":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path)
        missing = {"prompt", "reward_model", "data_source"} - set(meta.schema_arrow.names)
        if missing:
            raise ReleaseError(f"{path}: not a verl RL parquet for {f.dest} (no column {sorted(missing)[0]})")
        return meta.metadata.num_rows
    if f.kind == "eval":
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for i, line in enumerate(lines[:3]):
            try:
                json.loads(line)
            except json.JSONDecodeError:
                raise ReleaseError(f"{path}: line {i + 1} is not JSON ({f.dest} is JSON lines)") from None
        return len(lines)
    if f.kind == "cache":
        cache = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cache, dict):
            raise ReleaseError(f"{path}: the search cache must map queries to results ({f.dest})")
        return len(cache)
    return -1  # sft: counted by the conversion


def install(src: Path, f: ReleaseFile, root: Path) -> dict:
    """Copy (or, for the SFT set, convert to parquet) ``src`` to ``root/f.dest``; its manifest entry."""
    dest = root / f.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    if f.kind == "sft" and src.suffix != ".parquet":
        import pandas as pd

        # one parquet whatever the Hub ships (a JSON list or JSON lines): sft.train_file has one fixed path
        rows = pd.read_json(src, lines=src.suffix == ".jsonl", dtype=False)
        rows.to_parquet(tmp, index=False)
        n = len(rows)
    else:
        n = check(src, f)
        shutil.copyfile(src, tmp)
        if f.kind == "sft":
            import pyarrow.parquet as pq

            n = pq.ParquetFile(tmp).metadata.num_rows
    tmp.replace(dest)  # a killed install never leaves a half-written file under its real name
    return {"path": f.dest, "from": src.name, "rows": n, "bytes": dest.stat().st_size, "sha256": sha256(dest)}


def fetch(parts: list[str], root: Path, source_dir: Path | None = None, cache_dir: Path | None = None,
          revisions: dict[str, str] | None = None) -> dict:
    """Fetch ``parts`` into ``root`` and merge them into its manifest; the manifest."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ReleaseError(f"--only {unknown[0]}: not a part of the release; the parts are {', '.join(PARTS)}")
    files = [f for p in parts for f in PARTS[p]]
    sources: dict[Source, tuple[Path, str]] = {}
    for src in dict.fromkeys(f.source for f in files):
        if source_dir is not None:
            sources[src] = (source_dir, "local")
            continue
        src = Source(src.host, src.repo, (revisions or {}).get(src.repo, src.revision))
        patterns = sorted({p for f in files if f.source.repo == src.repo for p in f.patterns})
        logger.info("fetching %s:%s@%s", src.host, src.repo, src.revision)
        fetched = (fetch_hub if src.host == "hub" else fetch_github)(src, patterns, cache_dir)
        for f in files:
            if f.source.repo == src.repo:
                sources[f.source] = fetched
    manifest = read_manifest(root) or {"files": {}}
    for part in parts:
        for f in PARTS[part]:
            base, revision = sources[f.source]
            found = locate(base, f)
            if found is None:
                if f.required:
                    raise ReleaseError(f"{f.dest}: not found in {f.source.host}:{f.source.repo} (looked for "
                                       f"{', '.join(f.patterns)})")
                logger.info("%s: not in the source (optional), skipped", f.dest)
                continue
            entry = install(found, f, root)
            entry.update(part=part, source=f"{f.source.host}:{f.source.repo}", revision=revision)
            manifest["files"][f.dest] = entry
            logger.info("%s: %s rows, %s bytes", f.dest, entry["rows"], entry["bytes"])
    manifest["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def read_manifest(root: Path) -> dict | None:
    path = root / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def verify(root: Path) -> list[str]:
    """The files under ``root`` that are missing or differ from the manifest (empty: all verify)."""
    manifest = read_manifest(root)
    if manifest is None:
        raise ReleaseError(f"{root / MANIFEST}: no manifest; fetch the release first (python -m arpo.data.release)")
    bad = []
    for rel, entry in sorted(manifest["files"].items()):
        path = root / rel
        if not path.is_file():
            bad.append(f"{rel}: missing")
        elif path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            bad.append(f"{rel}: differs from the manifest (sha256 {entry['sha256'][:12]}...)")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arpo.data.release", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts (default: all): {', '.join(PARTS)}")
    parser.add_argument("--root", default=None, help="the data root (default: $ARPO_DATA, else data/arpo)")
    parser.add_argument("--source", type=Path, default=None,
                        help="install from this local copy (Hub/GitHub file layout, or this one) instead of fetching")
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache (default: the Hub's, "
                                                                      "and ~/.cache/arpo/release for git)")
    parser.add_argument("--revision", action="append", default=[], metavar="REPO=REV",
                        help="fetch a repository at another revision, e.g. dongguanting/ARPO-SFT-54K=<commit>")
    parser.add_argument("--verify", action="store_true", help="only check the installed files against the manifest")
    args = parser.parse_args(argv)
    from arpo.runtime.logging_utils import setup_logging

    setup_logging()
    root = data_root(args.root)
    try:
        if not args.verify:
            revisions = dict(r.split("=", 1) for r in args.revision if "=" in r)
            if len(revisions) != len(args.revision):
                raise ReleaseError("--revision: give REPO=REV, e.g. dongguanting/ARPO-SFT-54K=main")
            parts = [p.strip() for p in args.only.split(",") if p.strip()]
            source = args.source.expanduser().resolve() if args.source else None
            if source is not None and not source.is_dir():
                raise ReleaseError(f"--source {args.source}: no such directory")
            fetch(parts, root, source, args.cache_dir, revisions)
        bad = verify(root)
    except (ReleaseError, subprocess.CalledProcessError) as err:
        detail = err.stderr.strip().splitlines()[-1] if isinstance(err, subprocess.CalledProcessError) else err
        print(f"arpo.data.release: {detail}")
        return 1
    for line in bad:
        print(f"arpo.data.release: {line}")
    n = len(read_manifest(root)["files"])
    print(f"{root}: {n} files, {'all verify' if not bad else f'{len(bad)} do not verify'} against {MANIFEST}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
