#!/usr/bin/env bash
# GPU check: a short bf16 training of a ~1.1B-parameter Llama (TinyLlama's shape: hidden 2048, 22 layers,
# GQA 32/4 heads, vocab 32000, seq 2048) on one CUDA device, with training.compile off and on, printing
# tokens/s, TFLOP/s and MFU per row. Runs nanotron through benchmarks/throughput.py, so the numbers are
# the trainer's own metrics (median of the steps after warm-up; the compile row's first steps compile).
#
#   bash benchmarks/gpu_check.sh [--global-batch 4] [--steps 20] [other benchmarks.throughput flags]
#
# Budget: about 1-2 min per row on an H100/H200 class GPU (model init, compile, 20 steps), well under
# the 8-minute limit enforced below. Tables land in runs/gpu_check/ (throughput.md/.csv/.png).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device is visible')"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
timeout --signal=INT 470 python -m benchmarks.throughput \
    --device cuda --dtype bfloat16 --sizes 1b --layouts "1 process,compile" \
    --steps 20 --warmup 8 --repeats 1 --global-batch 4 --out runs/gpu_check "$@"
