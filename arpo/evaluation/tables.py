"""Paper-style result tables from evaluation runs (the command: ``python -m arpo.tables``, :mod:`arpo.tables`).

Reads every evaluation run directory given (a folder with ``run.json`` and ``samples/``, as
``python -m arpo.eval`` writes; a folder above such run folders is searched), recomputes each run's
per-benchmark summary from its per-sample JSONL (so a table never reflects a stale summary), and writes:

- ``table1.{md,tex,csv}`` — ARPO's Table 1: math (AIME24, AIME25, MATH500, GSM8K, MATH) and knowledge
  (HotpotQA, 2Wiki, MuSiQue, Bamboogle) with the average of each group and of all ten;
- ``table2.{md,tex,csv}`` — Table 2: deep search (GAIA, HLE, WebWalker, xbench) with their average, and
  GAIA per level (Level 1-3, from the rows' ``Level``) before its overall column;
- ``other.{md,tex,csv}`` — every other benchmark found (e.g. the synthetic one), when there is any;
- ``values.csv`` — one row per (method, seed, benchmark): the number that went into the tables, the
  per-run values it is the mean of, question and sample counts, the samples that reached their response
  budget (``truncated``, ``truncated_rate``), and the samples file it came from;
- ``profiles.{md,csv}`` — every benchmark's accuracy under both metric profiles side by side, with the
  difference: ``arpo`` (the released ARPO evaluation's metrics, what the paper's tables used) and ``strict``
  (ours: math-verify, SQuAD F1). The tables themselves use ``--profile`` (default ``arpo``), named in their
  footer.

``python -m arpo.tables --training-runs <dir> --out <dir> [--baseline NAME]`` makes the ablation table of
training runs instead (``<dir>/<variant>/seed<K>/metrics.jsonl``, as ``experiments/ablation.py`` writes):
``table.md`` (:mod:`arpo.evaluation.training_tables`) with mean ± std over seeds of final validation accuracy and reward, tool calls per trajectory,
tokens generated and wall time, Welch's t-test p-values against the baseline, and ``runs.csv``.

A cell is the mean ± std over seeds (std: ddof=1; a single seed shows the mean only) of each seed's
value, which is the mean over that seed's runs of the per-run mean of ``--metric`` (default ``acc``:
math equivalence, QA F1), in percent. An average is computed per seed over the group's benchmarks and
only when the seed has all of them, so a partial average never sits next to a full one; ``Tools/q``
is the average number of executed tool calls per question over the table's benchmarks that the method
has. Missing cells show "–" (LaTeX: "--").
"""

from __future__ import annotations

import csv
import glob
import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from arpo.evaluation.metrics import (PROFILE_METRICS, PROFILE_NOTES, PROFILES, check_profile, mean_std,
                                     summarise_benchmark, summarise_profiles)
from arpo.evaluation.records import SAMPLES_DIR, load_run_samples, samples_path

logger = logging.getLogger(__name__)

DISPLAY = {
    "aime24": "AIME24", "aime25": "AIME25", "math500": "MATH500", "gsm8k": "GSM8K", "math": "MATH",
    "hotpotqa": "HotpotQA", "2wiki": "2Wiki", "musique": "MuSiQue", "bamboogle": "Bamboogle",
    "gaia": "GAIA", "hle": "HLE", "webwalker": "WebWalker", "xbench": "xbench", "simpleqa": "SimpleQA",
    "synthetic": "Synthetic",
}
MISSING = "–"


@dataclass
class TableSpec:
    """A table: named groups of benchmarks, each group followed by its average, then the overall one."""

    name: str
    title: str
    groups: list[tuple[str, list[str]]]
    overall: str | None = None
    #: benchmarks also shown per level (GAIA's Level 1-3), as columns before the benchmark's own
    levels: dict[str, list[str]] = field(default_factory=dict)

    @property
    def benchmarks(self) -> list[str]:
        return [b for _, bs in self.groups for b in bs]


TABLE1 = TableSpec("table1", "Table 1: mathematical and knowledge-intensive reasoning", [
    ("Math", ["aime24", "aime25", "math500", "gsm8k", "math"]),
    ("Knowledge", ["hotpotqa", "2wiki", "musique", "bamboogle"]),
], overall="Avg.")
TABLE2 = TableSpec("table2", "Table 2: deep search", [("Deep search", ["gaia", "hle", "webwalker", "xbench"])],
                   levels={"gaia": ["1", "2", "3"]})


def level_key(benchmark: str, level: Any) -> str:
    """Summary key of one level of a benchmark (records with ``meta.level``), e.g. ``gaia@L2``."""
    return f"{benchmark}@L{level}"


