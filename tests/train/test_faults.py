"""Faults a long run meets, injected for real: a rank killed mid-run under torchrun
--max-restarts, a hang inside a collective, a NaN in one rank's gradients, a kill during a
checkpoint write, a corrupted checkpoint, an unwritable or full disk. Each test checks that
nothing is lost: the run resumes exactly, stops cleanly, or fails before it starts."""

import errno
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from nsa.train import build_config, train
from nsa.train.checkpoint import (
    CheckpointCorrupted,
    CheckpointWriteError,
    RunDirError,
    checkpoint_dirs,
    latest_checkpoint,
    verify_checkpoint,
)
from nsa.train.watchdog import STALL_EXIT_CODE, stall_path
from tests.train.processes import SMALL_RUN, losses, run

RUNNER = Path(__file__).with_name("fault_runner.py")
RUN = [*SMALL_RUN, "eval_interval=100", "max_steps=8"]


def torchrun(*args, restarts=0, monitor=None):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", f"--max-restarts={restarts}"]
    if monitor is not None:
        command.append(f"--monitor-interval={monitor}")
    return [*command, *args]


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return pids


def with_fault(fault, rank, step, marker):
    return [str(RUNNER), "--fault", fault, "--rank", str(rank), "--step", str(step),
            "--marker", str(marker), "--"]


@pytest.fixture(scope="module")
def unbroken_ddp(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("unbroken")
    result = run(torchrun("-m", "nsa.train", *RUN, "parallel=ddp", f"run_dir={run_dir}"))
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(run_dir)


def test_rank_killed_mid_run_restarts_and_consumes_the_same_data(tmp_path, unbroken_ddp):
    marker = tmp_path / "fired"
    result = run(torchrun(*with_fault("kill", 1, 5, marker), "--auto-resume", *RUN,
                          "parallel=ddp", f"run_dir={tmp_path / 'run'}", restarts=1))
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.exists()  # rank 1 was killed at step 5; the job restarted from step 4
    # Every step once, with the losses of the unbroken run: no batch lost, none repeated.
    assert losses(tmp_path / "run") == pytest.approx(unbroken_ddp, rel=1e-6)


def test_nan_in_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    marker, run_dir = tmp_path / "fired", tmp_path / "run"
    result = run(torchrun("--tee", "3", *with_fault("nan", 1, 3, marker), *RUN,
                          "parallel=ddp", f"run_dir={run_dir}"))
    assert result.returncode != 0 and marker.exists()
    output = result.stdout + result.stderr
    assert output.count("NaN/inf at or before step 3") >= 2, output[-3000:]  # both ranks
    assert latest_checkpoint(run_dir).name == "step_000002"  # the last good one, intact
    verify_checkpoint(latest_checkpoint(run_dir))


def test_a_hang_in_a_collective_is_caught_by_every_watchdog(tmp_path):
    marker, run_dir = tmp_path / "fired", tmp_path / "run"
    # torchrun polls its workers every 5 s: longer than the watchdogs need to report.
    result = run(torchrun(*with_fault("stall", 1, 3, marker), *RUN, "parallel=ddp",
                          f"run_dir={run_dir}", "watchdog_timeout_s=2",
                          "watchdog_first_timeout_s=120", monitor=5), timeout=240)
    assert result.returncode != 0 and marker.exists()
    hung = stall_path(run_dir, 1).read_text()
    waiting = stall_path(run_dir, 0).read_text()
    assert "injected_stall" in hung and "last step: 2" in hung
    assert "last step: 2" in waiting  # rank 0 waited inside the collective
    assert f"exitcode  : {STALL_EXIT_CODE}" in result.stderr  # the watchdog's exit
    assert processes_mentioning(str(run_dir)) == []  # no worker left behind


def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    single = [*RUN, "grad_accum=2"]
    straight = tmp_path / "straight"
    assert run([sys.executable, "-m", "nsa.train", *single, f"run_dir={straight}"]
               ).returncode == 0
    marker, run_dir = tmp_path / "fired", tmp_path / "run"
    killed = run([sys.executable, *with_fault("kill-in-save", 0, 4, marker), *single,
                  f"run_dir={run_dir}"])
    assert killed.returncode == -9 and marker.exists()
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_000002"]
    resumed = run([sys.executable, "-m", "nsa.train", *single, f"run_dir={run_dir}",
                   "--auto-resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "steps 2 -> 8" in resumed.stdout
    assert losses(run_dir) == losses(straight)


def test_a_corrupted_checkpoint_is_refused_and_resume_falls_back(tmp_path, tiny_overrides):
    config = build_config("tiny", [*tiny_overrides, "max_steps=4", "checkpoint_interval=2"])
    run_dir = train(config).run_dir
    newest = latest_checkpoint(run_dir)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.raises(CheckpointCorrupted, match=shard.name):
        verify_checkpoint(newest)
    messages = []
    assert latest_checkpoint(run_dir, report=messages.append).name == "step_000002"
    assert shard.name in messages[0]
    more = build_config("tiny", [*tiny_overrides, "max_steps=6", "checkpoint_interval=2"])
    resumed = train(more, resume=True)
    assert sorted(losses(resumed.run_dir)) == [1, 2, 3, 4, 5, 6]


def test_an_unwritable_run_dir_fails_before_training(tmp_path, tiny_overrides):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = build_config("tiny", [*tiny_overrides, f"run_dir={blocker / 'run'}"])
    with pytest.raises(RunDirError, match="not writable"):
        train(config)


def test_too_little_disk_space_fails_before_training(tmp_path, tiny_overrides, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 1))
    with pytest.raises(RunDirError, match="GiB free"):
        train(build_config("tiny", tiny_overrides))


def test_a_full_disk_at_save_time_is_a_clear_error_and_no_checkpoint(tmp_path, tiny_overrides,
                                                                      monkeypatch):
    config = build_config("tiny", [*tiny_overrides, "max_steps=4", "checkpoint_interval=2"])
    save = dcp.save
    calls = []

    def save_then_disk_full(state_dict, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(state_dict, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", save_then_disk_full)
    with pytest.raises(CheckpointWriteError, match="step 4 .*No space left.*intact"):
        train(config)
    run_dir = Path(config.train.run_dir)
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_000002"]
    assert not list((run_dir / "checkpoints").glob(".*tmp"))  # no partial checkpoint left
