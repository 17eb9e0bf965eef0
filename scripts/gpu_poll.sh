#!/usr/bin/env bash
# One poll of scripts/gpu_chain.sh on the lent machine: its log, each phase's log tail, the finished phases' archives,
# and a snapshot of every phase folder still running (no tensors), so a device budget that ends mid-phase loses nothing.
# The device tool brings back at most 8 files a call: each finished archive comes back once (a marker remembers it;
# E3K_POLL_ALL=1 sends them all again), the chains' logs travel as one archive.
for f in /root/chain*.log; do [ -f "$f" ] && echo "-- $f" && tail -3 "$f"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
df -h /root | tail -1
for f in /root/records/*.tgz; do
  [ -f "$f" ] || continue
  m=/root/records/.sent-$(basename "$f"); [ -f "$m" ] && [ -z "${E3K_POLL_ALL:-}" ] && continue
  cp "$f" "$OUT/" && touch "$m"
done
for d in /root/rec-*; do
  # a running phase's folder also holds the fault tests' captures (tmp/, removed when the phase ends)
  [ -d "$d" ] && [ ! -f "/root/records/record-${d#/root/rec-}.tgz" ] && tar czf "$OUT/live-${d#/root/rec-}.tgz" -C "$d" \
    --exclude-from=scripts/record-excludes.txt --exclude='tmp' . 2>/dev/null
done
tar czf "$OUT/logs.tgz" -C /root $(cd /root && ls chain*.log 2>/dev/null) 2>/dev/null; ls "$OUT"
