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
  dir=${FLATFL_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}  # where the package puts them (tests: elsewhere)
  missing_files() {
    local f out=""
    for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
      [ -f "$dir/$f" ] || out="$out${out:+, }$f"
    done
    echo "$out"
  }
  missing=$(missing_files)
  if [ -z "$missing" ]; then
    echo "Fashion-MNIST already installed in $dir"
    exit 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh data: $dir lacks $missing and there is no apt-get here; get Fashion-MNIST with" \
         "'flatfl train --dataset fashion-mnist --download' (fetched into <data-dir>/fashion-mnist/, checksums" \
         "checked) or put its four .gz files in that folder" >&2
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
  missing=$(missing_files)
  if [ -n "$missing" ]; then
    echo "install.sh data: after installing dataset-fashion-mnist, $dir still lacks $missing; reinstall the package" \
         "(${sudo:+$sudo }apt-get install --reinstall dataset-fashion-mnist) or use --download" >&2
    exit 1
  fi
  echo "Fashion-MNIST installed in $dir"
  exit 0
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${1:-}
"$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
