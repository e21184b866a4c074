"""The premise table of the study: one row per probe JSON, event kind and measure (Markdown on stdout).

    python experiments/results/premise/table.py experiments/results/premise > table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


#: who scored a probe, by its file stem's prefix (the study's naming)
SCORERS = {"smollm2_zeroshot": "SmolLM2-135M-Instruct zero-shot", "smollm2_sft": "SmolLM2 after make run's SFT",
           "smollm2_rl": "SmolLM2 after SFT + 8 ARPO steps"}


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    print("| source | scored by | measure | tool / control | trajectories | events | after − before [95% CI] |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(folder.glob("*.json")):
        summary = json.loads(path.read_text())
        scorer = (next((who for stem, who in SCORERS.items() if path.stem.startswith(stem)), summary.get("model"))
                  + " (teacher-forced)") if summary["settings"]["teacher_forced"] else "recorded by the rollout"
        for measure, rows in summary["premise"].items():
            for kind, s in rows.items():
                events = summary["events"].get(kind, sum(summary["events"].get(t, 0) for t in ("search", "python")))
                ci = "n/a" if s["lo"] is None else f"[{s['lo']:+.4f}, {s['hi']:+.4f}]"
                print(f"| {path.stem} | {scorer} | {measure} | {kind} | {s['n']} | {events} | "
                      f"{s['mean']:+.4f} {ci} |")


if __name__ == "__main__":
    main()