@dataclass
class RunResult:
    """One evaluation run directory (one method, one seed), summarised per benchmark."""

    method: str
    seed: int
    run_dir: Path
    #: benchmark (and ``bench@L<level>``) -> summary under the chosen metric profile (benchmarks: with
    #: ``acc_by_profile``, see :func:`~arpo.evaluation.metrics.summarise_profiles`)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the settings its samples were made with (run.json, less method and seed): folders join only if equal
    settings: dict[str, Any] = field(default_factory=dict)
    #: benchmark -> the folder its samples are in, when several folders make one run (one per GPU)
    sources: dict[str, Path] = field(default_factory=dict)


def find_run_dirs(patterns: Sequence[str]) -> list[Path]:
    """Run directories named by ``patterns`` (paths or globs); folders above run folders are searched."""
    found: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
        if not matches:
            raise FileNotFoundError(f"--runs {pattern}: matches nothing")
        for m in matches:
            p = Path(m)
            if (p / "run.json").is_file():
                found.append(p)
            elif p.is_dir():
                found.extend(sorted(r.parent for r in p.rglob("run.json")))
    unique = list(dict.fromkeys(p.resolve() for p in found))
    if not unique:
        raise FileNotFoundError(f"--runs {' '.join(patterns)}: no evaluation run directories (folders with "
                                f"run.json and {SAMPLES_DIR}/) found")
    return unique


def load_run(run_dir: Path, profile: str = "arpo") -> RunResult:
    meta = json.loads((run_dir / "run.json").read_text())
    from arpo.evaluation.evaluate import FINGERPRINT_KEYS

    result = RunResult(str(meta["method"]), int(meta["seed"]), run_dir,
                       settings={k: meta.get(k) for k in FINGERPRINT_KEYS if k not in ("method", "seed")})
    threshold = float(meta.get("pass_threshold", 1.0))
    for bench, records in load_run_samples(run_dir).items():
        if records:
            result.summaries[bench.lower()] = summarise_profiles(records, threshold, profile)
        by_level: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            if (r.get("meta") or {}).get("level") is not None:
                by_level[str(r["meta"]["level"])].append(r)
        for level, level_records in by_level.items():
            result.summaries[level_key(bench.lower(), level)] = summarise_benchmark(level_records, threshold,
                                                                                    profile=profile)
    return result


def load_runs(run_dirs: Sequence[Path], profile: str = "arpo") -> list[RunResult]:
    """One result per (method, seed). Folders of one method and seed with other benchmarks and the same settings
    join into one (an evaluation split over GPUs, a folder each); overlapping ones are an error."""
    joined: dict[tuple[str, int], RunResult] = {}
    for d in run_dirs:
        r = load_run(d, profile)
        r.sources = dict.fromkeys(r.summaries, r.run_dir)
        first = joined.setdefault((r.method, r.seed), r)
        if first is r:
            continue
        shared = sorted(set(first.summaries) & set(r.summaries))
        if shared or first.settings != r.settings:
            why = f"both have {shared[0]}" if shared else "their settings differ (run.json)"
            raise ValueError(f"two runs for method {r.method!r} seed {r.seed}: {first.run_dir} and {r.run_dir}, "
                             f"{why}; give one (or tag them with different eval.method/eval.seed)")
        first.summaries.update(r.summaries)
        first.sources.update(r.sources)
    return list(joined.values())


def seed_value(summary: dict[str, Any], metric: str) -> tuple[float | None, list[float]]:
    """The value of one run for ``metric`` (mean over its runs) and the per-run values behind it."""
    if metric.startswith("pass@"):
        value = summary["pass@k"].get(metric[len("pass@"):])
        return value, ([value] if value is not None else [])
    if metric not in summary:
        profile = summary.get("metric_profile", "strict")
        raise ValueError(f"--metric {metric}: not a metric of profile {profile}; use one of "
                         f"{', '.join(PROFILE_METRICS[profile])} or pass@<k>")
    return summary[metric]["mean"], list(summary[metric]["per_run"])


@dataclass
class Cell:
    """Values of one (method, column) over seeds."""

    values: list[float]

    @property
    def stats(self) -> dict[str, Any]:
        return mean_std(self.values)


