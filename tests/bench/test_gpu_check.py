"""bench/gpu_check.sh's tests stage: PART=k/n splits the test files into n disjoint shares that
together hold every file, and TESTS_LIMIT stops pytest and lists the tests it left unfinished;
its suite stage runs every share once, on lanes spread over the GPUs (run here with a stand-in
python that records pytest's arguments and its GPU)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = "tests/bench tests/eval"
STAND_IN = """import os, sys, time
if sys.argv[1:3] == ["-m", "pytest"]:
    print("PYTEST", "GPU" + os.environ.get("CUDA_VISIBLE_DEVICES", "-"), *sys.argv[3:])
    if os.environ.get("STAND_IN_HANGS"):  # one test passes, the next never ends
        print("tests/a.py::test_one PASSED [ 50%]")
        print("tests/a.py::test_two[x-1] ", flush=True)
        time.sleep(60)
    sys.exit(0)
sys.exit(1)  # "import xdist" fails: no -n
"""


def run_stage(tmp_path, stage, name, **env):
    """gpu_check.sh ``stage`` with the stand-in python, its outputs under tmp_path/name."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{stand_in}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / name
    env = dict(os.environ, PYTHON=str(python), OUT=str(out), TESTS=TARGETS, **env)
    done = subprocess.run(["bash", "bench/gpu_check.sh", stage], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return done, out


def run_tests_stage(tmp_path, part):
    done, out = run_stage(tmp_path, "tests", "out-" + part.replace("/", "-"), PART=part)
    return done, out / "tests.log"


def every_test_file():
    return sorted(str(p.relative_to(ROOT)) for d in TARGETS.split()
                  for p in (ROOT / d).rglob("test_*.py"))


def test_parts_are_disjoint_and_cover_every_test_file(tmp_path):
    every = every_test_file()
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


def test_tests_limit_stops_pytest_and_lists_the_tests_it_left_unfinished(tmp_path):
    done, out = run_stage(tmp_path, "tests", "stopped", STAND_IN_HANGS="1", TESTS_LIMIT="2")
    assert done.returncode == 1
    assert (out / "unfinished.txt").read_text().splitlines() == ["tests/a.py::test_two[x-1]"]
    assert "unfinished (stopped by TESTS_LIMIT): 1" in done.stdout


def test_a_finished_run_leaves_no_test_unfinished(tmp_path):
    done, log = run_tests_stage(tmp_path, "1/1")
    assert done.returncode == 0, done.stderr
    assert (log.parent / "unfinished.txt").read_text() == ""
    assert "unfinished" not in done.stdout


def test_suite_runs_every_share_once_on_lanes_over_every_gpu(tmp_path):
    """SHARES=5 on two GPUs with two lanes each: every share's pytest ran once, on GPU 0 or 1,
    the shares' files are every test file once, and the summary counts 5 of 5."""
    done, out = run_stage(tmp_path, "suite", "suite", GPUS="2", SHARES="5", LANES="2")
    assert done.returncode == 0, done.stderr
    files, gpus = [], set()
    for share in range(1, 6):
        (line,) = [x for x in (out / f"share{share}" / "tests.log").read_text().splitlines()
                   if x.startswith("PYTEST ")]
        gpus.add(line.split()[1])
        files += [x for x in line.split() if x.endswith(".py")]
        assert f"share {share} (GPU " in done.stdout
    assert sorted(files) == every_test_file()
    assert gpus <= {"GPU0", "GPU1"}
    assert "suite: 5 of 5 shares passed; failed or erroring: 0" in done.stdout


def test_suite_reports_shares_left_unrun_when_its_time_is_out(tmp_path):
    done, out = run_stage(tmp_path, "suite", "late", GPUS="1", SHARES="2", LIMIT="5")
    assert done.returncode == 1
    assert "share 1: not run (time)" in done.stdout and "share 2: not run (time)" in done.stdout
    assert "suite: 0 of 2 shares passed" in done.stdout
