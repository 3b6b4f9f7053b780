"""bench/gpu_check.sh's tests stage: PART=k/n splits the test files into n disjoint shares that
together hold every file (run here with a stand-in python that records pytest's arguments)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = "tests/bench tests/eval"
STAND_IN = """import sys
if sys.argv[1:3] == ["-m", "pytest"]:
    print("PYTEST", *sys.argv[3:])
    sys.exit(0)
sys.exit(1)  # "import xdist" fails: no -n
"""


def run_tests_stage(tmp_path, part):
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{stand_in}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / ("out-" + part.replace("/", "-"))
    env = dict(os.environ, PYTHON=str(python), OUT=str(out), PART=part, TESTS=TARGETS)
    done = subprocess.run(["bash", "bench/gpu_check.sh", "tests"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return done, out / "tests.log"


def test_parts_are_disjoint_and_cover_every_test_file(tmp_path):
    every = sorted(str(p.relative_to(ROOT)) for d in TARGETS.split()
                   for p in (ROOT / d).rglob("test_*.py"))
    shares = []
    for part in ("1/3", "2/3", "3/3"):
        done, log = run_tests_stage(tmp_path, part)
        assert done.returncode == 0, done.stderr
        (line,) = [x for x in log.read_text().splitlines() if x.startswith("PYTEST ")]
        assert "--durations=30" in line.split()
        shares.append([x for x in line.split() if x.endswith(".py")])
        assert f"part {part}, {len(shares[-1])} of {len(every)} test files" in done.stdout
    assert all(shares)
    assert sorted(f for share in shares for f in share) == every


@pytest.mark.parametrize("part", ["0/2", "3/2", "a/2", "1/"])
def test_a_bad_part_is_refused(tmp_path, part):
    done, _ = run_tests_stage(tmp_path, part)
    assert done.returncode == 2
    assert "PART must be k/n" in done.stderr
