#!/usr/bin/env bash
# Install flatfl (editable) from this checkout.
#   bash install.sh          # the package and its runtime dependencies
#   bash install.sh test     # plus the test extras (pytest)
#   bash install.sh ray      # plus Ray, for sweeps on a cluster
#   bash install.sh data     # only the data: Debian's dataset-fashion-mnist (apt-get), read by --dataset fashion-mnist
# A torch you already have (a CUDA build, say) is kept. With no torch importable, torch==2.13.0 is installed first,
# so that pip does not resolve the bare 'torch' requirement to the newest (multi-GB CUDA) build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ "${1:-}" = "data" ]; then
  dir=/usr/share/datasets/fashion-mnist
  if [ -f "$dir/train-images-idx3-ubyte.gz" ] && [ -f "$dir/t10k-labels-idx1-ubyte.gz" ]; then
    echo "Fashion-MNIST already installed in $dir"
    exit 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh data: no apt-get here; get Fashion-MNIST with 'flatfl train --dataset fashion-mnist --download'" \
         "(fetched into <data-dir>/fashion-mnist/, checksums checked) or put its four .gz files in that folder" >&2
    exit 1
  fi
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "install.sh data: installing needs root: run 'apt-get install dataset-fashion-mnist' as root" >&2
      exit 1
    fi
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
  echo "Fashion-MNIST installed in $dir"
  exit 0
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${1:-}
"$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
