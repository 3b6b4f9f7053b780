"""bench/op_memory.py: the peak and its allocation sites from a list of allocations, and one
forward+backward of the Triton op on the CPU with its launches skipped (restored after)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import op_memory  # noqa: E402
import pytest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nsa.ops.triton_support import TRITON_INTERPRET  # noqa: E402


def test_peak_counts_the_live_allocations_by_site_with_addresses_reused():
    A, B, C = 0x1000, 0x2000, 0x3000
    allocations = [(0, A, 100), (1, B, 50), (2, A, -100), (3, A, 80), (4, C, 90), (5, B, -50),
                   (6, C, -90), (7, A, -80)]
    log = [(A, "first at A"), (B, "at B"), (A, "second at A"), (C, "at C")]
    peak, sites = op_memory.peak_sites(allocations, log)
    assert peak == 220  # the second A, B and C: 80 + 50 + 90
    assert sites == {"second at A": 80, "at B": 50, "at C": 90}


@pytest.mark.skipif(not TRITON_INTERPRET, reason="it skips the interpreter's launches (no GPU)")
def test_the_op_peak_holds_its_float32_branch_outputs_and_launches_are_restored(capsys):
    run = InterpretedFunction.run
    T, HQ, D = 300, 4, 16
    result = op_memory.main(["--seq", str(T), "--heads", f"{HQ},2", "--dim", str(D),
                             "--min-mb", "0"])
    assert InterpretedFunction.run is run
    branch_outputs_mb = 3 * T * HQ * D * 4 / 2**20  # o_cmp, o_slc, o_win, kept for the backward
    assert result["peak_mb"] >= branch_outputs_mb
    assert any(site.startswith("compressed_window.py:") for site in result["sites"])
    assert "peak" in capsys.readouterr().out
