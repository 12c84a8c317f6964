#!/usr/bin/env bash
# Next H200 session, one call per plan (each fits a 10-minute call: hard deadline 540 s):
#   bash bench/gpu_next.sh a REV   # mil32b ON bracket (issue 5), then serving on qwen2.5-3b
#   bash bench/gpu_next.sh b REV   # serving on llama-3.1-8b (issue 6)
#   bash bench/gpu_next.sh c REV   # qwen2.5-3b parts that plan a's deadline skipped
# Carry: .whl .fi_cache .cache/smollm2-tok. Results in $OUT: partition-<date>.json (serving),
# gpu-runtime-mil32b-on-<date>.json, harness JSONs, server logs, fi_cache.tar.gz if it grew.
set -u
plan=${1:-a}; rev=${2:-unknown}; t0=$(date +%s)
left() { echo $(( 540 - ($(date +%s) - t0) )); }
export OUT=${OUT:-bench/results}
source bench/gpu_setup.sh  # wheels, FlashInfer cache as AOT, tokenizer
before=$fi_modules_before
echo "setup done, $(left) s left; plan $plan"
rc=0
case $plan in
  a)
    # ~25 s build + OFF probes, ~30 s shallow ON probes, ~60 s full-depth check at ~116k.
    python3 -m bench.gpu_suite --sections mil32b --rev "$rev" --tag gpu-runtime-mil32b-on \
      --deadline-s 210 || rc=1
    python3 -m bench.gpu_serving --models random:qwen2.5-3b --rev "$rev" --deadline-s \
      "$(( $(left) - 15 ))" --start-s 40 --start-qps 2 --slo ttft:2000,tpot:60 \
      --command "bash bench/gpu_next.sh a $rev" || rc=1 ;;
  b)
    python3 -m bench.gpu_serving --models random:llama-3.1-8b --rev "$rev" --deadline-s \
      "$(( $(left) - 15 ))" --start-s 90 --start-qps 1 --slo ttft:3000,tpot:80 \
      --screen-qps 2 --score-start-qps 2 --chat-qps 1 --tag partition-8b \
      --command "bash bench/gpu_next.sh b $rev" || rc=1 ;;
  c)
    python3 -m bench.gpu_serving --models random:qwen2.5-3b --rev "$rev" --deadline-s \
      "$(( $(left) - 15 ))" --start-s 40 --start-qps 2 --slo ttft:2000,tpot:60 \
      --parts screen,arxiv,score-chat,ablation --tag partition-3b-rest \
      --command "bash bench/gpu_next.sh c $rev" || rc=1 ;;
  *) echo "unknown plan $plan (a, b or c)"; exit 2 ;;
esac
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
echo "flashinfer JIT modules: $before before, $after after; $(left) s of 540 left"
if [ "$after" != "$before" ]; then
  (cd ~/.cache && tar czf "$OUT/fi_cache.tar.gz" --exclude='*.o' --exclude='*.cu' \
     --exclude='*.ninja*' --exclude='*.lock' flashinfer)
fi
exit $rc
