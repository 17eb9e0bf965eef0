# Sourced by scripts/gpu_chain.sh and scripts/gpu_record.sh: kill_servers_of PHASE kills that phase's SGLang processes
# only, found by the E3K_PHASE in their environment (the chain marks each phase's processes; SGLang servers start
# sessions of their own and inherit it), so another chain sharing the GPU (a second lane) keeps its servers.
kill_servers_of() {
  local p
  for p in $(pgrep -f 'sglang'); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "E3K_PHASE=$1" && kill -9 "$p" 2>/dev/null
  done
}