def build_cells(runs: list[RunResult], spec: TableSpec, metric: str) -> dict[str, dict[str, Cell]]:
    """method -> column -> cell, for the spec's benchmarks, group averages, overall average and Tools/q."""
    by_method: dict[str, list[RunResult]] = defaultdict(list)
    for r in runs:
        by_method[r.method].append(r)
    table: dict[str, dict[str, Cell]] = {}
    for method, method_runs in by_method.items():
        cols: dict[str, list[float]] = defaultdict(list)
        for run in sorted(method_runs, key=lambda r: r.seed):
            per_bench = {b: seed_value(run.summaries[b], metric)[0] for b in spec.benchmarks if b in run.summaries}
            per_bench = {b: v for b, v in per_bench.items() if v is not None}
            for b, v in per_bench.items():
                cols[b].append(v)
            for b, levels in spec.levels.items():
                for level in levels:
                    key = level_key(b, level)
                    value = seed_value(run.summaries[key], metric)[0] if key in run.summaries else None
                    if value is not None:
                        cols[key].append(value)
            for group, benches in spec.groups:
                if _has_group_avg(spec, benches):
                    if all(b in per_bench for b in benches):
                        cols[_avg_col(group)].append(sum(per_bench[b] for b in benches) / len(benches))
            if spec.overall and all(b in per_bench for b in spec.benchmarks):
                cols[spec.overall].append(sum(per_bench.values()) / len(per_bench))
            tools = [run.summaries[b]["tool_calls_total"]["mean"] for b in spec.benchmarks if b in run.summaries]
            if tools:
                cols["Tools/q"].append(sum(tools) / len(tools))
        if any(b in r.summaries for r in method_runs for b in spec.benchmarks):
            table[method] = {c: Cell(v) for c, v in cols.items()}
    return table


def _avg_col(group: str) -> str:
    return f"{group} avg."


def _has_group_avg(spec: TableSpec, benches: list[str]) -> bool:
    # a group's own average unless the overall one says the same; never for a single benchmark
    return len(benches) > 1 and (len(spec.groups) > 1 or spec.overall is None)


def columns(spec: TableSpec) -> list[tuple[str, str]]:
    """(key, header) pairs in display order."""
    cols: list[tuple[str, str]] = []
    for group, benches in spec.groups:
        for b in benches:
            name = DISPLAY.get(b, b)
            cols.extend((level_key(b, level), f"{name} L{level}") for level in spec.levels.get(b, []))
            cols.append((b, name))
        if _has_group_avg(spec, benches):
            cols.append((_avg_col(group), _avg_col(group)))
    if spec.overall:
        cols.append((spec.overall, spec.overall))
    cols.append(("Tools/q", "Tools/q"))
    return cols


def fmt(cell: Cell | None, scale: float, digits: int, pm: str = " ± ", missing: str = MISSING) -> str:
    if cell is None or not cell.values:
        return missing
    s = cell.stats
    text = f"{s['mean'] * scale:.{digits}f}"
    if s["std"] is not None:
        text += f"{pm}{s['std'] * scale:.{digits}f}"
    return text


def _scale_for(col: str, scale: float) -> float:
    return 1.0 if col == "Tools/q" else scale


def to_markdown(spec: TableSpec, cells: dict[str, dict[str, Cell]], methods: list[str], scale: float,
                digits: int, note: str) -> str:
    cols = columns(spec)
    lines = [f"**{spec.title}**", "", "| Method | " + " | ".join(h for _, h in cols) + " |",
             "|---|" + "|".join("---:" for _ in cols) + "|"]
    for m in methods:
        row = [fmt(cells[m].get(k), _scale_for(k, scale), digits if k != "Tools/q" else 2) for k, _ in cols]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines + ["", note, ""])


def _tex_escape(s: str) -> str:
    return s.replace("\\", "\\textbackslash{}").replace("&", "\\&").replace("%", "\\%").replace("_", "\\_") \
        .replace("#", "\\#")


