#!/usr/bin/env bash
# The first GPU run's check: numerics (finite, falling losses that agree across compile and layouts) and
# speed (tokens/s, TFLOP/s and MFU against the detected peak, with the device name) of the ~1.1B model in
# bf16. One GPU: compile off and on, compile with selective recompute (both policies), and an 8-expert MoE of
# the same shape (about 5-7 minutes on an H100/H200 before the three checkpoint rows, each a row plus a 1B save:
# unmeasured, and the 10-minute slot may need --steps 12). Two or more GPUs
# visible: also dp2 (NCCL, FSDP2) with async checkpoints and a resume, tp2 with compile and async TP, and cp2
# (ring attention) and a mixture of experts at ep2 (NCCL all-to-all) against its one-GPU run. One GPU also: a
# mid-run checkpoint in each checkpoint.async_mode (the step's stall); context parallelism's attention (the fused
# CUDA block kernels against float64 at cp 2/4, then speed and peak memory against SDPA at 8k/32k/128k tokens); the
# experts' grouped GEMM (padded groups) against the per-expert loop at 8 and 64 experts, then its speed. Then
# `nanotron doctor` on every visible GPU: healthy, and with an injected wrong matmul that it must name; with two
# GPUs or more, an injected hang on NCCL that the watcher must name.
#
#   bash benchmarks/gpu_check.sh [--micro-batch 8] [--steps 20] [other benchmarks.gpu_check flags]
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_check.sh     # the single-GPU part only
#
# Exit code 1 when a check fails (the table says which and why). Tables land in runs/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device is visible')"
exec python -m benchmarks.gpu_check "$@"
