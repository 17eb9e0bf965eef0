#!/usr/bin/env bash
# One poll of scripts/gpu_chain.sh on the lent machine: its log, each phase's log tail, the finished phases' archives,
# and a snapshot of every phase folder still running (no tensors), so a device budget that ends mid-phase loses nothing.
tail -4 /root/chain.log; for f in /root/chain-*.log; do [ -f "$f" ] && echo "-- $f" && tail -2 "$f"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
cp /root/records/*.tgz "$OUT/" 2>/dev/null
for d in /root/rec-*; do
  # a running phase's folder also holds the fault tests' captures (tmp/, removed when the phase ends)
  [ -d "$d" ] && [ ! -f "/root/records/record-${d#/root/rec-}.tgz" ] && tar czf "$OUT/live-${d#/root/rec-}.tgz" -C "$d" \
    --exclude-from=scripts/record-excludes.txt --exclude='tmp' . 2>/dev/null
done
cp /root/chain*.log "$OUT/" 2>/dev/null; ls "$OUT"
