#!/usr/bin/env bash
# H200 session plan, one device call per plan, each under a hard deadline (DEADLINE_S, 500 s):
#   bash bench/gpu_next.sh a REV          # issue 5 checks + decode profile + 32B MIL, then
#                                         #   qwen2.5-3b serving: screen, long-data
#   bash bench/gpu_next.sh b REV SPLIT    # qwen2.5-3b: mixed, score+chat, ablation, arxiv
#                                         #   (SPLIT = best static split from a's screen)
#   bash bench/gpu_next.sh c REV          # llama-3.1-8b serving: screen, long-data, mixed
# Carry: .whl .fi_cache .cache/smollm2-tok. Results in $OUT: gpu-runtime-*.json (suite),
# partition-*.json (serving; merge them with `python -m bench.gpu_serving --merge ...`),
# server logs, fi_cache.tar.gz if the FlashInfer cache grew.
set -u
plan=${1:-a}; rev=${2:-unknown}; split=${3:-}; t0=$(date +%s)
deadline=${DEADLINE_S:-500}
left() { echo $(( deadline - ($(date +%s) - t0) )); }
export OUT=${OUT:-bench/results}
source bench/gpu_setup.sh  # wheels, FlashInfer cache as AOT, tokenizer
before=$fi_modules_before
echo "setup done, $(left) s left; plan $plan"
# Full-length workloads (scale 1): long prompts are what the split is for. Four probes per
# max-QPS search (doubling, then bisection); a request over 40 s counts as failed.
# Serving writes many files (harness JSONs, server logs); $OUT takes 8: they go to a work
# folder, the results JSON is copied to $OUT and the rest comes back as one tarball.
work=/tmp/serving; mkdir -p $work
common=(--out-dir $work --rev "$rev" --scale 1.0 --max-probes 4 --duration-s 8 --drain-s 6
        --request-timeout-s 40 --command "bash bench/gpu_next.sh $plan $rev $split")
qwen=(--models random:qwen2.5-3b --start-s 45 --start-qps 4 --screen-qps 8
      --slo ttft:2000,tpot:60 --score-start-qps 8 --chat-qps 2)
rc=0
case $plan in
  a)
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-5b --deadline-s 300 \
      --sections ceilings,fi_vs_torch,correctness,decode_profile,engine,mil32b || rc=1
    python3 -m bench.gpu_serving "${common[@]}" "${qwen[@]}" --parts screen,long-data \
      --tag partition-3b-a --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  b)
    python3 -m bench.gpu_serving "${common[@]}" "${qwen[@]}" --static-split "${split:-96}" \
      --parts mixed,score-chat,ablation,arxiv --tag partition-3b-b \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  c)
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 90 \
      --start-qps 1.5 --screen-qps 3 --slo ttft:3000,tpot:80 --parts screen,long-data,mixed \
      --tag partition-8b --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  *) echo "unknown plan $plan (a, b or c)"; exit 2 ;;
esac
cp $work/partition-*.json "$OUT/" 2>/dev/null
tar czf "$OUT/serving-$plan.tar.gz" -C $work . 2>/dev/null
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
echo "flashinfer JIT modules: $before before, $after after; $(left) s of $deadline left"
if [ "$after" != "$before" ]; then
  (cd ~/.cache && tar czf "$OUT/fi_cache.tar.gz" --exclude='*.o' --exclude='*.cu' \
     --exclude='*.ninja*' --exclude='*.lock' flashinfer)
fi
exit $rc
