"""Where training reports go: JSON lines in the run directory and a progress display."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl``; every record has a ``step``.

    Opening it for a run that starts after ``start_step`` steps keeps only the records up to
    that step: the ones a crashed run wrote after its last checkpoint are about to be redone.
    """

    def __init__(self, run_dir: Path, start_step: int):
        self.path = run_dir / METRICS
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics file (none if it does not exist; a torn last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Progress:
    """A tqdm bar when tqdm is installed, else one printed line per update."""

    def __init__(self, start: int, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.total = total
        self.bar = None if tqdm is None else tqdm(initial=start, total=total, unit="step",
                                                  dynamic_ncols=True)

    def update(self, step: int, summary: str) -> None:
        if self.bar is None:
            print(f"step {step}/{self.total} | {summary}", flush=True)
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(summary)

    def write(self, message: str) -> None:
        if self.bar is None:
            print(message, flush=True)
        else:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
