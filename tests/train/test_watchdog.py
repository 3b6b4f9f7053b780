import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nsa.train.watchdog import Heartbeat, Watchdog, heartbeat_path, stall_path

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120  # a subprocess that runs longer failed to exit: the test fails, never hangs

# The run directory comes as argv[1]; each script's watchdog settings are filled in below.
PROLOGUE = """
import sys, time
from nsa.train.watchdog import Watchdog
run_dir = sys.argv[1]
"""

STALL_AFTER_TWO_STEPS = PROLOGUE + """
def injected_stall():
    time.sleep(3600)

watchdog = Watchdog(run_dir, rank=3, timeout_s=1.0, poll_interval_s=0.05, exit_code=42).start()
for step in (1, 2):
    watchdog.step_done(step)
injected_stall()
"""

NO_FIRST_STEP = PROLOGUE + """
watchdog = Watchdog(run_dir, timeout_s=3600, first_timeout_s=1.0, poll_interval_s=0.05).start()
time.sleep(3600)
"""

STEADY_STEPS = PROLOGUE + """
with Watchdog(run_dir, timeout_s=0.5, poll_interval_s=0.02) as watchdog:
    end = time.monotonic() + 2.0
    step = 0
    while time.monotonic() < end:
        time.sleep(0.02)
        step += 1
        watchdog.step_done(step)
print("finished", step)
"""

GIL_HELD_AFTER_ONE_STEP = PROLOGUE + """
def injected_gil_stall():
    return sum(range(10**18))  # one C call that never releases the GIL

watchdog = Watchdog(run_dir, timeout_s=0.5, poll_interval_s=0.05, exit_code=42).start()
watchdog.step_done(1)
injected_gil_stall()
"""


def run_script(script: str, run_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script, str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)


def test_stall_writes_the_stacks_and_exits_with_the_code(tmp_path):
    result = run_script(STALL_AFTER_TWO_STEPS, tmp_path)
    assert result.returncode == 42, result.stderr
    report = stall_path(tmp_path, 3).read_text()
    assert report.startswith("stall on rank 3\n")
    assert "last step: 2\n" in report
    idle = float(re.search(r"seconds since last step: ([0-9.]+)", report).group(1))
    assert 1.0 <= idle < 30
    assert "in injected_stall" in report  # the main thread's frame, from faulthandler
    assert "MainThread" in report and "nsa-watchdog-rank3" in report
    assert str(stall_path(tmp_path, 3)) in result.stderr


def test_first_step_has_its_own_allowance(tmp_path):
    result = run_script(NO_FIRST_STEP, tmp_path)  # timeout_s alone would wait an hour
    assert result.returncode == 75, result.stderr
    assert "last step: none completed\n" in stall_path(tmp_path, 0).read_text()


def test_steady_steps_never_fire(tmp_path):
    result = run_script(STEADY_STEPS, tmp_path)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) > 25  # the loop ran for many timeouts' worth of steps
    assert not stall_path(tmp_path, 0).exists()


def test_a_main_thread_holding_the_gil_still_ends_with_a_dump(tmp_path):
    result = run_script(GIL_HELD_AFTER_ONE_STEP, tmp_path)
    assert result.returncode == 1  # faulthandler's exit: the watchdog thread never ran again
    assert "Timeout" in result.stderr and "in injected_gil_stall" in result.stderr


def watchdog_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nsa-watchdog")]


def test_stop_joins_the_thread(tmp_path):
    with Watchdog(tmp_path, rank=5, timeout_s=3600, poll_interval_s=0.01) as watchdog:
        watchdog.step_done(1)
        assert watchdog_threads() == ["nsa-watchdog-rank5"]
    assert watchdog_threads() == []
    watchdog.stop()  # a second stop is harmless
    assert not stall_path(tmp_path, 5).exists()


def test_a_watchdog_starts_once(tmp_path):
    with Watchdog(tmp_path, timeout_s=3600) as watchdog, pytest.raises(RuntimeError):
        watchdog.start()


@pytest.mark.parametrize("kwargs", [dict(timeout_s=0), dict(first_timeout_s=-1.0),
                                    dict(poll_interval_s=0.0), dict(exit_code=0),
                                    dict(exit_code=256)])
def test_invalid_settings_are_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        Watchdog(tmp_path, **kwargs)


def test_heartbeat_replaces_its_file(tmp_path):
    heartbeat = Heartbeat(tmp_path, rank=2)
    before = time.time()
    heartbeat.beat(7)
    heartbeat.beat(8)
    record = json.loads(heartbeat_path(tmp_path, 2).read_text())
    assert record.pop("time") >= before
    assert record == {"rank": 2, "step": 8, "pid": os.getpid()}
    assert [p.name for p in heartbeat_path(tmp_path, 2).parent.iterdir()] == ["rank2.json"]
