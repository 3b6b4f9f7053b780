#!/usr/bin/env bash
# Wheels of the packages the GPU image lacks (it has no network), for `carry` (device tool):
# `datasets` (document corpora: data=DIR|*.jsonl|*.parquet, bench/quality.py) and its needs that
# the image does not hold. Run here, from the repository root; .whl/ must be git-ignored
# (`echo /.whl/ >> .git/info/exclude`). The image's Python is 3.12.
#
#     bash bench/carry_wheels.sh                 # -> .whl/*.whl
#     DATASETS=datasets==4.0.0 bash bench/carry_wheels.sh   # an older datasets, if the image's
#                                                # pyarrow/huggingface_hub are too old for 5.x
# On the GPU machine, first in the command (as the device README says):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
# `bash bench/gpu_check.sh env` prints the image's versions of the packages datasets needs.
set -euo pipefail
DEST=${DEST:-.whl}
PACKAGES=(${DATASETS:-datasets} ${EXTRA:-"dill<0.4.2" "multiprocess<0.70.20" xxhash})
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${PACKAGES[@]}"
ls -l "$DEST"
for wheel in "$DEST"/datasets-*.whl; do
    echo "$wheel needs:"; unzip -p "$wheel" '*/METADATA' | grep ^Requires-Dist | grep -v extra
done
