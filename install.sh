#!/usr/bin/env bash
# Install flatfl (editable) from this checkout.
#   bash install.sh          # the package and its runtime dependencies
#   bash install.sh test     # plus the test extras (pytest)
#   bash install.sh ray      # plus Ray, for sweeps on a cluster
# A torch you already have (a CUDA build, say) is kept. With no torch importable, torch==2.13.0 is installed first,
# so that pip does not resolve the bare 'torch' requirement to the newest (multi-GB CUDA) build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${1:-}
"$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
