#!/usr/bin/env bash
# RELIABILITY.md's GPU run: m7c-125m under DDP on 2 GPUs, rank 1 SIGKILLed at step 30 under
# torchrun --max-restarts=1, against the same run unbroken; the logged losses must agree.
#
#     OUT=/tmp/rel bash bench/reliability_runs.sh
set -u
OUT=${OUT:-/tmp/nsa-reliability}
RUNS=${RUNS:-/tmp/nsa-reliability-runs}
mkdir -p "$OUT" && rm -rf "$RUNS" && mkdir -p "$RUNS"
export PYTHONPATH=.
TRAIN=(--preset m7c-125m data=synthetic sample_tokens=0 max_steps=60 checkpoint_interval=20
       log_interval=10 eval_interval=100000 eval_steps=2 parallel=ddp batch_size=16)
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts=1)
"${TORCHRUN[@]}" -m nsa.train "${TRAIN[@]}" run_dir="$RUNS/unbroken" > "$OUT/unbroken.log" 2>&1
echo "unbroken: exit $?"
"${TORCHRUN[@]}" tests/train/fault_runner.py --fault kill --rank 1 --step 30 \
    --marker "$RUNS/fired" -- --auto-resume "${TRAIN[@]}" run_dir="$RUNS/killed" \
    > "$OUT/killed.log" 2>&1
echo "killed at step 30 and restarted: exit $?; $(cat "$RUNS/fired")"
grep -h "steps .* -> 60" "$OUT/killed.log"
python3 - "$RUNS" <<'PY'
import json, sys
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{d}/metrics.jsonl"))
            if "loss" in r}
a, b = losses("unbroken"), losses("killed")
print("steps", sorted(b), "max |loss difference|", max(abs(a[s] - b[s]) for s in a))
PY
