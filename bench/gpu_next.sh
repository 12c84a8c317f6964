#!/usr/bin/env bash
# H200 session plan, one device call per plan, each under a hard deadline (DEADLINE_S, 500 s):
#   bash bench/gpu_next.sh a REV          # issue 5 checks + decode profile + 32B MIL, then
#                                         #   qwen2.5-3b serving: screen, long-data
#   bash bench/gpu_next.sh b REV          # qwen2.5-3b: screen, long-data, mixed (QPS ladder,
#                                         #   TBT SLO, auto with a TBT target)
#   bash bench/gpu_next.sh c REV [SPLIT]  # llama-3.1-8b: long-data, score+chat, ablation
#   bash bench/gpu_next.sh d REV          # qwen2.5-3b: the static side only (screen 96-112)
#   bash bench/gpu_next.sh e REV          # d, then llama-3.1-8b's auto side again
#   bash bench/gpu_next.sh f REV          # llama-3.1-8b auto at 1-2 QPS (disabled-split fix)
#   bash bench/gpu_next.sh g REV          # next: arxiv on qwen2.5-3b, mixed on llama-3.1-8b
#   bash bench/gpu_next.sh h REV          # decode attention kernels at batch 1..64
#   bash bench/gpu_next.sh i REV          # h, then qwen2.5-3b arxiv (3 sides, split graphs
#                                         #   captured at start-up)
#   bash bench/gpu_next.sh j REV          # llama-3.1-8b mixed and arxiv (3 sides each)
#   bash bench/gpu_next.sh k REV          # j at 2-8 QPS, then score+chat again
#   bash bench/gpu_next.sh m REV          # llama-3.1-8b long-data, 3 sides in one run
#   bash bench/gpu_next.sh n REV          # next: auto with layer slicing, 8B score+chat and
#                                         #   long-data
#   bash bench/gpu_next.sh o REV          # issue 17: prefill profile, then SRJF vs FCFS over
#                                         #   HTTP (post recommendation, KV pool 0.5x)
#   bash bench/gpu_next.sh p REV          # issue 17: KV pool 1x and default
#   bash bench/gpu_next.sh q REV          # issue 17: SPF, srjf-oneshot; credit verification
#   bash bench/gpu_next.sh r REV          # issue 13: off at 2k/8k/TBT-cut budgets vs auto, 3B
#                                         #   mixed and scoring next to chat
#   bash bench/gpu_next.sh s|t REV        # issue 13: auto with chunks vs the tuned baselines,
#                                         #   bisection (s: 3B, t: 8B; run each twice)
#   bash bench/gpu_next.sh u REV          # issue 13: off-2k vs off-tbt after the TBT cut's
#                                         #   affine correction, one probe each (3 min)
#   bash bench/gpu_next.sh v REV          # issue 13: off-tbt alone, mixed at 24 QPS, with the
#                                         #   mixed-step diagnostics (under 2 min)
#   bash bench/gpu_next.sh splits REV     # the fused decode attention's splits by context:
#                                         #   kernel tests, then bench.decode_splits (~3 min)
#   bash bench/gpu_next.sh w REV          # issue 12: decode step kernels by kind (8B x16, 3B x48)
#   bash bench/gpu_next.sh x REV          # piecewise prefill graphs: eager vs graph timing of
#                                         #   one prefill part, then their GPU tests and the
#                                         #   fused RoPE + K/V write's
#   bash bench/gpu_next.sh y REV          # issue 17: post recommendation at pool 1x, FCFS and
#                                         #   SRJF, two repeats of six probes (finer bisection)
#   bash bench/gpu_next.sh z REV [M]      # issue 13: the cost model's error per choice kind
#                                         #   (splits, layer slices) with scoring unchunked,
#                                         #   next to chat, after the chunked-cut GPU tests
#                                         #   (M: random:qwen2.5-3b; ~7 min)
#   bash bench/gpu_next.sh sweep REV [M]  # issue 13: off at 1k / 2k / 4k / 8k budgets, the
#                                         #   baseline sweep the issue asks (M: the 3B)
#   bash bench/gpu_next.sh default REV [M] # the engine's default before and after the cap on
#                                         #   steps with decodes (8,192 vs 2,048 beside
#                                         #   decodes), mixed chat then scoring next to chat
#   bash bench/gpu_next.sh cap REV [M]    # issue 13: auto's chunks filling the room vs held
#                                         #   to the 2,048 cap, against off at a fixed budget
#                                         #   (PARTS=score-chat, then mixed)
#   bash bench/gpu_next.sh whole REV [M]  # issue 13: scoring prompts too long to chunk in the
#                                         #   pool (credit verification, 8B in 24 GB) next to
#                                         #   chat: off vs auto (SIDES, as plan cap)
#   bash bench/gpu_next.sh warm REV [M]   # a bare machine's first call: start one server
#                                         #   (M: random:qwen2.5-3b) with --calibrate false
#                                         #   until healthy, so FlashInfer's modules and the
#                                         #   fused decode's Triton sizes compile, then stop;
#                                         #   the cache comes back as fi_cache.tar.gz
#   bash bench/gpu_next.sh cliff REV      # issue 13: the chunk cliff's candidates, one mixed
#                                         #   step each (bench.mixed_step --variants) at 41k,
#                                         #   20k and 8k of context (~1 min each)
#   bash bench/gpu_next.sh prof REV       # issue 17: the served-path prefill profile at the
#                                         #   default chunk, for the replays (~2 min)
#   bash bench/gpu_next.sh hostprof REV [M] # where the host's time goes next to scoring:
#                                         #   py-spy + the torch profiler under scoring at
#                                         #   SQPS (40) beside chat on a default server
#                                         #   (SIDES=off-2k,auto-2k: plan cap's server and
#                                         #   sides instead; M: the 3B; ~1.5 min after `warm`)
#   bash bench/gpu_next.sh hostab REV [M] # the engine thread's per-step work, this tree vs
#                                         #   .old_rev/old.tar.gz (e.g. dc82b8c), A B A B:
#                                         #   scoring at SQPS (40) beside chat on default
#                                         #   servers, no profilers (M: the 3B; ~6 min)
#   bash bench/gpu_next.sh kvab REV [M]   # --prefill-graphs-write-kv false vs the default, one
#                                         #   tree, A B A B, as plan hostab (M: the 3B; ~6 min)
#   bash bench/gpu_next.sh abandon REV [M] # a client leaving a long scoring prompt: the GPU
#                                         #   test, then bench.abandoned through HTTP (M: the
#                                         #   8B shape; 131k tokens, two repeats; ~3 min)
#   bash bench/gpu_next.sh batch REV      # issue 17: the default pool's batches on this GPU
#                                         #   (FCFS, SRJF; each search's step trace prices
#                                         #   the GPU's batches) after a profile of this GPU
#                                         #   with warm batch points of 24-32 (~8 min)
#   bash bench/gpu_next.sh mem REV [M]    # the chunk that follows the memory: its GPU test and
#                                         #   the gated launch's, then what start-up sizes at
#                                         #   the default against --prefill-chunk-tokens 2048
#                                         #   (chunk, reserve, KV cache, start-up time; M: the
#                                         #   8B shape; ~5 min)
#   bash bench/gpu_next.sh l REV          # issue 12: the fused RoPE + K/V write vs the unfused
#                                         #   pair, one layer, T = 1..16k, tiled variants; then
#                                         #   the decode-path GPU tests; issue 17: the prefill
#                                         #   profile again (DEADLINE_S=360)
# Carry: .whl .fi_cache .cache/smollm2-tok. Results in $OUT: gpu-runtime-*.json (suite),
# partition-*.json (serving; merge them with `python -m bench.gpu_serving --merge ...`),
# server logs, fi_cache.tar.gz if the FlashInfer cache grew (triton_cache.tar.xz if Triton's
# did): copy both to .fi_cache/ before the next call.
set -u
plan=${1:-a}; rev=${2:-unknown}; split=${3:-}; t0=$(date +%s)
deadline=${DEADLINE_S:-500}
left() { echo $(( deadline - ($(date +%s) - t0) )); }
export OUT=${OUT:-bench/results}
source bench/gpu_setup.sh  # wheels, FlashInfer cache as AOT, tokenizer
before=$fi_modules_before
echo "setup done, $(left) s left; plan $plan"
# Serving writes many files (harness JSONs, server logs); $OUT takes 8: they go to a work
# folder, the results JSON is copied to $OUT and the rest comes back as one tarball.
# Emptied first: a warm machine keeps /tmp between calls, and a later call's tarball would
# carry an earlier call's probe traces under the same names (thirty-third session).
work=/tmp/serving; rm -rf $work; mkdir -p $work
# Full-length workloads (scale 1): long prompts are what the split is for. Every side runs the
# same QPS ladder; max QPS is judged afterwards against the primary SLO (P99 TTFT + P99 TBT, as
# issue 6 asks) and a TPOT variant. auto runs with a TBT target of 80 % of the SLO's bound.
# DUR: seconds of arrivals per probe (plan q reads it too, for its own probes). Default 16:
# on the 3B's long prompts next to chat, 8-s probes passed 36 QPS for off-4k, off-tbt and
# auto in earlier sessions where 16-s probes failed all three there (TTFT P99 5-11 s at
# dcb240e): a short probe ends before the queue has built. A part takes about twice as long.
common=(--out-dir $work --rev "$rev" --scale 1.0 --duration-s ${DUR:-16} --drain-s 6
        --request-timeout-s 40 --command "${DUR:+DUR=$DUR }${PROBES:+PROBES=$PROBES }${PARTS:+PARTS=$PARTS }${REVERSE:+REVERSE=$REVERSE }${FIXED_K:+FIXED_K=$FIXED_K }${SIDES:+SIDES=$SIDES }${SCORE_WORKLOAD:+SCORE_WORKLOAD=$SCORE_WORKLOAD }${SQ0:+SQ0=$SQ0 }${START_S:+START_S=$START_S }${SERVER_EXTRA:+SERVER_EXTRA='$SERVER_EXTRA' }bash bench/gpu_next.sh $plan $rev $split")
