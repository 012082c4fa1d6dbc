#!/usr/bin/env bash
# The first GPU run's check: numerics (finite, falling losses that agree across compile and layouts; the CUDA
# kernels against float64; one host sync per step) and speed (tokens/s, TFLOP/s and MFU against the detected peak)
# of the ~1.1B model in bf16. The rows run in priority order (numerics that gate everything, then speed, then the
# rest: `python -m benchmarks.gpu_check --help` lists them with their estimates) under a 9-minute budget: a row
# whose estimate no longer fits is skipped and named, and the command prints the one that runs the skipped rows.
# The summary (runs/gpu_check/gpu_check.{md,csv,json}) is rewritten after every row, so a command stopped at a
# 10-minute limit keeps what ran; SIGTERM/SIGINT stop the row in flight, write it, and exit non-zero.
# One GPU: parts 1 and 2 (each estimated under 9 minutes on an H100; unmeasured until the first GPU run) and 4 (the
# one-GPU rows they have no room for: multi-token prediction); the two-GPU part 3 (dp2, resume, tp2, cp2, ep2, the
# hang watcher) is skipped in one line. With two GPUs it runs after parts 1 and 2.
#
#   bash benchmarks/gpu_check.sh                       # what fits 9 minutes, then the rerun command for the rest
#   bash benchmarks/gpu_check.sh --part 2              # the one-GPU rows part 1 leaves (--part 3: two GPUs; 4: mtp)
#   bash benchmarks/gpu_check.sh --only-rows "mla bf16,doctor"   # named rows (their reference rows come along)
#   bash benchmarks/gpu_check.sh --budget-minutes 25   # a longer slot: every row
#   bash benchmarks/gpu_check.sh --out DIR             # the summary where the machine's files are collected from
#
# Exit code 0 when every row that ran passed (skipped rows do not fail it), 1 when a check fails (the table says
# which and why), 128 + the signal when stopped.
#
# On a GPU machine with its own torch and no internet (the lent machines' image: Python 3.12, torch 2.11.0+cu130,
# no torchao), carry torchao's wheel, install it beside the image's packages and run from the checkout
# (docs/testing.md, "The first GPU run"):
#   python3 -m pip install -q --no-deps --no-index --target /tmp/site .wheels/*.whl &&
#     PYTHONPATH=$PWD:/tmp/site bash benchmarks/gpu_check.sh --out DIR
set -euo pipefail
cd "$(dirname "$0")/.."
# The first of python3 and python that has torch (an image may have a bare system `python` beside its torch's python3).
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
      PYTHON=$(command -v "$candidate")
      break
    fi
  done
  PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
fi
"$PYTHON" -c "import importlib.util as u, sys
if not u.find_spec('torch'):
    sys.exit(f'gpu_check: {sys.executable} has no torch; set PYTHON to the interpreter that has it')
if not u.find_spec('torchao'):
    print('gpu_check: torchao is not importable: the float8 rows will fail (carry its wheel: docs/testing.md)')
import torch
sys.exit(None if torch.cuda.is_available() else 'gpu_check: no CUDA device is visible')"
exec "$PYTHON" -m benchmarks.gpu_check "$@"
