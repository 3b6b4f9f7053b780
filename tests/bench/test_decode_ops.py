"""bench/decode_ops.py: the ops of one decode step, counted for NSA and dense."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "decode_ops", Path(__file__).parents[2] / "bench" / "decode_ops.py")
decode_ops = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(decode_ops)


def test_nsa_step_counts_its_cache_writes_apart_from_the_attention():
    nsa = decode_ops.count_decode_step("tiny", "nsa", batch=2, prompt=40)
    dense = decode_ops.count_decode_step("tiny", "dense", batch=2, prompt=40)
    layers = decode_ops.model_preset("tiny").num_layers
    assert nsa.attention > 0 and dense.attention == 0
    # per layer: NSA appends its keys/values to the caches and rings in one kernel and writes
    # the compressed tokens in two kernels per set (the tiny preset's MLP compressor); dense
    # writes k/v (1 pair)
    assert decode_ops.model_preset("tiny").attention.compressor == "mlp"
    assert nsa.layer["append_kv"] == layers and "append_kv" not in dense.layer
    assert nsa.layer["compress"] == 4 * layers and "index_put_" not in nsa.layer
    assert dense.layer["index_put_"] == 2 * layers
    # one RoPE kernel per layer, as on CUDA: of q (NSA: the append rotates the selected and
    # window keys, the compressed-token update its key), of q and k (dense)
    assert nsa.layer["rope"] == layers and dense.layer["rope"] == layers
    for counter in (nsa, dense):
        assert not set(counter.layer) & decode_ops.NO_KERNEL_OPS
    assert sum(nsa.layer.values()) > 0 and sum(dense.layer.values()) > 0
    skipped = decode_ops.count_decode_step("tiny", "nsa", batch=2, prompt=40, compress=False)
    assert skipped.layer["compress"] == 0  # no compressed-token update
    assert skipped.layer["rope"] == layers and skipped.layer["append_kv"] == layers
    assert sum(skipped.layer.values()) < sum(nsa.layer.values())


def test_main_prints_the_table_and_the_ratio(capsys):
    rows = decode_ops.main(["--preset", "tiny", "--batch", "2", "--prompt", "40"])
    out = capsys.readouterr().out
    assert "| nsa, completing a compressed token |" in out and "| dense |" in out
    assert f"{rows['nsa, mean'] / rows['dense']:.2f} averaged" in out
    assert 0 < rows["nsa, mean"] < rows["nsa, completing a compressed token"]
    assert rows["dense"] > 0


def test_a_decode_step_computes_the_rope_angles_once_for_all_layers():
    assert decode_ops.model_preset("tiny").num_layers > 1
    for kind in ("nsa", "dense"):
        counter = decode_ops.count_decode_step("tiny", kind, batch=2, prompt=40)
        assert counter.layer["cos"] == counter.layer["sin"] == 1, kind
