"""notebooks/arpo_analysis.ipynb runs top to bottom in the project's kernel: against the committed SmolLM2 ablation
(three variants, three seeds, rollout dumps) it draws every figure; against the smoke ablation's fresh results (slow:
made by tests/test_ablation.py's fixture, once per session) it reads what today's code writes; against a missing
folder it says so and skips its cells without an error."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from arpo.config import REPO_ROOT
from tests.test_ablation import smoke_ablation  # noqa: F401  (the shared session fixture)

NOTEBOOK = REPO_ROOT / "notebooks" / "arpo_analysis.ipynb"


def _execute(run_dir: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run a fresh copy of the notebook (the stored outputs are ignored) with its run-dir cell pointed at
    ``run_dir``; a cell error raises CellExecutionError."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    monkeypatch.setenv("ARPO_ANALYSIS_RUN_DIR", str(run_dir))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def _outputs(nb: nbformat.NotebookNode) -> list[list[dict]]:
    return [cell.outputs for cell in nb.cells if cell.cell_type == "code"]


def _images(outputs: list[dict]) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _text(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs)


def test_notebook_draws_every_figure_from_the_committed_smollm2_ablation(monkeypatch):
    nb = _execute(REPO_ROOT / "experiments" / "results" / "smollm2_advantage", monkeypatch)
    cells = _outputs(nb)
    assert not any(o.output_type == "error" for outputs in cells for o in outputs)
    setup, curves, table, entropy, branching, soft_hard, premise, premise_holds = cells[1:]
    assert "variants ['arpo_hard', 'arpo_soft', 'grpo'], seeds [0, 1, 2]" in _text(setup)
    assert _images(curves) == 1
    assert any("Val reward" in o.get("data", {}).get("text/markdown", "") for o in table)
    assert _images(entropy) == 1 and any("text/html" in o.get("data", {}) for o in entropy)  # curve + table
    assert _images(branching) == 1
    assert _images(soft_hard) == 2  # curves, entropy overlay
    assert any("welch_p" in o.get("data", {}).get("text/html", "") for o in soft_hard)
    # the committed premise study: one figure per probe and the premise table
    assert _images(premise) == len(list((REPO_ROOT / "experiments" / "results" / "premise").glob("*.json")))
    assert any("after - before" in o.get("data", {}).get("text/html", "") for o in premise)
    # the committed premise_holds study: its figures, or the line saying how to make it
    committed = REPO_ROOT / "experiments" / "results" / "premise_holds"
    if (committed / "cells.csv").is_file():
        figures = [f for f in ("gain_vs_premise.png", "cells.png") if (committed / f).is_file()]
        assert _images(premise_holds) == len(figures)
        assert any("above_random" in o.get("data", {}).get("text/html", "") for o in premise_holds)
    else:
        assert "python experiments/ablation.py --suite premise_holds" in _text(premise_holds)


@pytest.mark.slow
def test_notebook_reads_the_smoke_ablations_fresh_results(smoke_ablation, monkeypatch):  # noqa: F811
    nb = _execute(smoke_ablation["out"], monkeypatch)
    cells = _outputs(nb)
    assert not any(o.output_type == "error" for outputs in cells for o in outputs)
    setup, curves, table, entropy, branching, soft_hard, premise, _ = cells[1:]
    assert "variants ['arpo_hard', 'grpo'], seeds [3]" in _text(setup)
    assert _images(premise) >= 1  # the probe on the fresh rollout dumps
    assert _images(curves) == 1 and _images(entropy) == 1 and _images(branching) == 1
    assert any("Val reward" in o.get("data", {}).get("text/markdown", "") for o in table)
    # the smoke trains grpo and arpo_hard only: the soft-vs-hard cell says what it needs instead of failing
    assert _images(soft_hard) == 0 and "needs the arpo_soft and arpo_hard variants" in _text(soft_hard)


def test_notebook_without_runs_says_what_to_do_and_draws_a_premise_holds_folder(tmp_path, monkeypatch):
    from experiments.premise_holds_results import collect
    from tests.test_premise_holds import _write_cell

    study = tmp_path / "premise_holds"
    for method, final in (("grpo", {q: float(q % 2) for q in range(10)}), ("arpo", {q: 1.0 for q in range(10)})):
        _write_cell(study, 2, method, 0, final, 3.0, 4.0)
    collect(study, "header", smoke=False)
    monkeypatch.setenv("ARPO_PREMISE_HOLDS_DIR", str(study))
    nb = _execute(tmp_path / "absent", monkeypatch)
    cells = _outputs(nb)
    text = "".join(_text(outputs) for outputs in cells[:-1])
    assert "No training metrics" in text and "experiments/ablation.py" in text
    assert not any(o.output_type == "error" for outputs in cells for o in outputs)
    assert sum(_images(outputs) for outputs in cells[:-1]) == 0
    # the premise_holds section: the pooled comparison and every cell's figure from the given folder
    assert _images(cells[-1]) == 1
    assert any("arpo - grpo" in o.get("data", {}).get("text/html", "") for o in cells[-1])
