"""One training at a time in a run directory: a second one, in one process or under torchrun,
refuses at once naming the holder; the lock dies with its holder, however that ends."""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from nsa.train import build_config, train, trainer
from tests.train.processes import REPO, SMALL_RUN

NEVER = "1000000"


@contextmanager
def training_in(run_dir: Path, log: Path):
    """A training subprocess in ``run_dir`` that goes on until it is killed (SIGKILL) on leaving
    the block; entered once it has started training."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "nsa.train", *SMALL_RUN, f"max_steps={NEVER}",
             f"log_interval={NEVER}", f"eval_interval={NEVER}", f"checkpoint_interval={NEVER}",
             f"run_dir={run_dir}"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "parameters" not in log.read_text():  # the first line of a started run
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the training did not start"
            time.sleep(0.1)
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_busy_run_dir_is_refused_naming_the_holder_until_it_dies(tmp_path, cli_error):
    run_dir = tmp_path / "run"
    second = ["train", *SMALL_RUN[2:], "max_steps=2", f"run_dir={run_dir}"]
    with training_in(run_dir, tmp_path / "first.log") as first:
        line = cli_error(second)
        assert f"run_dir {run_dir} is in use by pid {first.pid} on " in line
    # SIGKILL ran no cleanup: the kernel released the lock with the process.
    assert train(build_config("tiny", second[1:])).steps == 2


def test_the_lock_is_released_when_a_run_fails(tiny_overrides, monkeypatch):
    def failing_step(*args, **kwargs):
        raise RuntimeError("injected")

    config = build_config("tiny", [*tiny_overrides, "max_steps=2"])
    with monkeypatch.context() as patch:
        # The eager and the graphed step (the default on a GPU) both call forward_backward.
        patch.setattr(trainer, "forward_backward", failing_step)
        with pytest.raises(RuntimeError, match="injected"):
            train(config)
    assert train(config).steps == 2


def launch_ranks(command: list[str], world_size: int) -> list[subprocess.Popen]:
    """``command`` as ``world_size`` ranks in torchrun's environment, but without its agent,
    which stops every rank once one has exited: each rank ends on its own."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world_size)}
    return [subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(world_size)]


def test_every_rank_refuses_a_busy_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    with training_in(run_dir, tmp_path / "first.log") as first:
        ranks = launch_ranks([sys.executable, "-m", "nsa.train", *SMALL_RUN, "max_steps=2",
                              "parallel=ddp", f"run_dir={run_dir}"], world_size=2)
        for rank in ranks:  # none waits in a collective for the other
            _, err = rank.communicate(timeout=120)
            assert rank.returncode == 2, err[-3000:]
            assert f"nsa: error: run_dir {run_dir} is in use by pid {first.pid} on " in err
