#!/usr/bin/env bash
# Fits the chain's training to the device budget really left (the install's and the data phase's lengths vary): every
# 10 s until the chain's training group starts, writes /root/e3k-train-minutes (read by gpu_record.sh's train phase)
# = (budget end - now - the serve phase's limit - the training phase's own overhead) / 60, at most CAP minutes.
# Usage: bash scripts/gpu_fit_train.sh SECONDS_TO_RUN SERVE_LIMIT_S [OVERHEAD_S=120] [CAP_MIN=8]
# The budget's end (epoch seconds on the machine) is read from /root/e3k-end, written by the call that started the chain.
run_for=$1 serve=$2 over=${3:-120} cap=${4:-8}
end=$(cat /root/e3k-end) || exit 1
t_stop=$(( $(date +%s) + run_for ))
while [ "$(date +%s)" -lt "$t_stop" ]; do
  grep -q "^== train" /root/chain.log 2>/dev/null && break
  python3 -c "import sys; e, s, o, c = map(float, sys.argv[1:]); import time; m = min(c, (e - time.time() - s - o) / 60); print(f'{max(m, 1.0):.1f}')" \
    "$end" "$serve" "$over" "$cap" > /root/e3k-train-minutes.new && mv /root/e3k-train-minutes.new /root/e3k-train-minutes
  sleep 10
done
echo "train minutes: $(cat /root/e3k-train-minutes 2>/dev/null)"