def to_latex(spec: TableSpec, cells: dict[str, dict[str, Cell]], methods: list[str], scale: float,
             digits: int, note: str) -> str:
    cols = columns(spec)
    head = " & ".join(_tex_escape(h) for _, h in cols)
    lines = [
        "% " + note,
        "\\begin{table}[t]", "\\centering", "\\small",
        f"\\caption{{{_tex_escape(spec.title)}}}",
        f"\\label{{tab:{spec.name}}}",
        "\\begin{tabular}{l" + "c" * len(cols) + "}", "\\toprule",
        f"Method & {head} \\\\", "\\midrule",
    ]
    for m in methods:
        row = [fmt(cells[m].get(k), _scale_for(k, scale), digits if k != "Tools/q" else 2, pm=" $\\pm$ ",
                   missing="--") for k, _ in cols]
        lines.append(f"{_tex_escape(m)} & " + " & ".join(row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]
    return "\n".join(lines)


def to_csv_rows(spec: TableSpec, cells: dict[str, dict[str, Cell]], methods: list[str],
                scale: float) -> list[dict[str, Any]]:
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m}
        for k, h in columns(spec):
            c = cells[m].get(k)
            s = c.stats if c is not None and c.values else {"mean": None, "std": None, "n": 0}
            sc = _scale_for(k, scale)
            row[f"{h} mean"] = "" if s["mean"] is None else round(s["mean"] * sc, 6)
            row[f"{h} std"] = "" if s["std"] is None else round(s["std"] * sc, 6)
            row[f"{h} seeds"] = s["n"]
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows as CSV with the union of their keys as columns (first-seen order)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def value_rows(runs: list[RunResult], metric: str) -> list[dict[str, Any]]:
    rows = []
    for r in sorted(runs, key=lambda r: (r.method, r.seed)):
        for key in sorted(r.summaries):
            s = r.summaries[key]
            bench = key.split("@", 1)[0]
            value, per_run = seed_value(s, metric)
            rows.append({
                "method": r.method, "seed": r.seed, "benchmark": key, "metric": metric,
                "value": "" if value is None else value,
                "per_run_values": ";".join(f"{v:.6g}" for v in per_run),
                "std_over_runs": s[metric]["std"] if metric in s and s[metric]["std"] is not None else "",
                "num_runs": s["num_runs"], "num_questions": s["num_questions"], "num_samples": s["num_samples"],
                "tool_calls_per_question": s["tool_calls_total"]["mean"],
                "search_per_question": s["tool_calls_search"]["mean"],
                "python_per_question": s["tool_calls_python"]["mean"],
                "truncated": s["truncated"]["count"],
                "truncated_rate": "" if s["truncated"]["rate"] is None else s["truncated"]["rate"],
                "samples_file": str(samples_path(r.sources.get(bench, r.run_dir), bench)),
            })
    return rows


def other_spec(runs: list[RunResult]) -> TableSpec | None:
    known = set(TABLE1.benchmarks) | set(TABLE2.benchmarks)
    rest = sorted({b for r in runs for b in r.summaries if "@" not in b} - known)
    return TableSpec("other", "Other benchmarks", [("Other", rest)]) if rest else None


def profile_rows(runs: list[RunResult]) -> list[dict[str, Any]]:
    """Per (method, benchmark): the headline accuracy under each profile (mean over seeds) and the difference."""
    rows = []
    for method in sorted({r.method for r in runs}):
        method_runs = [r for r in runs if r.method == method]
        for bench in sorted({b for r in method_runs for b in r.summaries if "@" not in b}):
            accs = [r.summaries[bench]["acc_by_profile"] for r in method_runs if bench in r.summaries]
            means = {p: mean_std([a[p]["mean"] for a in accs if a[p]["mean"] is not None])["mean"]
                     for p in PROFILES}
            diff = None if None in means.values() else means["strict"] - means["arpo"]
            rows.append({"method": method, "benchmark": bench, **{f"acc_{p}": means[p] for p in PROFILES},
                         "strict_minus_arpo": diff, "seeds": len(accs),
                         "samples": sum(r.summaries[bench]["num_samples"] for r in method_runs
                                        if bench in r.summaries)})
    return rows


