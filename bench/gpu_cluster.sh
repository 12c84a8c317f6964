#!/usr/bin/env bash
# Issue 15 on the H200 (for the lead; not run by CI): two GPU-memory-capped Greenlane replicas
# sharing the one GPU on Ray Serve, post recommendation at full length, affinity vs Ray's
# power-of-two router (part `routing`), then streaming ITL straight to a server vs through Ray
# (part `streaming`): one device call each (a call runs at most 10 minutes).
# Each replica: Llama-3.1-8B shape (bf16, 16 GB of weights) capped at 60 GB, with a KV pool of
# 8,750 blocks x 16 = 140k tokens (~18 GB): about one replica's share of the 20 users' profiles
# (20 x 14k = 280k tokens), as in the CPU run (docs/benchmarks-cpu.md "Several replicas").
# Usage: bash bench/gpu_cluster.sh routing|streaming [QPS]
# Needs the project's venv with the `cluster` extra (ray): on the H200, the one
# `bash bench/gpu_make_test.sh install` made on the same warm machine. Results go to $OUT when
# set (the device tool), else bench/results/cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-}"; QPS="${2:-2}"
out="${OUT:-bench/results/cluster}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0
common=(--replicas 2 --replica-num-gpus 0.5 --model random:llama-3.1-8b
        --replica-setting max_gpu_memory_gb=60 --num-kv-blocks 8750 --seed 0)
case $part in
  routing)  # ~2 x (replica start + 120 s of arrivals + drain): about 7 minutes
    .venv/bin/python -m bench.cluster "${common[@]}" --skip-streaming \
      --scale 1.0 --num-requests 240 --qps "$QPS" \
      --out "$out/h200-post-2replicas-qps$QPS.json" ;;
  streaming)  # one replica start, then 16 streamed chats x 4 rounds each way
    .venv/bin/python -m bench.cluster "${common[@]}" --only-streaming \
      --itl-requests 16 --itl-rounds 4 --out "$out/h200-streaming-itl.json" ;;
  *) echo "usage: $0 routing|streaming [QPS]"; exit 2 ;;
esac
