#!/usr/bin/env bash
# The decode step on a GPU (issue 12), for the lead's H200 run. From the repository root:
#
#   OUT=/path/to/results bash bench/decode_check.sh [tests|bench|all]   (default: all)
#
# tests: the decode tests on CUDA, float32 and bfloat16 (on a GPU the tests' half dtype is
#        bf16), with programmatic dependent launch (default) and without (NSA_DECODE_PDL=0);
#        logs in $OUT/decode-tests*.txt. About a minute.
# bench: bench/decode.py, the full sweep (decode steps 8k-128k at B=1 and 16, per-kernel
#        times, m7c-125m generation at 2k/8k/32k, the targets); $OUT/decode.json and
#        the printed tables in $OUT/decode.md. A few minutes. If only the PDL runs fail
#        (e.g. a CUDA graph refusing programmatic launches), rerun the bench with
#        NSA_DECODE_PDL=0 to get numbers, and report the failure.
set -euo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
PY=${PYTHON:-python3}
TESTS=(tests/ops/test_decode.py tests/models/test_decoding.py tests/models/test_sampling.py
       tests/ops/test_robustness.py)
what=${1:-all}
status=0  # a failing stage does not stop the next one; the exit status says whether any failed
if [[ $what == tests || $what == all ]]; then
    $PY -m pytest -q -rs "${TESTS[@]}" -k "decod or graph" 2>&1 | tee "$OUT/decode-tests.txt" \
        || status=1
    NSA_DECODE_PDL=0 $PY -m pytest -q -rs tests/ops/test_decode.py tests/models/test_decoding.py \
        2>&1 | tee "$OUT/decode-tests-nopdl.txt" || status=1
fi
if [[ $what == bench || $what == all ]]; then
    $PY bench/decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.md" || status=1
fi
exit $status
