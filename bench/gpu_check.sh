#!/usr/bin/env bash
# What a GPU-facing change must pass on the GPU, in one device call. From the repository root:
#
#   OUT=/path/to/results bash bench/gpu_check.sh [env] [tests] [suite] [user]
#                                                   (default: env tests user)
#
# env:   the GPU, and the versions of the packages the project and `datasets` read there.
# tests: the whole suite on CUDA (pytest-xdist with $JOBS workers when installed), verbose,
#        so that the failing tests are named even if the call's time runs out: $OUT/tests.log
#        (ending with the 30 slowest tests), and $OUT/failed.txt (one line per failed or
#        erroring test). $TESTS narrows it; PART=k/n runs the k-th of n shares of its test
#        files (every n-th file in sorted order: the whole suite takes more than one call's
#        10 minutes; on an H200 (2026-11-29) PART=1/2 ran 465 s with 14 workers and PART=2/2
#        254 s with JOBS=16, so two calls; run both halves from one tree). TESTS_LIMIT=S
#        stops pytest after S seconds (SIGINT: it still writes what ran) and lists the tests
#        it had started but not finished in $OUT/unfinished.txt, so that a call's limit
#        costs no results (wrap this stage in no outer `timeout`).
# suite: the whole suite in one call on every GPU of the machine ($GPUS, default all that
#        nvidia-smi lists): $SHARES (12) shares of the test files (PART above), taken from one
#        queue by $LANES (2) lanes a GPU, each running the tests stage with $LANE_JOBS (8)
#        workers: a lane that draws short shares takes more, so the lanes end together. Each
#        share's logs under $OUT/shareK; a share not started $LIMIT (540) s after the stage
#        began is reported as not run. On two H200s (2026-11-30): 1,360 tests in 410 s, the
#        user stage beside it on GPU 1 (`gpu_check.sh suite & CUDA_VISIBLE_DEVICES=1
#        OUT=$OUT/user gpu_check.sh user`).
# user:  the real user path: m7c-125m ($PRESET) trained $STEPS (40) steps in bf16 on the
#        bundled corpus (bytes tokenizer: no download), ending with its sample, then
#        `nsa generate` from the run (CUDA graphs): $OUT/train.log, $OUT/generate.log.
#        $TRAIN_ARGS: more overrides for the training run (e.g. cuda_graph=false: the eager
#        step; the default graphs it on a GPU).
set -uo pipefail
OUT=${OUT:-/tmp/nsa-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests user)
status=0  # a failing stage does not stop the next one; the exit status says whether any failed
for stage in "${stages[@]}"; do
    case $stage in
    env)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
            || echo "no nvidia-smi"
        $PY - <<'PY'
import importlib.metadata as metadata
for name in ("torch", "triton", "transformers", "safetensors", "huggingface_hub", "pyarrow",
             "pandas", "fsspec", "numpy", "tqdm", "pyyaml", "datasets", "lm_eval"):
    try:
        print(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name} not installed")
