#!/usr/bin/env bash
# A GPU session's plan in one background job on the lent machine (after ../shared/gpu's install): the phases of
# scripts/gpu_record.sh in priority order, each with its own time limit, each archive in /root/records as it ends.
# The device tool's calls are short (10 min) and an idle machine is taken back soon after a call, so the chain runs
# detached and each call polls it:
#   start: export PYTHONPATH=/root/site:$PWD/src; bash scripts/gpu_record.sh setup;
#          setsid nohup bash scripts/gpu_chain.sh > /root/chain.log 2>&1 < /dev/null &
#   poll:  sleep 200; bash scripts/gpu_poll.sh   (the chain's log, and every phase's folder so far, into $OUT)
# E3K_CHAIN: "group:seconds ..." where a group is one phase or several joined by "+" that run at once on the one GPU
# (phase@N: that phase starts N seconds after the group, because SGLang servers started at the same moment race for
# the free memory that sizes their KV pools). seconds: the limit of each long command in the group; a command cut by
# it still leaves what it wrote to its phase's archive. Two chains may run side by side as lanes, each cleaning up
# only its own phases' servers. The default is the drafter pipeline (data, train, serve) for one GPU and a 30-minute
# budget less the install; E3K_DATA_SETS, E3K_TRAIN_SETS, E3K_MAX_SAMPLES, E3K_TRAIN_MINUTES and the other E3K_*
# variables of scripts/gpu_record.sh pass through to its phases.
# Never stop a phase's `timeout` with SIGSTOP to give it more time: on SIGCONT its pending alarm still interrupts it.
# To stop a chain by hand, kill its phases by the E3K_PHASE in their environment (as kill_servers_of does) and the
# chain by its pid; never `pkill -f` a pattern that the stopping command itself contains (it matches itself).
set -u
# Every device call replaces the repository's copy on the machine with the caller's tree, while the chain runs: a phase
# that opened a notebook at that moment would find it missing.
# So the chain runs from a private copy of the tree, made once at its start.
if [ -z "${E3K_CHAIN_TREE:-}" ]; then
  tree=/root/chain-tree-$$; rm -rf "$tree"; mkdir -p "$tree"
  tar cf - --exclude=./.stage --exclude=./.git . | tar xf - -C "$tree"
  cd "$tree" && E3K_CHAIN_TREE=$tree exec bash scripts/gpu_chain.sh "$@"
fi
export OUT=/root/records PYTHONPATH=/root/site:$PWD/src:${PYTHONPATH:-}
mkdir -p "$OUT"
. scripts/phase_servers.sh  # kill_servers_of PHASE: only that phase's SGLang processes (a second lane may share the GPU)
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
