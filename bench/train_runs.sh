#!/usr/bin/env bash
# The training runs of the "training at scale" issue on a 2-GPU machine, in one call:
# m7c-125m, bf16, 200 steps, NSA (Triton) vs dense on one GPU at seq 2048, both at seq 16k,
# NSA under DDP and FSDP2 on two GPUs (8 sequences per GPU, as on one), then the FSDP2
# checkpoint resumed on one GPU. Synthetic tokens: the GPU machine has no internet access.
#
#     OUT=/tmp/train-runs bash bench/train_runs.sh     # metrics.jsonl of every run under $OUT
#
# Each run takes the trainer's defaults: since 2026-11-30 (cuda_graph auto) the one-GPU and DDP
# steps are replayed from a CUDA graph and FSDP2's run eagerly; add cuda_graph=false to COMMON
# for eager steps throughout (the runs recorded before that date).
set -u
OUT=${OUT:-/tmp/nsa-train-runs}
RUNS=${RUNS:-/tmp/nsa-runs}
mkdir -p "$OUT" && rm -rf "$RUNS"
export PYTHONPATH=.
COMMON=(--preset m7c-125m data=synthetic sample_tokens=0 eval_interval=100000 eval_steps=2
        log_interval=20 checkpoint_interval=100000 watchdog_timeout_s=600)
ONE_GPU=(env CUDA_VISIBLE_DEVICES=0 python3 -m nsa.train "${COMMON[@]}")
TWO_GPUS=(python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m nsa.train
          "${COMMON[@]}" batch_size=16 max_steps=200 checkpoint_interval=200)
LONG=(seq_len=16384 max_seq_len=16384 batch_size=1 max_steps=30 log_interval=10)

run() {
    local name=$1; shift
    "$@" run_dir="$RUNS/$name" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
    cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
}
run nsa-1gpu "${ONE_GPU[@]}" max_steps=200
run dense-1gpu "${ONE_GPU[@]}" attention=dense max_steps=200
run nsa-16k "${ONE_GPU[@]}" "${LONG[@]}"
run dense-16k "${ONE_GPU[@]}" attention=dense "${LONG[@]}"
run nsa-ddp "${TWO_GPUS[@]}" parallel=ddp
run nsa-fsdp "${TWO_GPUS[@]}" parallel=fsdp
# The 2-GPU FSDP2 checkpoint (step 200) continues on one GPU for 10 more steps.
cp -r "$RUNS/nsa-fsdp" "$RUNS/resume-1gpu"
run resume-1gpu "${ONE_GPU[@]}" batch_size=16 max_steps=210 --resume
