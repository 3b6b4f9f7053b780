import pytest

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

