"""bench/scale_runs.sh and bench/scale_summary.py with the tiny model on 2 CPU processes: every
phase runs, the killed run restarts and reproduces the unbroken run, its checkpoint resumes on
1 and 2 processes, and the summary reports it."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_every_phase_runs_and_the_summary_reports_it(tmp_path):
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path / "out"),
           "RUNS": str(tmp_path / "runs"), "GPU_COUNTS": "2", "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "bench/scale_runs.sh", "scaling", "long", "faults"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    status = (tmp_path / "out" / "status.txt").read_text().splitlines()
    runs = [line.split() for line in status if not line.startswith("fault:")]
    assert [name for name, _, _ in runs] == [
        "one", "ddp-2", "fsdp-2", "fsdp-tuned-2", "fsdp-ac-long-2", "unbroken-2", "killed-2",
        "resumed-1", "resumed-2"]
    assert all(code == "0" for _, _, code in runs), status
    assert "fault: kill at step 3" in status

    summary = subprocess.run([sys.executable, "bench/scale_summary.py", str(tmp_path / "out")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert "| one | 1 | 0 |" in summary.stdout and "| 1.00 |" in summary.stdout
    differences = {line.split(":")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                   if "max |loss difference|" in line}
    assert set(differences) == {"killed-2", "resumed-1", "resumed-2"}
    assert differences["killed-2"] == 0  # the same ranks redo the same steps
    assert max(differences.values()) < 1e-4  # other world sizes: float32 reduction order
