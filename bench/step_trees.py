"""The training step of two or more source trees side by side: bench/train_step.py run from each
tree in turn, attention kinds and trees alternating round by round in one process's calls, so
that a change is measured against its baseline on the same machine at the same time.

    # here: each revision's nsa/ and bench/ into a folder the device call carries
    python bench/step_trees.py prepare .scratch/trees main=main new=HEAD
    # on the GPU machine (carry .scratch/trees):
    python bench/step_trees.py run .scratch/trees --rounds 3 --json $OUT/steps.json -- \
        --preset m7c-125m --layers 12 --steps 10 --warmup 3 --batch 8 --cuda-graph
    python bench/plot_train_step.py steps.json docs/steps.png

``prepare`` writes each ``NAME=REV`` (a revision of this repository) as NAME/ with the
revision's ``nsa`` and ``bench`` (``git archive``), and NAME/REVISION with the commit it names.
``run`` takes the trees in that folder (or those ``--trees`` names, in its order) and, for
each round, each attention kind (``--attention``, default nsa,dense) and each tree, runs the
tree's own train_step.py with that tree first on the import path and the arguments after
``--`` (one depth: ``--layers N``); it prints one line a run
and the median step of each (tree, kind) with the ratio NSA / dense step time where both ran,
and writes the rows (attention, batch, seq, mode: the tree, run: the round, step_ms, host_ms,
tokens_per_s, memory_mb) with the device and the trees' commits for
bench/plot_train_step.py.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nsa.train.checkpoint import atomic_write_json

HERE = Path(__file__).resolve().parent
# A row of train_step.py's table: attention, layers, params (M), step, host, tokens/s, memory.
ROW = re.compile(r"^\| (\w+) \| (\d+) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \| ([\d,]+) \| ([\d.]+) \|")
HEADER = re.compile(r"^# (.*?), batch (\d+), seq (\d+),")  # its first line: device, shape


def prepare(folder: Path, specs: list[str]) -> None:
    """Each NAME=REV of ``specs`` as folder/NAME: the revision's nsa/ and bench/, and
    folder/NAME/REVISION with its commit."""
    for spec in specs:
        name, sep, rev = spec.partition("=")
        if not sep or not name or not rev or "/" in name:
            raise SystemExit(f"step_trees: error: a tree is NAME=REV, got {spec!r}")
        commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
                                cwd=HERE.parent, capture_output=True, text=True)
        if commit.returncode:
            raise SystemExit(f"step_trees: error: {rev!r} names no commit here")
        target = folder / name
        if target.exists():
            raise SystemExit(f"step_trees: error: {target} exists (remove it first)")
        folder.mkdir(parents=True, exist_ok=True)
        # Staged beside the target, so that the rename stays on one file system.
        with tempfile.TemporaryDirectory(dir=folder, prefix=".staging-") as tmp:
            archive = Path(tmp) / "tree.tar"
            subprocess.run(["git", "archive", "-o", str(archive), commit.stdout.strip(), "nsa",
                            "bench"], cwd=HERE.parent, check=True)
            staged = Path(tmp) / name
            with tarfile.open(archive) as tar:
                tar.extractall(staged, filter="data")
            (staged / "REVISION").write_text(commit.stdout)
            staged.rename(target)  # whole or not at all
        print(f"{name}: {commit.stdout.strip()}")


def one_step(tree: Path, attention: str, args: list[str]) -> dict:
    """The row of one train_step.py run from ``tree`` (its nsa first on the import path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "bench")]))
    command = [sys.executable, "train_step.py", *args, "--attention", attention]
    done = subprocess.run(command, cwd=tree / "bench", env=env, capture_output=True, text=True)
    header = next((m for m in map(HEADER.match, done.stdout.splitlines()) if m), None)
    rows = [m for m in map(ROW.match, done.stdout.splitlines()) if m]
    if done.returncode or header is None or len(rows) != 1:
        raise SystemExit(f"step_trees: error: {tree.name}, {attention}: train_step.py exit "
                         f"{done.returncode}, {len(rows)} rows (one depth a run: --layers N)"
                         f"\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    kind, _, step, host, tokens, memory = rows[0].groups()
    return {"attention": kind, "batch": int(header[2]), "seq": int(header[3]),
            "step_ms": float(step), "host_ms": float(host),
            "tokens_per_s": int(tokens.replace(",", "")), "memory_mb": float(memory),
            "device": header[1]}


def run(folder: Path, names: list[str] | None, rounds: int, kinds: list[str],
        step_args: list[str]) -> tuple[list[dict], dict[str, str]]:
    """(rows, each tree's commit) of ``rounds`` rounds over kinds × trees."""
    names = names or sorted(p.name for p in folder.iterdir() if (p / "bench").is_dir())
    missing = [n for n in names if not (folder / n / "bench" / "train_step.py").is_file()]
    if not names or missing:
        raise SystemExit(f"step_trees: error: no tree {missing or ''} in {folder} (prepare)")
    commits = {n: ((folder / n / "REVISION").read_text().strip()
                   if (folder / n / "REVISION").is_file() else "") for n in names}
    rows = []
    for round_ in range(1, rounds + 1):
        for kind in kinds:
            for name in names:
                row = one_step(folder / name, kind, step_args) | {"mode": name, "run": round_}
                rows.append(row)
                print(f"round {round_} | {name} | {kind} | {row['step_ms']:.1f} ms | host "
                      f"{row['host_ms']:.1f} | {row['tokens_per_s']:,} tok/s | "
                      f"{row['memory_mb']:.1f} MB", flush=True)
    return rows, commits


def summary(rows: list[dict], names: list[str]) -> list[str]:
    """A table line per tree: the median step of each kind, and NSA / dense (dense's step over
    NSA's: the tokens/s ratio) where both ran."""
    kinds = sorted({r["attention"] for r in rows}, key=lambda k: k != "nsa")
    lines = ["| tree | " + " | ".join(f"{k} step ms (median)" for k in kinds)
             + (" | NSA / dense |" if {"nsa", "dense"} <= set(kinds) else " |"),
             "|---" * (len(kinds) + 1 + ({"nsa", "dense"} <= set(kinds))) + "|"]
    for name in names:
        medians = {k: statistics.median(r["step_ms"] for r in rows
                                        if (r["mode"], r["attention"]) == (name, k))
                   for k in kinds}
        ratio = (f" | {medians['dense'] / medians['nsa']:.3f}x |"
                 if {"nsa", "dense"} <= set(kinds) else " |")
        lines.append(f"| {name} | " + " | ".join(f"{medians[k]:.2f}" for k in kinds) + ratio)
    return lines


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    step_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="archive revisions into FOLDER/NAME")
    p.add_argument("folder", type=Path)
    p.add_argument("trees", nargs="+", metavar="NAME=REV")
    r = sub.add_parser("run", help="time the step of each tree, alternating (train_step.py "
                                   "arguments after --)")
    r.add_argument("folder", type=Path)
    r.add_argument("--trees", default=None, help="comma-separated names (default: all, sorted)")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--attention", default="nsa,dense")
    r.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    # git archive (prepare) and train_step.py (run) work in other directories than this one.
    args.folder = args.folder.resolve()
    if args.command == "prepare":
        prepare(args.folder, args.trees)
        return
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if "--attention" in step_args:
        parser.error("give the kinds as step_trees' --attention, before --")
    names = args.trees.split(",") if args.trees else None
    rows, commits = run(args.folder, names, args.rounds, args.attention.split(","), step_args)
    print("\n".join(summary(rows, list(commits))))
    if args.json:
        atomic_write_json(args.json, {"meta": {"device": rows[0]["device"],
                                               "command": " ".join(step_args),
                                               "trees": commits},
                                      "rows": rows})


if __name__ == "__main__":
    main()