# Max QPS at the P99 SLO by bisection for the sides in $sides (pairs: --side NAME:SETTINGS) on
# one server of model $m started with the options $1: mixed chat from $q0 QPS, then scoring
# next to chat from $sq0; $2: the parts when PARTS is unset. REVERSE=1 runs the sides in
# reverse order, SIDES=a,b only those named (plans s, t, sweep, default, cap);
# SCORE_WORKLOAD=post-recommendation-stream scores a stream of arriving users, primed, instead
# of 20 users all cold at each probe's start.
pick_sides() {
  if [ -n "${SIDES:-}" ]; then  # SIDES=a,b: only the sides of these names, in the plan's order
    local kept=() j
    for (( j = 0; j < ${#sides[@]}; j += 2 )); do
      case ",$SIDES," in *",${sides[j+1]%%:*},"*) kept+=("${sides[@]:j:2}") ;; esac
    done
    sides=("${kept[@]}")
  fi
  if [ "${REVERSE:-}" = 1 ]; then  # REVERSE=1: the sides in reverse order
    local reversed=() i
    for (( i = ${#sides[@]} - 2; i >= 0; i -= 2 )); do reversed+=("${sides[@]:i:2}"); done
    sides=("${reversed[@]}")
  fi
}
bisect_sides() {
  pick_sides
  python3 -m bench.gpu_serving "${common[@]}" --models $m --start-s 120 \
    --server-args "$1 ${SERVER_EXTRA:-}" \
    --start-qps $q0 --max-probes ${PROBES:-4} --slo ttft:2000,tbt:100 "${sides[@]}" \
    --score-start-qps $sq0 --chat-qps 2 --score-slo ttft:3000 \
    --score-workload ${SCORE_WORKLOAD:-post-recommendation} \
    --parts ${PARTS:-$2} --tag partition-${TAG:-$plan} --deadline-s "${PART_DEADLINE_S:-$(( $(left) - 10 ))}"
}
rc=0
case $plan in
  a)
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-5b --deadline-s 300 \
      --sections ceilings,fi_vs_torch,correctness,decode_profile,engine,mil32b || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --start-qps 4 --screen-qps 8 --slo ttft:2000,tpot:60 --max-probes 4 \
      --parts screen,long-data --tag partition-3b-a --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  b)
    # The greedy-16 engine check failed to start its engine in the last run (fixed since).
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-correct --deadline-s 60 \
      --sections correctness || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80" \
      --ladder 3,6,9,12 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --screen-fracs 0.73,0.85,0.91 --screen-qps 6 --parts screen,long-data,mixed \
      --tag partition-3b-b --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  c)
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-correct --deadline-s 60 \
      --sections correctness || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 90 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 1,2,3,4 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split "${split:-112}" --start-qps 2 --max-probes 3 --score-start-qps 4 \
      --chat-qps 1 --score-slo ttft:3000 --parts long-data,score-chat,ablation \
      --tag partition-8b --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  d)
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80" \
      --ladder 3,6,9,12 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --screen-fracs 0.73,0.79,0.85 --screen-qps 6 --parts screen,long-data,mixed \
      --sides static --tag partition-3b-d --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  e)
    # d, then llama-3.1-8b's auto side again (long-data, score+chat) after the fix that takes
    # a failing split out of service (plan c: cuBLAS failed on the 120/12 split).
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80" \
      --ladder 3,6,9,12 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --screen-fracs 0.73,0.79,0.85 --screen-qps 6 --parts screen,long-data,mixed \
      --sides static --tag partition-3b-d --deadline-s "$(( $(left) - 190 ))" || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 60 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 1,2,3,4 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --start-qps 2 --max-probes 3 --score-start-qps 4 --chat-qps 1 --score-slo ttft:3000 \
      --parts long-data,score-chat --sides auto --port 8200 --tag partition-8b-e \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  f)
    # The fix for decodes beside an in-flight prefill on a split that was just disabled:
    # llama-3.1-8b auto, long-data at 1 and 2 QPS (plan e's 1-QPS probe absorbed the episode).
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 40 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 1,2 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" --parts long-data \
      --sides auto --tag partition-8b-f --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  g)
    # What issue 6 still lacks: arxiv on qwen2.5-3b (3 sides) and mixed on llama-3.1-8b.
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80" \
      --ladder 3,6,9,12 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --static-split 96 --parts arxiv --tag partition-3b-g \
      --deadline-s "$(( $(left) - 200 ))" || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 60 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 1,2,3,4 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split 112 --parts mixed --port 8200 --tag partition-8b-g \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  h)
    # Issue 5's batch-1 decode: is FlashInfer's CUDA-core decode kernel faster than the
    # tensor-core one the backend uses at small batches? (may JIT-compile one module once)
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-attn --deadline-s 300 \
      --sections decode_attention || rc=1 ;;
  i)
    # h, then arxiv on qwen2.5-3b: off, auto and the best static split (96) on one server
    # that captured every split's decode graphs at start-up.
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-runtime-attn --deadline-s 200 \
      --sections decode_attention || rc=1
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 60 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80" \
      --ladder 3,6,9,12,15 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --static-split 96 --parts arxiv --tag partition-3b-i \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  j)
    # llama-3.1-8b: mixed and arxiv, off / auto / static 112 on one server.
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 90 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 1,2,3,4 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split 112 --parts mixed,arxiv --tag partition-8b-j \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  k)
    # j's ladder stopped below the limit of every side: mixed and arxiv again at 2-8 QPS,
    # then score+chat (off, auto) with every split's decode graphs captured at start-up.
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 60 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 2,4,6,8 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split 112 --start-qps 2 --max-probes 3 --score-start-qps 4 --chat-qps 1 \
      --score-slo ttft:3000 --parts mixed,arxiv,score-chat --tag partition-8b-k \
      --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  m)
    # llama-3.1-8b long-data with all three sides in one run (plans c/e/f composed them).
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 40 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120" \
      --ladder 2,4,6,8 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split 112 --parts long-data --tag partition-8b-m \
      --deadline-s "$(( $(left) - 5 ))" || rc=1 ;;
  n)
    # Next: auto with layer slicing (--partition-layer-slicing) on llama-3.1-8b: score+chat
    # (the case where the split costs scoring throughput), then long-data (3 sides).
    python3 -m bench.gpu_serving "${common[@]}" --models random:llama-3.1-8b --start-s 40 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 120 --partition-layer-slicing true" \
      --ladder 2,4,6,8 --slo ttft:3000,tbt:150 --slos "ttft:3000,tpot:80" \
      --static-split 112 --start-qps 2 --max-probes 3 --score-start-qps 4 --chat-qps 1 \
      --score-slo ttft:3000 --parts score-chat,long-data --tag partition-8b-n \
      --deadline-s "$(( $(left) - 170 ))" || rc=1
    # Shared prefixes computed once (scheduler), on the GPU: 8 users x 4 cold 12k profiles.
    timeout 160 python3 -m bench.shared_prefix --model random:llama-3.1-8b --device cuda \
      --max-gpu-memory-gb 60 --users 8 --items 4 --profile-tokens 12000 --item-tokens 150 \
      --repeats 2 --out "$OUT/shared-prefix-gpu-$(date +%F).json" || rc=1 ;;
  o)
    # Issue 17 in one call (DEADLINE_S=560): the prefill profile (the simulator's service
    # times; its JCT calibration is served), then max QPS at the P99 SLO by bisection, FCFS and
    # SRJF, two repeats, post recommendation at full scale with the KV pool at 0.5x the working
    # set: issue 17's target. 14-s probes: shorter ones flatter FCFS (its backlog drains within
    # the SLO), see docs/scheduling.md. The 1x part is expected to be skipped (recorded); plans
    # p and q measure the rest. FCFS's first probe: the simulator's prediction, rounded down.
    python3 -m bench.gpu_scheduling --model random:llama-3.1-8b --rev "$rev" \
      --out-dir $work/sched --duration-s 14 --start-s 30 --profile-s 75 \
      --start-qps "post-recommendation@0.5=4.5,post-recommendation@1=30" \
      --parts "post-recommendation:0.5:fcfs,srjf:2;post-recommendation:1:fcfs,srjf:1" \
      --command "bash bench/gpu_next.sh o $rev" \
      --deadline-s "$(( $(left) - 15 ))" || rc=1
    cp $work/sched/gpu-scheduling-*.json $work/sched/prefill-profile-*.json "$OUT/"
    cp $work/sched/gpu-scheduling-work/jct-calibration.json "$OUT/jct-calibration-h200.json" ;;
  r)
    # Issue 13: the split against the strongest single-GPU baselines, one server, one call
    # (DEADLINE_S=400): chunked prefill at 2,048 and 8,192 tokens, chunked prefill cut to a
    # TBT target (--tbt-slo-ms, chunking scoring prompts too), auto (TBT target 80 ms) on
    # qwen2.5-3b mixed (ladder), then scoring next to chat, as far as the deadline allows.
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 45 \
      --server-args "--partition auto --calibrate false --partition-tbt-slo-ms 80 --prefill-token-budget 8192" \
      --ladder 3,6,9 --slo ttft:2000,tbt:100 --slos "ttft:2000,tpot:60" \
      --side off-2k:partition=off,budget=2048,tbt=none \
      --side off-8k:partition=off,budget=8192,tbt=none \
      --side off-tbt:partition=off,budget=8192,tbt=80 \
      --side auto:partition=auto,budget=8192,tbt=none \
      --score-start-qps 4 --max-probes 3 --chat-qps 2 --score-slo ttft:3000 \
      --parts mixed,score-chat --tag partition-3b-r --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  s|t)
    # Issue 13's evaluation of auto with the chunked option (one call per model and repeat,
    # DEADLINE_S=560): s = qwen2.5-3b, t = llama-3.1-8b. Sides: the tuned baselines (off at
    # the best fixed budget of plan sweep; off with chunks cut to an 80 ms TBT target) and
    # auto (80 ms);
    # max QPS at the P99 SLO by bisection on mixed, then scoring next to chat. The server
    # calibrates its JCT model at start-up (auto's one prefill model needs it; every side
    # shares it). Run each plan twice (two repeats) and merge with gpu_serving --merge.
    # SERVER_EXTRA: more server options for every side; PARTS: a subset (e.g. PARTS=score-chat:
    # a repeat's part that a deadline cut); PROBES: probes per search (4; 6 narrows 32-48 QPS).
    if [ "$plan" = s ]; then m=random:qwen2.5-3b q0=12 sq0=16; else m=random:llama-3.1-8b q0=6 sq0=6; fi
    # First the FlashInfer backend against its fp32 reference in every planning mode (seconds;
    # the plan's index building changed in 2026-12-01's fourth session): serving numbers from a
    # wrong backend would be worthless.
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-backend-check --deadline-s 60 \
      --sections backend || rc=1
    # The sides share one server, so each starts from what the one before it learned (the
    # TBT cut's offset and scale, its tail factor): off-tbt always followed off-2k and auto
    # always followed off-tbt. REVERSE=1 runs them the other way round (auto first): give
    # each repeat pair one of each order.
    # The fixed-budget side is the best of plan sweep's 1k / 2k / 4k / 8k (2026-12-04 at
    # e604abe, max QPS at the P99 SLO, two runs on the 3B): on mixed chat 4k on the 3B (36 QPS
    # against 2k's 24) and 2k on the 8B (12 against 9 / 5.25 / 4.5); next to scoring 2k (the
    # same scoring rate as 4k and 8k with the chats' P99 ITL 42-55 ms against 73-90 and
    # 119-129). FIXED_K overrides it (in k tokens), e.g. FIXED_K=2 PARTS=score-chat on the 3B.
    if [ "$plan" = s ]; then fixed_k=4; else fixed_k=2; fi
    fixed_k=${FIXED_K:-$fixed_k}
    # auto at its defaults: its chunks within the 2,048 cap on a step with decodes since
    # 7ae7816 (mixed=2048: `budget=` alone sends no cap); off-tbt the target's cut alone.
    sides=(--side off-${fixed_k}k:partition=off,budget=$(( fixed_k * 1024 )),tbt=none
           --side off-tbt:partition=off,budget=8192,tbt=80
           --side auto:partition=auto,budget=8192,mixed=2048,tbt=none)
    bisect_sides "--partition auto --calibrate true --partition-tbt-slo-ms 80 --prefill-token-budget 8192" mixed,score-chat || rc=1 ;;
  sweep)
    # Issue 13 asks for off at the best fixed budget of a sweep (1k / 2k / 4k / 8k); plan r
    # swept 2k and 8k only (2k the better). Sides: off at each budget, no TBT target, on one
    # server (the budget is set at run time, under the start-up one); max QPS at the P99 SLO
    # by bisection on mixed, then scoring next to chat. M (the third argument):
    # random:qwen2.5-3b (default) or random:llama-3.1-8b. Four sides take ~9 min with both
    # parts: one part a call (PARTS=mixed, then PARTS=score-chat; DEADLINE_S=560). PROBES as
    # plan s; REVERSE=1 runs the sides from 8k down.
    m=${split:-random:qwen2.5-3b}
    case $m in *8b*) q0=6 sq0=6 ;; *) q0=12 sq0=16 ;; esac
    sides=(--side off-1k:partition=off,budget=1024,tbt=none
           --side off-2k:partition=off,budget=2048,tbt=none
           --side off-4k:partition=off,budget=4096,tbt=none
           --side off-8k:partition=off,budget=8192,tbt=none)
    bisect_sides "--partition auto --calibrate true --partition-tbt-slo-ms 80 --prefill-token-budget 8192" mixed,score-chat || rc=1 ;;
  default)
    # The default a user gets, before and after the twenty-eighth session's cap on steps that
    # carry decodes: 8,192 tokens for every step (the old default; the sweep's off-8k) against
    # 8,192 without decodes and 2,048 beside them (`--mixed-step-token-budget auto` on CUDA),
    # on one server at the defaults (partition off, SRJF), the cap switched through the admin
    # API. Max QPS at the P99 SLO by bisection on mixed chat, then scoring next to chat; one
    # part a call (PARTS=mixed, then PARTS=score-chat). M: random:qwen2.5-3b (default) or
    # random:llama-3.1-8b; REVERSE=1 runs the new default first.
    m=${split:-random:qwen2.5-3b}
    case $m in *8b*) q0=6 sq0=6 ;; *) q0=12 sq0=16 ;; esac
    sides=(--side off-8k:budget=8192,mixed=none,tbt=none
           --side default:budget=8192,mixed=2048,tbt=none)
    bisect_sides "--partition off --prefill-token-budget 8192 --prefill-policy srjf" mixed || rc=1 ;;
  cap)
    # Issue 13: auto's chunks with and without the cap on a step with decodes
    # (--mixed-step-token-budget, 2,048 on CUDA; since 7ae7816 it holds under a TBT target and
    # bounds auto's chunks, which before filled the room the target left). Next to chunked scoring off-2k
    # sustained 44 scoring QPS against auto's 30 and off-tbt's 32 at dcb240e, its chunks ~14 %
    # cheaper for the same work. Sides on one server: off at the best fixed budget (FIXED_K;
    # 2 next to scoring and on the 8B, 4 on the 3B's mixed chat), auto filling the room (mixed=none) and auto
    # within the cap (mixed=2048). PARTS: score-chat (default) or mixed; REVERSE as plan s.
    m=${split:-random:qwen2.5-3b}
    case $m in *8b*) q0=6 sq0=6 ;; *) q0=12 sq0=16 ;; esac
    # The best fixed budget of the sweep: 4k on the 3B's mixed chat, 2k on the 8B's (4k failed
    # its first probe there at f108d5d) and next to scoring.
    case ${PARTS:-score-chat}/$m in mixed/*8b*) fixed_k=${FIXED_K:-2} ;; mixed/*) fixed_k=${FIXED_K:-4} ;;
      *) fixed_k=${FIXED_K:-2} ;; esac
    # SIDES picks among these (default: off at FIXED_K, auto and auto-2k), e.g.
    # SIDES=off-2k,off-4k,auto-2k for both fixed budgets beside the default cap. auto-3k and
    # auto-4k: auto's chunks under a larger cap (does a cap sized from the step's fixed part,
    # larger beside ~48 decodes, buy off-4k's TTFT without its gap?); auto-share: the default
    # cap with --chunk-fixed-share 0.15 set at run time (so all of them share one server);
    # auto-share25 the same at 0.25 (smaller chunks: ~3x the fixed part's time, not ~5.7x).
    sides=(--side off-2k:partition=off,budget=2048,tbt=none
           --side off-4k:partition=off,budget=4096,tbt=none
           --side off-8k:partition=off,budget=8192,tbt=none
           --side auto:partition=auto,budget=8192,mixed=none,tbt=none
           --side auto-2k:partition=auto,budget=8192,mixed=2048,tbt=none
           --side auto-3k:partition=auto,budget=8192,mixed=3072,tbt=none
           --side auto-4k:partition=auto,budget=8192,mixed=4096,tbt=none
           --side auto-share:partition=auto,budget=8192,mixed=2048,share=0.15,tbt=none
           --side auto-share25:partition=auto,budget=8192,mixed=2048,share=0.25,tbt=none)
    SIDES=${SIDES:-off-${fixed_k}k,auto,auto-2k} bisect_sides "--partition auto --calibrate true --partition-tbt-slo-ms 80 --prefill-token-budget 8192" score-chat || rc=1 ;;
  whole)
    # Issue 13's target 2 where no token budget can help: a scoring prompt whose whole KV the
    # pool cannot hold while it is chunked runs whole (hybrid prefill, suffix-KV discard), and
    # beside chat it holds every decode for its whole length under off. Plan z makes that
    # case with --chunk-scoring-prefill false; here it is what memory forces: credit
    # verification (histories of 40-60k tokens) on the 8B in 24 GB (weights ~16 GB: a pool
    # of tens of thousands of tokens), chat at 2 QPS beside it, the default policy on both
    # sides: off-2k (the chats wait for each whole prompt) and auto (chunks, layer slices or a
    # split). 24 GB holds the 8B with every split's decode graphs (a 51,664-token pool on an
    # H100, forty-sixth session). ~5 min a call with PROBES=4 DUR=20 SQ0=0.25.
    m=${split:-random:llama-3.1-8b}
    # The baselines of plan sweep beside off-2k; a call takes ~2 min a side, so SIDES picks
    # (default off-2k,auto; e.g. SIDES=off-4k,off-8k,off-tbt in a second call).
    sides=(--side off-2k:partition=off,budget=2048,tbt=none
           --side off-4k:partition=off,budget=4096,tbt=none
           --side off-8k:partition=off,budget=8192,tbt=none
           --side off-tbt:partition=off,budget=8192,tbt=80
           --side auto:partition=auto,budget=8192,mixed=2048,tbt=none)
    SIDES=${SIDES:-off-2k,auto} pick_sides  # REVERSE=1: the chosen sides last to first
    # The start estimate (its timeout is 3x) decides whether the part fits the deadline: the
    # 8B in 24 GB started in 42-47 s with the FlashInfer cache carried (fiftieth session),
    # and a part estimated at 240 s was skipped with 185 s left.
    [ -f .fi_cache/fi_cache.tar.gz ] && start_s=120 || start_s=240
    python3 -m bench.gpu_serving "${common[@]}" --models $m --start-s ${START_S:-$start_s} \
      --server-args "--partition auto --calibrate true --partition-tbt-slo-ms 80 --partition-layer-slicing true --max-gpu-memory-gb 24 --prefill-policy srjf ${SERVER_EXTRA:-}" \
      "${sides[@]}" \
      --score-workload credit-verification --score-start-qps ${SQ0:-0.5} --chat-qps 2 \
      --max-probes ${PROBES:-4} --score-slo ttft:${SCORE_SLO_MS:-10000} \
      --parts score-chat --tag partition-$plan --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  z)
    # Issue 13's third target asks the cost model's error per choice kind; where chunks serve,
    # auto almost never splits (at most 2 splits in ~650 decisions at c05f523) and never took
    # layer slices, so those kinds have a handful of readings. Here scoring prompts are not
    # chunked (--chunk-scoring-prefill false: a long one next to chat runs whole, on a split or
    # in layer slices) and layer slicing is on; sides: off at 2,048 tokens (the scoring prompts
    # then run whole), auto, and a pinned split (static:112: every prefill on 112 SMs). Read
    # `engine_during_run.cost_model_errors_at_end` per side: mape_prefill_layer_sliced,
    # mape_prefill_concurrent, mape_decode_concurrent, mape_chunked_step and their num_*.
    # First the chunked-cut GPU tests (auto, and off with a target on the cost model's decode
    # base since 0ce75f1) and the first-use check (nothing compiled while a chat's first
    # chunks run, since 3ba50cc); three 3B engines, under a minute with the cache carried.
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_first_use_gpu.py \
      tests/gpu/test_auto_chunked_gpu.py >"$OUT/pytest-chunked.log" 2>&1 || rc=1
    tail -5 "$OUT/pytest-chunked.log"
    m=${split:-random:qwen2.5-3b}
    python3 -m bench.gpu_serving "${common[@]}" --models $m --start-s 120 \
      --server-args "--partition auto --calibrate true --partition-tbt-slo-ms 80 --prefill-token-budget 8192 --partition-layer-slicing true --chunk-scoring-prefill false ${SERVER_EXTRA:-}" \
      --start-qps 12 --max-probes 3 --slo ttft:2000,tbt:100 \
      --side off-2k:partition=off,budget=2048,tbt=none \
      --side auto:partition=auto,budget=8192,mixed=2048,tbt=none \
      --side split-112:partition=static:112,budget=8192,tbt=none \
      --score-start-qps 16 --chat-qps 2 --score-slo ttft:3000 \
      --parts ${PARTS:-score-chat} --tag partition-$plan --deadline-s "$(( $(left) - 10 ))" || rc=1 ;;
  u)
    # Issue 13, a short check (DEADLINE_S=200) of the TBT cut's affine online correction
    # (CorrectedCost): off at 2,048 tokens and off cut to an 80 ms TBT target, qwen2.5-3b, mixed
    # at 24 QPS and scoring at 16 QPS next to chat, one probe each. Plan s at df91e1a (single
    # factor) measured off-tbt's P99 ITL at 97 ms (mixed, 24 QPS) and 158 ms next to scoring.
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 50 \
      --server-args "--partition auto --calibrate true --partition-tbt-slo-ms 80 --prefill-token-budget 8192" \
      --ladder 24 --slo ttft:2000,tbt:100 --max-probes 1 \
      --side off-2k:partition=off,budget=2048,tbt=none \
      --side off-tbt:partition=off,budget=8192,tbt=80 \
      --score-start-qps 16 --chat-qps 2 --score-slo ttft:3000 \
      --parts mixed,score-chat --tag partition-u --deadline-s "$(( $(left) - 5 ))" || rc=1 ;;
  v)
    # Issue 13, the shortest look (DEADLINE_S=100) at why --tbt-slo-ms misses its target at
    # the P99: off cut to 80 ms, qwen2.5-3b, mixed at 24 QPS, one probe; the side's
    # engine_during_run says how many mixed steps went over the target and measured/predicted.
    python3 -m bench.gpu_serving "${common[@]}" --models random:qwen2.5-3b --start-s 30 \
      --server-args "--partition off --calibrate true --tbt-slo-ms 80 --prefill-token-budget 8192 ${SERVER_EXTRA:-}" \
      --ladder 24 --slo ttft:2000,tbt:100 --max-probes 1 \
      --side off-tbt:partition=off,budget=8192,tbt=80 \
      --parts mixed --tag partition-v --deadline-s "$(( $(left) - 3 ))" || rc=1
    python3 -c "import json,glob; d=json.load(open(glob.glob('$work/partition-v-*.json')[0])); print(json.dumps(d['models']['random:qwen2.5-3b']['workloads']['mixed']['off-tbt'].get('engine_during_run')))" ;;
  splits)
    # The fused decode attention's KV splits by each row's context (split_chunk_tokens): the
    # kernel tests compiled, then the engine-level timing against the fixed split, 3B and 8B
    # shapes at 16-64 rows (~3 min; plan v with SERVER_EXTRA is the served check).
    timeout "$(( $(left) - 5 ))" python3 -m pytest -q -m "gpu or kernels" -p no:cacheprovider \
      tests/test_decode_kernels.py tests/gpu/test_fused_decode_gpu.py \
      >"$OUT/pytest-splits.log" 2>&1 || rc=1
    tail -3 "$OUT/pytest-splits.log"
    GREENLANE_REVISION=$rev timeout "$(( $(left) - 3 ))" python3 -m bench.decode_splits \
      --out "$OUT/decode-splits-$(date -u +%F)-${rev:0:7}.json" || rc=1 ;;
  w)
    # Issue 12, where the decode step's time goes at the batch sizes its targets name (8B x16
    # at 2k contexts, 3B x48 at 640): CUDA-graph step vs floor, kernels by kind (DEADLINE_S=240).
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-decode-breakdown \
      --deadline-s "$(( $(left) - 10 ))" --sections ceilings,decode_breakdown || rc=1 ;;
  x)
    # Piecewise prefill graphs (runtime/graphs/prefill.py; issues 12 and 13), DEADLINE_S=220:
    # eager vs graph time of one prefill part of 16..2048 tokens (with their hidden states
    # compared), then the GPU tests (captured graphs vs eager, an engine scoring alike).
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-prefill-graphs \
      --deadline-s "$(( $(left) - 120 ))" --sections prefill_graphs || rc=1
    # With them: the fused RoPE + K/V write's GPU tests and its Triton kernel compiled.
    timeout "$(( $(left) - 5 ))" python3 -m pytest -q -m "gpu or kernels" -p no:cacheprovider \
      tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_rope_kv_write_gpu.py \
      tests/test_rope_kv_write.py >"$OUT/pytest-prefill-graphs.log" 2>&1 || rc=1
    tail -5 "$OUT/pytest-prefill-graphs.log" ;;
  l)
    # Issue 12's prefill check read the 16k prompt 3 % slower fused (0.528 vs 0.511 s, one
    # reading each at 0475b77): time the kernel per token count and tile size, DEADLINE_S=360.
    python3 -m bench.gpu_suite --rev "$rev" --tag gpu-rope-kv \
      --deadline-s "$(( $(left) - 220 ))" --sections rope_kv || rc=1
    timeout "$(( $(left) - 110 ))" python3 -m pytest -q -m "gpu or kernels" -p no:cacheprovider \
      tests/gpu/test_rope_kv_write_gpu.py tests/gpu/test_overlap_gpu.py \
      tests/test_rope_kv_write.py >"$OUT/pytest-rope-kv.log" 2>&1 || rc=1
    tail -5 "$OUT/pytest-rope-kv.log"
    # Issue 17: the simulator's service profile at this revision (plan y's replay read SRJF
    # 32 % low with the 2026-12-01 profile, measured before prefix hits attended from the
    # pool); `python -m bench.sim_vs_gpu --gpu ... --profile <this>` replays plans o, p, y.
    if [ "$(left)" -gt 90 ]; then
      timeout "$(( $(left) - 5 ))" python3 -m bench.prefill_profile --model random:llama-3.1-8b \
        --device cuda --deadline-s "$(( $(left) - 20 ))" --rev "$rev" \
        --out "$OUT/prefill-profile-gpu-scheduling-$(date +%F)-$rev.json" || rc=1
    fi ;;
  p|q|y)
    # Issue 17, the rest (one call each, DEADLINE_S=560), serving the JCT calibration plan o
    # measured when it is carried as bench/results/jct-calibration-h200.json:
    #   p: post recommendation at 1x the working set and at the default pool (FCFS, SRJF);
    #   q: SPF and srjf-oneshot beside FCFS at 0.5x, credit verification (scale 0.25: 60 users
    #      x 10k-15k tokens, so that 1x its working set fits the H200) at 0.5x;
    #   y: p's 1x part alone, two repeats with six probes a search (p's four probes at a 1.5
    #      step only bounded SRJF / FCFS between 1.2 and 1.9), 12-s probes.
    probes=4; dur=14
    case $plan in
      p) parts="post-recommendation:1:fcfs,srjf:1;post-recommendation:default:fcfs,srjf:1" ;;
      # q: six probes since the forty-fourth session: with four, SRJF's search (from FCFS's
      # max, x1.5) ended in [6.75, 8.44), a quarter wide, in 10 of the 12 at the 0.5x pool of
      # the forty-first and forty-fourth sessions.
      q) parts="post-recommendation:0.5:fcfs,spf,srjf-oneshot:1;credit-verification:0.5:fcfs,srjf:1"; probes=6 ;;
      y) parts="post-recommendation:1:fcfs,srjf:2"; probes=6; dur=12 ;;
    esac
    parts=${PARTS:-$parts}  # e.g. PARTS="credit-verification:0.5:fcfs,srjf:1": one part again
    probes=${PROBES:-$probes}  # e.g. PROBES=7: searches narrowed to ~5 % (the bisection's tol)
    dur=${DUR:-$dur}  # probe seconds, e.g. DUR=120: the long probes short ones compress
    # START_S: the server's start-up estimate (its timeout is 3x): on a bare machine Triton
    # compiles the fused decode's sizes at the first start (the 90 s of 30 were not enough).
    # SERVER_ARGS: more server options for every part (e.g. "--ttft-slo-ms 3600": SRJF's lambda
    # from the SLO), recorded in the results' command. PER_REQUEST=1: each probe's requests'
    # send times and latencies in the search records (bench.gpu_scheduling --per-request).
    # SIDES_Q="c2k=--prefill-chunk-tokens 2048;base=": several server settings in one call,
    # in the order given (one machine, one setup), each with its own results JSON
    # (gpu-scheduling-$plan-NAME-DATE.json) and work folder; SERVER_ARGS is added to every
    # side. Each side gets an equal share of the time left when it starts.
    cal=bench/results/jct-calibration-h200.json
    IFS=';' read -r -a sides_q <<< "${SIDES_Q:-=}"
    for (( i = 0; i < ${#sides_q[@]}; i++ )); do
      name=${sides_q[i]%%=*}; extra=${sides_q[i]#*=}
      args="${SERVER_ARGS:-}${extra:+ $extra}"; args=${args# }
      tag=gpu-scheduling-$plan${name:+-$name}
      share=$(( ($(left) - 15) / (${#sides_q[@]} - i) ))
      python3 -m bench.gpu_scheduling --model random:llama-3.1-8b --rev "$rev" \
        --out-dir $work/sched --duration-s $dur --max-probes $probes --start-s ${START_S:-30} --no-profile \
        $( [ -f $cal ] && echo --jct-calibration $cal ) \
        --start-qps "post-recommendation@0.5=4.5,post-recommendation@1=30,post-recommendation@default=40,credit-verification=5" \
        ${args:+--server-args "$args"} ${PER_REQUEST:+--per-request} \
        --parts "$parts" --tag $tag --command "${DUR:+DUR=$DUR }${PROBES:+PROBES=$PROBES }${PARTS:+PARTS='$PARTS' }${args:+SERVER_ARGS='$args' }${PER_REQUEST:+PER_REQUEST=1 }bash bench/gpu_next.sh $plan $rev" \
        --deadline-s "$share" || rc=1
    done
    cp $work/sched/gpu-scheduling-*.json "$OUT/" ;;
  batch)
    # Issue 17: why the simulator over-predicts the default pool's ceiling (docs/scheduling.md,
    # "The replays' forwards"). A prefill profile of this GPU first, with warm batch points at
    # the sizes the engine runs there (BATCH_POINTS; a point whose contexts do not fit the
    # pool is recorded as skipped), then FCFS and SRJF at the default pool, five probes each.
    # Every search records the server's step trace after it (its last probes, at the
    # ceiling): the device's busy share against the host's gaps, and the device time per
    # request by batch size, which bench.sim_vs_gpu sets beside the simulator's price.
    # First (BATCH_COST=0 skips it, ~1.5 min): bench.batch_cost, the same warm points read by
    # wall clock and by device events, on the gathered path (the old profiles' price) and kept
    # (the served path, today's profile), contexts separate and shared, to check that the
    # attention path explains the old profiles' 2-4x overcharge of warm batches
    # (docs/scheduling.md) and what is left for the host or the memory reads.
    if [ "${BATCH_COST:-1}" != 0 ]; then
      timeout 170 python3 -m bench.batch_cost --model random:llama-3.1-8b --device cuda \
        --points 16:14336:1,16:14336:8,16:14336:24,16:14336:48,150:14336:24 --rev "$rev" \
        --out "$OUT/batch-cost-$rev.json" || rc=1
    fi
    python3 -m bench.gpu_scheduling --model random:llama-3.1-8b --rev "$rev" \
      --out-dir $work/sched --duration-s 14 --max-probes 5 --start-s 30 --profile-s 110 \
      --profile-args "--batch-points ${BATCH_POINTS:-150:16384:4,150:16384:16,512:0:8,1024:0:8,16:14336:24,150:14336:24,16:14336:32}" \
      --start-qps "post-recommendation@default=40" \
      --parts "post-recommendation:default:fcfs,srjf:1" --tag gpu-scheduling-batch \
      --command "bash bench/gpu_next.sh batch $rev" \
      --deadline-s "$(( $(left) - 15 ))" || rc=1
    cp $work/sched/gpu-scheduling-*.json $work/sched/prefill-profile-*.json "$OUT/" ;;
  cliff)
    # Issue 13: a mixed chunked step at long context falls off a cliff where FlashInfer's FA2
    # plan stops splitting the KV (H100, 8B, 41k of context: 42.6 ms at 350 tokens beside 10
    # decodes, 72.4 at 355; docs/benchmarks.md, "Scoring prompts too long to chunk"). One
    # engine-level sweep per context: the served step against FA3, the decodes in their own
    # forward, and that with the chunk forced onto FA2 (bench.mixed_step's docstring); the
    # variant that holds the split's time past the cliff without costing below it is the fix
    # (since 2026-12-06 the backend's work rule, `FA3_WORK_RATIO_*`). [M] another model;
    # CONTEXTS, CHUNKS, DECODES, DECODE_CTX, VARIANTS (e.g. served,fa2,fa3: the rule against
    # each kernel forced) change the sweep.
    for ctx in ${CONTEXTS:-41000 20000 8000}; do
      timeout "$(( $(left) - 10 ))" python3 -m bench.mixed_step --model "${split:-random:llama-3.1-8b}" \
        --device cuda --context "$ctx" --chunks "${CHUNKS:-330:460:10}" --decodes "${DECODES:-6,10}" \
        --decode-context "${DECODE_CTX:-2000}" --repeats 3 \
        --variants "${VARIANTS:-served,fa3,unmerged,unmerged-fa2}" \
        --rev "$rev" --out "$OUT/mixed-step-${split:+${split##*:}-}$ctx.json" || rc=1
    done ;;
  prof)
    # The served-path prefill profile of plan batch's first part, alone, at the engine's
    # default sizing (hybrid prefill's chunk follows the memory since 7992938; the profile of
    # 86ce54d ran at 2,048, and the forty-fifth session found the GPU's cold forwards at 16,384
    # 1.02-1.03x its price, step by step): the replays of plan q's searches then need no
    # --forward-scales-what-if. ~2 min after `warm`.
    timeout "$(( $(left) - 10 ))" python3 -m bench.prefill_profile --model random:llama-3.1-8b \
      --device auto --out "$OUT/prefill-profile-served-$rev.json" --deadline-s "$(( $(left) - 25 ))" \
      --rev "$rev" --no-progress \
      --batch-points "${BATCH_POINTS:-150:16384:4,150:16384:16,512:0:8,1024:0:8,16:14336:24,150:14336:24,16:14336:32}" \
      || rc=1 ;;
  mem)
    # Since 7992938 hybrid prefill's chunk follows the memory on CUDA. First its GPU test and
    # the gated launch's, then, one server at a time at the default sizing, what start-up
    # decides with the chunk left to auto and with the old 2,048 (bench.startup_memory: the
    # chunk, the activation reserve, the KV cache's tokens, the start-up time).
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefill_chunk_auto_gpu.py \
      tests/gpu/test_gated_launch_gpu.py >"$OUT/pytest-mem.log" 2>&1 || rc=1
    tail -3 "$OUT/pytest-mem.log"
    timeout "$(( $(left) - 10 ))" python3 -m bench.startup_memory --model "${split:-random:llama-3.1-8b}" \
      --side auto= --side "c2k=--prefill-chunk-tokens 2048" --rev "$rev" --log-dir $work \
      --out "$OUT/startup-memory-$rev.json" || rc=1 ;;
  abandon)
    # A client leaving a long scoring prompt (since c74da04 its step stops at the next layer):
    # the GPU test, then through HTTP what the next request waits (bench.abandoned) on the 8B
    # shape, 131,000-token prompts, two repeats. ~3 min after `warm`.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_interrupt_gpu.py || rc=1
    python3 - "${split:-random:llama-3.1-8b}" "$(( $(left) - 20 ))" "$rev" "$OUT" <<'PY' || rc=1
import subprocess, sys
from pathlib import Path
from bench.gpu_serving import Server
model, budget_s, rev, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
s = Server(model, 8011, [], Path("/tmp/serving/abandon.log"))
print(f"abandon: {model} healthy after {s.start(min(300.0, budget_s)):.0f} s", flush=True)
try:
    name = model.split(":")[-1]
    subprocess.run(
        [sys.executable, "-m", "bench.abandoned", "--url", s.url, "--num-tokens", "131000",
         "--repeats", "2", "--server-revision", rev,
         "--json", f"{out}/abandoned-{name}-{rev}.json"],
        check=True,
    )
finally:
    s.stop()
PY
    ;;
  hostprof)
    # Where the host's time goes next to scoring (bench.host_profile): scoring at a fixed rate
    # (SQPS, 40) next to chat at 2 QPS, py-spy over the server's processes, then the torch
    # profiler over 300 steps. SIDES=default (the default): a default server, as plan hostab's,
    # where the short suffix steps are ~40 % of the mixed steps. SIDES=off-2k,auto-2k (plan
    # cap's names): one server started as plan cap's, each side in turn. Until 7b97c1b the
    # profiler's stop parsed its events on the engine thread, a 30-s stall (a default server's
    # step trace, H100, 2026-12-05) that filled the queue (429s): the load's latencies of
    # those runs are the stall's; py-spy, sampled before it, is not. ~1.5 min a side.
    export PATH=/tmp/site/bin:$PATH  # py-spy, from its wheel in .whl
    python3 - "${split:-random:qwen2.5-3b}" "$(( $(left) - 20 ))" "${SQPS:-40}" \
      "${SIDES:-default}" "$OUT" <<'PY' || rc=1
import subprocess, sys
from pathlib import Path
from bench.gpu_serving import Server
model, budget_s, qps, names, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sides = {"default": "",
         "off-2k": "partition=off,budget=2048,tbt=none",
         "auto-2k": "partition=auto,budget=8192,mixed=2048,tbt=none",
         "auto": "partition=auto,budget=8192,mixed=none,tbt=none"}
if names == "default":
    args = ["--calibrate", "false"]
elif "default" in names.split(","):
    sys.exit("hostprof: SIDES=default runs alone (its own server)")
else:
    args = ["--partition", "auto", "--calibrate", "true", "--partition-tbt-slo-ms", "80",
            "--prefill-token-budget", "8192"]
s = Server(model, 8011, args, Path("/tmp/serving/hostprof.log"))
print(f"hostprof: {model} healthy after {s.start(min(200.0, budget_s)):.0f} s", flush=True)
try:
    for name in names.split(","):
        subprocess.run(
            [sys.executable, "-m", "bench.host_profile", "--url", s.url, "--settings",
             sides[name], "--score-qps", qps, "--out-dir", "/tmp/serving/hostprof",
             "--tag", f"hostprof-{name}"], check=True, timeout=150)
        subprocess.run(["cp", f"/tmp/serving/hostprof/hostprof-{name}.json", out], check=True)
finally:
    s.stop()
PY
    ;;
  hostab|kvab)
    # hostab: through HTTP, what the engine thread's lighter steps buy (since dc82b8c: digests from the
    # API server, no per-block token check, a decode's applied step without copies, inline
    # reference counts): scoring at SQPS next to chat at 2 QPS on default servers, this tree
    # and the old one alternated A B A B, no profiler attached. Each JSON holds the scoring
    # latency, the chat stream's file beside it, and the step trace's short suffix steps and
    # decode steps (device, launch and plan time). ~80 s a server after `warm`.
    # kvab: the prefill graphs running the fused RoPE + K/V write themselves (the default since
    # 2026-12-05, measured by this plan) against --prefill-graphs-write-kv false, one tree, alternated
    # A B A B, as plan hostab: scoring at SQPS next to chat at 2 QPS, no profiler; each JSON
    # holds the scoring latency and the short steps' device, launch and plan time. Run
    # tests/gpu/test_prefill_graphs_gpu.py first. ~80 s a server after `warm`.
    if [ "$plan" = hostab ]; then
      mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old || { echo "no .old_rev"; exit 1; }
    fi
    python3 - "${split:-random:qwen2.5-3b}" "$deadline" "$t0" "${SQPS:-40}" "$OUT" "$plan" <<'PY' || rc=1
import subprocess, sys, tarfile, time
from pathlib import Path
from bench.gpu_serving import Server
model, deadline, t0, qps, out, plan = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
# (name, server args, served tree, host_profile args), alternated A B A B.
if plan == "hostab":
    # git archive writes the commit into the tarball's pax header: the old side's revision.
    old_rev = tarfile.open(".old_rev/old.tar.gz").pax_headers.get("comment", "unknown")
    sides = [("new", [], None, []), ("old", [], Path("/tmp/old"), ["--server-revision", old_rev])]
else:
    # Since 2026-12-05 the graphs write the KV by default: the other side turns it off.
    sides = [("nographkv", ["--prefill-graphs-write-kv", "false"], None, []), ("default", [], None, [])]
for i, (name, server_args, tree, profile_args) in enumerate(sides * 2):
    if deadline - (time.time() - t0) < 110:
        print(f"{plan}: {i}-{name} skipped for time", flush=True)
        break
    log = Path(f"/tmp/serving/{plan}-{i}-{name}.log")
    s = Server(model, 8011, ["--calibrate", "false", *server_args], log, tree)
    print(f"{plan}: {i}-{name} healthy after {s.start(120.0):.0f} s", flush=True)
    try:
        tag = f"{plan}-{i}-{name}"
        subprocess.run(
            [sys.executable, "-m", "bench.host_profile", "--url", s.url, "--score-qps", qps,
             "--py-spy-s", "0", "--profile-steps", "0", "--out-dir", f"/tmp/serving/{plan}",
             "--tag", tag, *profile_args], check=True, timeout=150)
        subprocess.run(["cp", f"/tmp/serving/{plan}/{tag}.json", out], check=True)
    finally:
        s.stop()
PY
    ;;
  warm)
    # Compiling here keeps it out of a later plan's deadline (a server start on a bare machine
    # took 246 s on the 8B; the plan after it timed out its own start in the same call).
    python3 - "${split:-random:qwen2.5-3b}" "$(( $(left) - 20 ))" <<'PY' || rc=1
import sys
from pathlib import Path
from bench.gpu_serving import Server
s = Server(sys.argv[1], 8011, ["--calibrate", "false"], Path("/tmp/serving/warm.log"))
print(f"warm: {sys.argv[1]} healthy after {s.start(float(sys.argv[2])):.0f} s", flush=True)
s.stop()
PY
    ;;
  *) echo "unknown plan $plan (a to z)"; exit 2 ;;
esac
cp $work/partition-*.json "$OUT/" 2>/dev/null
# (Named by TAG where a plan takes one: the same plan twice in a call keeps both.)
tar czf "$OUT/serving-${TAG:-$plan}.tar.gz" -C $work . 2>/dev/null
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
echo "flashinfer JIT modules: $before before, $after after; $(left) s of $deadline left"
if [ "$after" != "$before" ]; then
  (cd ~/.cache && tar czf "$OUT/fi_cache.tar.gz" --exclude='*.o' --exclude='*.cu' \
     --exclude='*.ninja*' --exclude='*.lock' flashinfer)
fi
triton_after=$( (find ~/.triton/cache -type f 2>/dev/null || true) | wc -l)
if [ "$triton_after" != "$triton_before" ]; then
  (cd ~/.triton && tar cJf "$OUT/triton_cache.tar.xz" cache)
fi
exit $rc