PY
        ;;
    tests)
        parallel=()
        $PY -c "import xdist" 2>/dev/null && parallel=(-n "${JOBS:-14}")
        read -ra targets <<< "${TESTS:-tests}"
        if [ -n "${PART:-}" ]; then
            k=${PART%/*} n=${PART#*/}
            if ! [[ $k =~ ^[0-9]+$ && $n =~ ^[0-9]+$ ]] || (( k < 1 || k > n )); then
                echo "PART must be k/n with 1 <= k <= n, got $PART" >&2; exit 2
            fi
            mapfile -t files < <(find "${targets[@]}" -name 'test_*.py' | sort)
            targets=()
            for i in "${!files[@]}"; do
                (( i % n == k - 1 )) && targets+=("${files[$i]}")
            done
            echo "tests: part $PART, ${#targets[@]} of ${#files[@]} test files"
            if [ ${#targets[@]} -eq 0 ]; then continue; fi  # pytest would run every test
        fi
        limit=()
        [ -n "${TESTS_LIMIT:-}" ] && limit=(timeout --signal=INT --kill-after=20 "$TESTS_LIMIT")
        "${limit[@]}" $PY -m pytest -v -rfE --tb=short --durations=30 -p no:cacheprovider \
            "${parallel[@]}" "${targets[@]}" > "$OUT/tests.log" 2>&1 || status=1
        grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | sort -u > "$OUT/failed.txt"
        # Tests named in the log with no outcome (verbose lines: "OUTCOME id" under xdist,
        # "id OUTCOME" without): started, then stopped by TESTS_LIMIT.
        id='tests/[^ ]+::[^ ]+' outcome='(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)'
        grep -oE "$outcome $id|$id $outcome" "$OUT/tests.log" | grep -oE "$id" \
            > "$OUT/finished.txt"
        grep -oE "$id" "$OUT/tests.log" | awk '!seen[$0]++' \
            | grep -vxFf "$OUT/finished.txt" > "$OUT/unfinished.txt"
        rm "$OUT/finished.txt"
        echo "tests: $(tail -1 "$OUT/tests.log")"
        echo "failed or erroring: $(wc -l < "$OUT/failed.txt")"; cat "$OUT/failed.txt"
        if [ -s "$OUT/unfinished.txt" ]; then
            status=1
            echo "unfinished (stopped by TESTS_LIMIT): $(wc -l < "$OUT/unfinished.txt")"
            cat "$OUT/unfinished.txt"
        fi ;;
    suite)
        gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
        (( gpus >= 1 )) || gpus=1
        shares=${SHARES:-12}
        queue=$(mktemp -d)
        began=$SECONDS
        lane() {  # GPU: run the next share no lane has taken, until none is left
            local share left code
            for share in $(seq 1 "$shares"); do
                mkdir "$queue/$share" 2>/dev/null || continue  # taken by another lane
                left=$(( ${LIMIT:-540} - (SECONDS - began) ))
                if (( left < 10 )); then
                    echo "share $share: not run (time)" | tee -a "$queue/results"; continue
                fi
                CUDA_VISIBLE_DEVICES=$1 OUT="$OUT/share$share" PART=$share/$shares \
                    JOBS=${LANE_JOBS:-8} TESTS_LIMIT="$left" bash "$0" tests \
                    > "$OUT/share$share.log" 2>&1
                code=$?
                echo "share $share (GPU $1, exit $code, $((SECONDS - began)) s):" \
                    "$(grep -E '^tests: ' "$OUT/share$share.log" | tail -1)" \
                    | tee -a "$queue/results"
            done
        }
        for gpu in $(seq 0 $((gpus - 1))); do
            for _ in $(seq 1 "${LANES:-2}"); do lane "$gpu" & done
        done
        wait
        passed=$(grep -c "exit 0," "$queue/results")
        rm -rf "$queue"
        cat "$OUT"/share*/failed.txt 2>/dev/null | sort -u > "$OUT/failed.txt"
        (( passed == shares )) || status=1
        echo "suite: $passed of $shares shares passed; failed or erroring:" \
            "$(wc -l < "$OUT/failed.txt")"
        cat "$OUT/failed.txt" ;;
    user)
        RUN=${RUN_DIR:-/tmp/nsa-gpu-check-run}
        $PY -m nsa.train --preset "${PRESET:-m7c-125m}" --overwrite data=shakespeare tokenizer=bytes \
            max_steps=${STEPS:-40} log_interval=10 eval_interval=20 eval_steps=2 \
            checkpoint_interval=40 sample_prompt="ROMEO:" sample_tokens=200 \
            run_dir="$RUN" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
        code=$?; [ $code -eq 0 ] || status=1
        echo "train: exit $code"; tail -4 "$OUT/train.log"
        $PY -m nsa.cli generate --model "$RUN" --prompt "ROMEO:" --max-tokens 300 \
            > "$OUT/generate.log" 2>&1
        code=$?; [ $code -eq 0 ] || status=1
        echo "generate: exit $code"; tail -3 "$OUT/generate.log" ;;
    *) echo "unknown stage $stage (env, tests, suite, user)" >&2; exit 2 ;;
    esac
done
exit $status
