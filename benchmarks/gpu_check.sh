#!/usr/bin/env bash
# One prepared run for a lent CUDA machine (see the device tool): compiled Triton
# kernel tests at GPU sizes (no interpreter), then both benchmarks, one log.
#   bash benchmarks/gpu_check.sh [OUTDIR]
# Needs: torch with CUDA, triton, numba, pytest, hypothesis (mambapy/einops for the peer).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/sonata-gpu}}"
mkdir -p "$out"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
{
  echo "== environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  echo "== kernel tests, compiled on CUDA"
  $PY -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_triton.py 2>&1 | tail -25
  echo "== benchmarks/scan.py"
  $PY benchmarks/scan.py --device cuda --sizes seed seed-b32 large --repeat 20
  echo "== benchmarks/train_speed.py"
  $PY benchmarks/train_speed.py --device cuda --batches 8 32 --rounds 3 --steps 20
} 2>&1 | tee "$out/gpu_check.log"
