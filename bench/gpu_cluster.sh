#!/usr/bin/env bash
# Issue 15 on the H200 (for the lead; not run by CI): two GPU-memory-capped Greenlane replicas
# sharing the one GPU on Ray Serve, post recommendation at full length, affinity vs Ray's
# power-of-two router in one run, then streaming ITL straight to a server vs through Ray.
# Each replica: Llama-3.1-8B shape (bf16, 16 GB of weights) capped at 60 GB, with a KV pool of
# 8,750 blocks x 16 = 140k tokens (~18 GB): about one replica's share of the 20 users' profiles
# (20 x 14k = 280k tokens), as in the CPU run (docs/benchmarks-cpu.md "Several replicas").
# Usage: bash bench/gpu_cluster.sh [QPS]    (needs: make setup on the GPU machine; ~15 min)
set -euo pipefail
cd "$(dirname "$0")/.."
QPS="${1:-2}"
OUT=bench/results/cluster
mkdir -p "$OUT"
.venv/bin/python -m bench.cluster \
  --replicas 2 --replica-num-gpus 0.5 --model random:llama-3.1-8b \
  --replica-setting max_gpu_memory_gb=60 --num-kv-blocks 8750 \
  --scale 1.0 --num-requests 400 --qps "$QPS" --seed 0 \
  --itl-requests 16 --itl-rounds 4 \
  --out "$OUT/h200-post-2replicas-qps$QPS.json"