def profiles_markdown(rows: list[dict[str, Any]], digits: int) -> str:
    lines = ["**Accuracy under both metric profiles** (percent; mean over seeds)", "",
             "| Method | Benchmark | arpo | strict | strict − arpo | samples |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        cells = [MISSING if r[k] is None else f"{100 * r[k]:.{digits}f}" for k in ("acc_arpo", "acc_strict")]
        diff = MISSING if r["strict_minus_arpo"] is None else f"{100 * r['strict_minus_arpo']:+.{digits}f}"
        lines.append(f"| {r['method']} | {DISPLAY.get(r['benchmark'], r['benchmark'])} | {cells[0]} | {cells[1]} | "
                     f"{diff} | {r['samples']} |")
    return "\n".join(lines + ["", f"{PROFILE_NOTES['arpo']}; {PROFILE_NOTES['strict']}.", ""])


def load_reference(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """Reported rows to print beside ours (``configs/paper_reported.yaml``): table name -> row label -> column
    header -> value in percent. A table, header or value the tables do not have is one error naming it."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    specs = {spec.name: spec for spec in (TABLE1, TABLE2)}
    if not isinstance(raw, dict):
        raise ValueError(f"--reference {path}: expected a mapping of {sorted(specs)} to rows")
    reference: dict[str, dict[str, dict[str, float]]] = {}
    for table, rows in raw.items():
        if table not in specs or not isinstance(rows, dict):
            raise ValueError(f"--reference {path}: {table!r} is not a table of rows; use {sorted(specs)}")
        headers = [h for _, h in columns(specs[table])]
        for label, cells in rows.items():
            cells = cells or {}
            for header, value in cells.items():
                if header not in headers:
                    raise ValueError(f"--reference {path}: {table}, row {label!r}: no column {header!r}; the "
                                     f"columns are {headers}")
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError(f"--reference {path}: {table}, row {label!r}, {header}: {value!r} is not a number")
            reference.setdefault(table, {})[str(label)] = {h: float(v) for h, v in cells.items()}
    return reference


def _reference_cells(spec: TableSpec, rows: dict[str, dict[str, float]], scale: float) -> dict[str, dict[str, Cell]]:
    """Reported rows as cells (one value each, stored unscaled like ours), with the group and overall averages
    computed from them as ours are: only over a row that has every benchmark of the group (the paper's own
    averages may span other tasks, so they are not taken from it)."""
    key_of = {h: k for k, h in columns(spec)}
    table = {}
    for label, cells in rows.items():
        row = {key_of[h]: Cell([v / _scale_for(key_of[h], scale)]) for h, v in cells.items()}
        values = {b: row[b].values[0] for b in spec.benchmarks if b in row}
        for group, benches in spec.groups:
            if _has_group_avg(spec, benches) and all(b in values for b in benches):
                row[_avg_col(group)] = Cell([sum(values[b] for b in benches) / len(benches)])
        if spec.overall and len(values) == len(spec.benchmarks):
            row[spec.overall] = Cell([sum(values.values()) / len(values)])
        table[label] = row
    return table


def make_tables(run_patterns: Sequence[str], out_dir: str | Path, metric: str = "acc", digits: int = 1,
                methods: Sequence[str] | None = None, profile: str = "arpo",
                reference: str | Path | None = None) -> dict[str, Path]:
    """Write every table, values.csv and the profile comparison under ``out_dir``; return the paths written.
    ``reference``: a file of reported rows (:func:`load_reference`) printed after ours in Tables 1 and 2."""
    check_profile(profile)
    reported = load_reference(reference) if reference else {}
    runs = load_runs(find_run_dirs(run_patterns), profile)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = list(methods) if methods else sorted({r.method for r in runs})
    unknown = [m for m in order if m not in {r.method for r in runs}]
    if unknown:
        raise ValueError(f"--methods: no runs for {unknown}; found {sorted({r.method for r in runs})}")
    scale = 1.0 if metric in ("score",) else 100.0
    seeds = sorted({r.seed for r in runs})
    note = (f"{metric} in percent; mean ± std over seeds (ddof=1, one seed: mean only) of the mean over runs; "
            f"Tools/q: executed tool calls per question; {MISSING}: no result. Runs: {len(runs)}, seeds {seeds}. "
            f"{PROFILE_NOTES[profile][0].upper()}{PROFILE_NOTES[profile][1:]}."
            + (f" Rows after ours: reported numbers ({Path(reference).name}), one value each; their averages "
                  f"computed from those cells as ours are." if reported else ""))
    written: dict[str, Path] = {}
    for spec in [TABLE1, TABLE2, other_spec(runs)]:
        if spec is None:
            continue
        cells = build_cells(runs, spec, metric)
        rows_methods = [m for m in order if m in cells]
        if not rows_methods:
            rows_methods = list(order)
            cells = {m: {} for m in order}
        extra = _reference_cells(spec, reported.get(spec.name, {}), scale)
        cells = {**cells, **extra}
        rows_methods = rows_methods + [label for label in extra if label not in rows_methods]
        for ext, text in (("md", to_markdown(spec, cells, rows_methods, scale, digits, note)),
                          ("tex", to_latex(spec, cells, rows_methods, scale, digits, note))):
            path = out / f"{spec.name}.{ext}"
            path.write_text(text, encoding="utf-8")
            written[f"{spec.name}.{ext}"] = path
        path = out / f"{spec.name}.csv"
        write_csv(path, to_csv_rows(spec, cells, rows_methods, scale))
        written[f"{spec.name}.csv"] = path
    path = out / "values.csv"
    write_csv(path, value_rows(runs, metric) or [{"method": ""}])
    written["values.csv"] = path
    rows = profile_rows(runs)
    written["profiles.md"] = out / "profiles.md"
    written["profiles.md"].write_text(profiles_markdown(rows, digits), encoding="utf-8")
    written["profiles.csv"] = out / "profiles.csv"
    write_csv(written["profiles.csv"], rows or [{"method": ""}])
    return written
