#!/usr/bin/env bash
# One prepared run for a lent CUDA machine (see the device tool): every Triton kernel test
# file (tests/kernels/test_*triton*.py: Mamba-1, the SSD, and any family added later) run
# compiled on CUDA (no interpreter), each file's result in the log, then both benchmarks.
#   bash benchmarks/gpu_check.sh [OUTDIR]
# Needs: torch with CUDA, triton, numba, pytest, hypothesis (mambapy/einops for the peer).
# A family whose file passes here (and not only skips) may go into sonata.kernels.GPU_VERIFIED
# with the commit and card this log names; docs/kernels.md's table says which have.
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
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git here)')$(git diff --quiet HEAD 2>/dev/null || echo ' (tree differs from it or unknown)')"
  echo "== kernel tests, compiled on CUDA"
  verdicts=()
  for f in tests/kernels/test_*triton*.py; do
    [ -e "$f" ] || { verdicts+=("NO FILES  tests/kernels/test_*triton*.py matched nothing"); break; }
    echo "-- $f"
    log="$out/$(basename "$f" .py).log"
    $PY -m pytest -q -rs -p no:cacheprovider "$f" >"$log" 2>&1
    rc=$?
    tail -25 "$log"
    summary=$(tail -1 "$log")
    if [ "$rc" -ne 0 ]; then
      verdict="FAIL (pytest exit $rc)"
    elif ! grep -q " passed" <<<"$summary"; then
      verdict="NOT RUN (nothing passed)"
    else
      verdict="PASS"
    fi
    verdicts+=("$verdict  $f: $summary")
  done
  echo "== kernel test verdicts"
  printf '%s\n' "${verdicts[@]}"
  echo "== benchmarks/scan.py"
  $PY benchmarks/scan.py --device cuda --sizes seed seed-b32 large --repeat 20
  echo "== benchmarks/train_speed.py"
  $PY benchmarks/train_speed.py --device cuda --batches 8 32 --rounds 3 --steps 20
} 2>&1 | tee "$out/gpu_check.log"
