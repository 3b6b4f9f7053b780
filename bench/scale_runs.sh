#!/usr/bin/env bash
# The multi-GPU runs (2 and 4 GPUs of one host), one phase per device call so that each fits
# the 10-minute limit; bench/scale_summary.py then prints the tables from $OUT.
#   scaling: m7c-125m, seq 2048, bf16, 200 steps, 8 sequences per GPU: one GPU, then DDP,
#            FSDP2 and FSDP2 tuned (fsdp_reshard=false fsdp_prefetch=1) on each of $GPU_COUNTS
#   long:    FSDP2 with activation checkpointing at seq 16k on the largest count (memory/GPU)
#   faults:  FSDP2 on the largest count, rank 1 SIGKILLed at step 30 under torchrun
#            --max-restarts=1 --auto-resume, against the same run unbroken; the killed run's
#            checkpoint at step 60 then continues to step 70 on 1 and on 2 GPUs
#
#     OUT=/tmp/scale bash bench/scale_runs.sh scaling            # then: long faults
#     python3 bench/scale_summary.py /tmp/scale
#     SMOKE=1 OUT=/tmp/scale bash bench/scale_runs.sh scaling long faults   # tiny, CPU processes
set -u
OUT=${OUT:-/tmp/nsa-scale}
RUNS=${RUNS:-/tmp/nsa-scale-runs}
GPU_COUNTS=${GPU_COUNTS:-"2 4"}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=${PYTHONPATH:-.}
if [ "${SMOKE:-0}" = 1 ]; then
    MODEL=(--preset tiny dim=32 num_layers=2 num_heads=2 num_kv_heads=1 head_dim_k=16
           head_dim_v=16 device=cpu num_threads=1)
    SEQ=32 ROWS=2 STEPS=6 LOG=2 LONG_SEQ=64 KILL_AT=3 CKPT=2 END=6 MORE=8
else
    MODEL=(--preset m7c-125m data=synthetic)
    SEQ=2048 ROWS=8 STEPS=200 LOG=20 LONG_SEQ=16384 KILL_AT=30 CKPT=20 END=60 MORE=70
fi
COMMON=(--overwrite "${MODEL[@]}" sample_tokens=0 eval_interval=100000 eval_steps=2
        log_interval=$LOG checkpoint_interval=100000 watchdog_timeout_s=600)
MAX=$(echo $GPU_COUNTS | tr ' ' '\n' | sort -n | tail -1)

# run NAME NPROC [--restarts] ARGS...: one training run under torchrun (--restarts: one
# restart allowed), its exit code appended to status.txt
run() {
    local name=$1 n=$2; shift 2
    local launcher=(python3 -m torch.distributed.run --standalone --nproc_per_node "$n")
    if [ "${1:-}" = "--restarts" ]; then launcher+=(--max-restarts=1); shift; fi
    "${launcher[@]}" "$@" run_dir="$RUNS/$name" > "$OUT/$name.log" 2>&1
    local code=$?
    echo "$name $n $code" >> "$OUT/status.txt"
    echo "$name ($n processes): exit $code"
    cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
}

for phase in "$@"; do
    case $phase in
    scaling)
        run one 1 -m nsa.train "${COMMON[@]}" seq_len=$SEQ batch_size=$ROWS max_steps=$STEPS
        for n in $GPU_COUNTS; do
            B=(seq_len=$SEQ batch_size=$((ROWS * n)) max_steps=$STEPS)
            run "ddp-$n" "$n" -m nsa.train "${COMMON[@]}" "${B[@]}" parallel=ddp
            run "fsdp-$n" "$n" -m nsa.train "${COMMON[@]}" "${B[@]}" parallel=fsdp
            run "fsdp-tuned-$n" "$n" -m nsa.train "${COMMON[@]}" "${B[@]}" parallel=fsdp \
                fsdp_reshard=false fsdp_prefetch=1
        done ;;
    long)
        run "fsdp-ac-long-$MAX" "$MAX" -m nsa.train "${COMMON[@]}" seq_len=$LONG_SEQ \
            max_seq_len=$LONG_SEQ batch_size=$MAX max_steps=20 parallel=fsdp \
            activation_checkpointing=true ;;
    faults)
        F=("${COMMON[@]:1}" seq_len=$SEQ batch_size=$((2 * MAX)) checkpoint_interval=$CKPT
           parallel=fsdp log_interval=1)
        run "unbroken-$MAX" "$MAX" -m nsa.train --overwrite "${F[@]}" max_steps=$MORE
        rm -rf "$RUNS/fired" "${RUNS:?}/killed-$MAX"
        run "killed-$MAX" "$MAX" --restarts tests/train/fault_runner.py --fault kill --rank 1 \
            --step $KILL_AT --marker "$RUNS/fired" -- --auto-resume "${F[@]}" max_steps=$END
        echo "fault: $(cat "$RUNS/fired" 2>/dev/null || echo 'did not fire')" >> "$OUT/status.txt"
        for n in 1 2; do
            rm -rf "${RUNS:?}/resumed-$n" && cp -r "$RUNS/killed-$MAX" "$RUNS/resumed-$n"
            run "resumed-$n" "$n" -m nsa.train "${F[@]}" max_steps=$MORE --resume
        done ;;
    *) echo "unknown phase $phase (scaling, long, faults)" >&2; exit 2 ;;
    esac
done
