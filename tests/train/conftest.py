import re

import pytest

import nsa.cli
from nsa.train import streams

# A model and run small enough that a few training steps take well under a second on a CPU.
TINY = ["dim=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "head_dim_k=16",
        "head_dim_v=16", "seq_len=32", "batch_size=2", "eval_steps=2", "sample_tokens=8",
        "log_interval=1", "num_threads=1"]


@pytest.fixture
def tiny_overrides(tmp_path):
    return [*TINY, f"run_dir={tmp_path / 'run'}"]


@pytest.fixture
def sleeps(monkeypatch):
    """The delays a document stream would sleep before reopening, recorded instead of slept."""
    delays = []
    monkeypatch.setattr(streams.time, "sleep", delays.append)
    return delays


@pytest.fixture
def cli_error(capsys):
    """Run ``nsa`` with argv, which must fail with exactly one error line and no traceback; ->
    that line: ``nsa: error: ...``, or ``nsa train: error: ...`` from the command's own options."""
    def run(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            nsa.cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if re.match(r"nsa( \w+)?: error: ", line)]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return run
