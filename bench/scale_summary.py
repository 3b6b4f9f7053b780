"""The tables of bench/scale_runs.sh from its $OUT: speed per GPU against one GPU, memory, and
whether the killed and resumed runs reproduce the unbroken run's losses.

    python3 bench/scale_summary.py /tmp/scale
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from nsa.train.metrics import read_metrics


def speed(records: list[dict]) -> float | None:
    """Median tokens/s of the logged intervals after the first (which includes compiling)."""
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return statistics.median(rates) if rates else None


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    status, notes = {}, []
    for line in (args.out / "status.txt").read_text().splitlines():
        if match := re.fullmatch(r"(\S+) (\d+) (-?\d+)", line):
            status[match[1]] = (int(match[2]), int(match[3]))
        else:
            notes.append(line)
    runs = {name: read_metrics(args.out / f"{name}.metrics.jsonl") for name in status
            if (args.out / f"{name}.metrics.jsonl").exists()}

    print("| run | processes | exit | tokens/s (all) | per process ÷ one | peak GB per GPU |")
    print("|---|---|---|---|---|---|")
    one = speed(runs.get("one", []))
    for name, (n, code) in status.items():
        rate = speed(runs.get(name, []))
        peaks = [r["peak_mem_gb"] for r in runs.get(name, []) if "peak_mem_gb" in r]
        ratio = f"{rate / n / one:.2f}" if rate and one else "—"
        print(f"| {name} | {n} | {code} | {f'{rate:,.0f}' if rate else '—'} | {ratio} | "
              f"{f'{max(peaks):.1f}' if peaks else '—'} |")
    for note in notes:
        print(f"\n{note}")

    unbroken = next((losses(r) for name, r in runs.items() if name.startswith("unbroken")), {})
    for name, records in runs.items():
        if name.startswith(("killed", "resumed")) and unbroken:
            mine = losses(records)
            common = sorted(set(mine) & set(unbroken))
            if common:
                worst = max(abs(mine[s] - unbroken[s]) for s in common)
                print(f"{name}: steps {common[0]}-{common[-1]} against the unbroken run, "
                      f"max |loss difference| {worst:.2e}")


if __name__ == "__main__":
    main()
