#!/usr/bin/env bash
# Holds the lent machine while scripts/gpu_chain.sh runs: polls every 55 s (each poll leaves the chain's logs and the
# finished phases' archives in $OUT) until the chain is done or SECONDS_TO_HOLD (default 560) have passed, whichever
# comes first, then prints the chain's log. One device call: `bash scripts/gpu_hold.sh` with timeout_s 590; send the
# next one at once while the chain runs. Stopping at "chain done" matters: 2026-12-04 a loop without that check held
# the machine 8 minutes after the serve phase had failed in 36 s, and what was left could not serve again.
# usage: bash scripts/gpu_hold.sh [SECONDS_TO_HOLD] [LOG (default /root/chain.log)]
hold=${1:-560} log=${2:-/root/chain.log}
t_end=$(( $(date +%s) + hold ))
while [ "$(date +%s)" -lt "$t_end" ]; do
  grep -q "chain done" "$log" 2>/dev/null && break
  sleep $(( t_end - $(date +%s) < 55 ? (t_end - $(date +%s) > 0 ? t_end - $(date +%s) : 0) : 55 ))
  E3K_POLL_ALL=1 bash scripts/gpu_poll.sh > /dev/null 2>&1
done
E3K_POLL_ALL=1 bash scripts/gpu_poll.sh > /dev/null 2>&1
cat "$log"
