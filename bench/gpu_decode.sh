#!/usr/bin/env bash
# Issue 12 on the H200: decode through HTTP (bench.decode), old revision vs this one, one run.
#   bash bench/gpu_decode.sh sanity REV   # this revision: GPU tests of the engine, then a short
#                                         # decode run on the 8B shape (B=1, 64)
#   bash bench/gpu_decode.sh old REV      # the old revision (.old_rev/old.tar.gz): 8B B=1,16,64
#                                         # and 3B 48 streams
#   bash bench/gpu_decode.sh new REV      # this revision: the same, plus the 16k prefill check,
#                                         # 3B with 2 API servers, py-spy of the 48-stream run
#   bash bench/gpu_decode.sh fused REV    # --fused-rope-kv-write off vs on, one server each way
#                                         # in alternating order: 3B 48 streams, 8B B=1,16,64
#   bash bench/gpu_decode.sh splits REV   # the fused decode's KV splits: 8B B=16,64 at 2k, this
#                                         # revision vs .old_rev (ABBA), then tests/gpu
#   bash bench/gpu_decode.sh prefill REV  # the 16k cold scoring prompt, this revision vs the old
#                                         # one (.old_rev/old.tar.gz), ABBA, 3 readings a server
#   bash bench/gpu_decode.sh first REV    # a fresh server's first long prompt (8B): cold
#                                         # prompts 16k x3 then 32k x3 without and with
#                                         # --prefill-warm-up-tokens, then a third server's
#                                         # 16k x2 under the profiler; the prefill profile
#   bash bench/gpu_decode.sh kvsplit REV  # --decode-kv-split A/B in ABBA order: 8B at batch 16
#                                         # and 64 (KVSPLIT_8B modes), 3B 48 streams (KVSPLIT_3B)
#   bash bench/gpu_decode.sh kernels REV  # the decode kernels' tests compiled on the GPU, then
#                                         # bench.wide_decode (engine level: tile sweep, graph
#                                         # step unfused vs fused at 2..64 rows)
#   bash bench/gpu_decode.sh wide REV     # --fused-decode-max-batch 1 vs 64 through HTTP: 3B
#                                         # 48 streams ABBA (WIDE_3B), 8B B=4,16,64 (WIDE_8B)
#   bash bench/gpu_decode.sh structured REV # structured outputs beside unconstrained streams
#                                         # (the GPU test, then the 3B at 16 / 48 streams with
#                                         # 8 / 16 constrained: this revision, then the old one
#                                         # when .old_rev/old.tar.gz is carried; ~3 min)
#   bash bench/gpu_decode.sh final REV    # one call for the record: this revision's 3B with 1, 2
#                                         # and 4 API servers (py-spy on 1), 8B B=1,16,64 with
#                                         # the prefill check, then the old revision's 3B
# Carry: .whl .fi_cache .cache/smollm2-tok (and .old_rev for `old`). Results: $OUT/*.json,
# fi_cache.tar.gz when the FlashInfer cache grew, server logs as one tarball.
set -u
part=${1:-sanity}; rev=${2:-unknown}; t0=$(date +%s)
# Pass REV as a literal from the machine that sends the tree (the copy's git metadata may be
# stale): result files record it as the revision.
export GREENLANE_REVISION=$rev
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu_setup.sh
export PATH=/tmp/site/bin:$PATH
new=$PWD
logs=/tmp/serverlogs; mkdir -p $logs
echo "setup done in $(( $(date +%s) - t0 )) s"

serve() {  # serve DIR MODEL PORT LOG [server args...]: start, wait for /health (420 s)
  local dir=$1 model=$2 port=$3 log=$4; shift 4
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir exec python3 -m app serve --model "$model" \
     --port "$port" --max-num-seqs 128 "$@" >"$log" 2>&1) &
  for _ in $(seq 1 420); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 $! 2>/dev/null || { echo "server exited:"; grep -v '^ ' "$log" | tail -12; cleanup; return 1; }
    if [ -z "${dumped:-}" ] && grep -q "waiting for the engine core" "$log"; then
      dumped=1  # a stuck start-up: what every Python process is doing
      for p in $(pgrep -f "python3"); do echo "== py-spy $p"; py-spy dump --pid $p 2>&1 | head -40; done
    fi
    sleep 1
  done
  echo "server did not come up:"; tail -30 "$log"; cleanup; return 1
}
cleanup() {  # whatever a failed or stopped server left (launcher, API servers, engine core)
  pkill -9 -f "app serve" 2>/dev/null; pkill -9 -f "multiprocessing.spawn" 2>/dev/null; sleep 2
}
stop() {  # stop PORT
  local pid; pid=$(python3 -c "import psutil,sys
for c in psutil.net_connections('tcp'):
    if c.laddr and c.laddr.port==$1 and c.status=='LISTEN' and c.pid: print(c.pid); break")
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 60); do curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 || break; sleep 1; done
  sleep 3; cleanup
}
decode() {  # decode TAG SHAPE BATCHES CONTEXT OUTPUT [extra]
  local tag=$1 shape=$2 batches=$3 ctx=$4 outn=$5; shift 5
  python3 -m bench.decode --url http://127.0.0.1:8100 --shape "$shape" --batches "$batches" \
    --context "$ctx" --output-tokens "$outn" --label "$tag" --out "$OUT/decode-$tag.json" "$@"
}

rc=0
case $part in
  sanity)
    python3 -m pytest -q tests/gpu -p no:cacheprovider --tb=short 2>&1 | tee $logs/pytest-gpu.txt \
      | grep -E "^(FAILED|ERROR|E )|passed|failed" | head -40
    serve "$new" random:llama-3.1-8b 8100 $logs/new-8b.log && {
      decode new-8b-sanity llama-3.1-8b 1,64 2048 96 --repeats 1 || rc=1; stop 8100; }
    ;;
  old)
    # First: this revision's single-API-server start-up on the GPU (it failed once), in debug.
    serve "$new" random:qwen2.5-3b 8101 $logs/diag.log --log-level debug && {
      curl -s http://127.0.0.1:8101/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": [1000, 2000, 3000], "max_tokens": 4}' | head -c 300; echo; stop 8101; }
    grep -E "waiting for the engine core|hello from|no answer" $logs/diag.log | head -8
    mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old
    serve /tmp/old random:llama-3.1-8b 8100 $logs/old-8b.log && {
      decode old-8b llama-3.1-8b 1,16,64 2048 160 || rc=1; stop 8100; }
    serve /tmp/old random:qwen2.5-3b 8100 $logs/old-3b.log && {
      decode old-3b qwen2.5-3b 48 512 256 || rc=1; stop 8100; }
    ;;
  new)
    python3 -m pytest -q tests/gpu/test_overlap_gpu.py -p no:cacheprovider --tb=short 2>&1 \
      | tee $logs/pytest-gpu.txt | grep -E "^(FAILED|ERROR|E )|passed|failed" | head -30
    serve "$new" random:llama-3.1-8b 8100 $logs/new-8b.log && {
      decode new-8b llama-3.1-8b 1,16,64 2048 160 --prefill-check 16384 || rc=1; stop 8100; }
    serve "$new" random:qwen2.5-3b 8100 $logs/new-3b.log && {
      decode new-3b qwen2.5-3b 48 512 256 --py-spy-s 6 || rc=1; stop 8100; }
    serve "$new" random:qwen2.5-3b 8100 $logs/new-3b-api2.log --api-server-count 2 && {
      decode new-3b-api2 qwen2.5-3b 48 512 256 || rc=1; stop 8100; }
    ;;
  fused)
    # Issue 12: RoPE + K/V write in one launch a layer (3 -> 1), A/B on one machine. Order
    # off, on for 3B and on, off for 8B, so that neither side always runs first. The 8B runs
    # also time the 16k-token cold scoring prompt (the fused kernel runs in prefill too; the
    # 2026-12-02 call did not check it).
    for f in false true; do
      serve "$new" random:qwen2.5-3b 8100 $logs/fused-$f-3b.log --fused-rope-kv-write $f && {
        decode fused-$f-3b qwen2.5-3b 48 512 256 || rc=1; stop 8100; }
    done
    for f in true false; do
      serve "$new" random:llama-3.1-8b 8100 $logs/fused-$f-8b.log --fused-rope-kv-write $f && {
        decode fused-$f-8b llama-3.1-8b 1,16,64 2048 160 --prefill-check 16384 || rc=1
        stop 8100; }
    done
    ;;
  splits)
    # The fused decode's per-row KV splits with the merge in the kernel (eeedd80) against the
    # fixed split (.old_rev/old.tar.gz, 858fcf2) on the 8B at even 2k contexts, where every
    # row needs one split: new / old / old / new, batches 16 and 64 (~6 min). Then, in what
    # time is left, the rest of tests/gpu at this revision.
    mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old
    for side in new-a old-a old-b new-b; do
      dir=$new; [ "${side%-*}" = old ] && dir=/tmp/old
      serve "$dir" random:llama-3.1-8b 8100 $logs/splits-$side.log && {
        decode splits-$side llama-3.1-8b 16,64 2048 160 || rc=1; stop 8100; }
    done
    timeout "$(( ${DEADLINE_S:-600} - $(date +%s) + t0 - 10 ))" python3 -m pytest -q tests/gpu \
      -p no:cacheprovider --tb=short 2>&1 | tee $OUT/pytest-gpu.txt \
      | grep -E "^(FAILED|ERROR|E )|passed|failed" | head -30
    ;;
  prefill)
    # The 16k-token cold scoring prompt through HTTP (8B), new / old / old / new: nothing but
    # the prefill check, three cold readings a server (it read 0.541-0.551 s at ddd65ed against
    # 0.511-0.528 s earlier; this says whether the code or the machine moved).
    mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old
    for side in new-a old-a old-b new-b; do
      dir=$new; [ "${side%-*}" = old ] && dir=/tmp/old
      serve "$dir" random:llama-3.1-8b 8100 $logs/prefill-$side.log && {
        decode prefill-$side llama-3.1-8b "" 2048 16 --prefill-check 16384 \
          --prefill-repeats 3 || rc=1
        stop 8100; }
    done
    ;;
  first)
    # Where a fresh server's first long prompt loses 40-80 ms (the 15th session: 0.53-0.57 s,
    # then 0.48-0.50 s, both revisions). Each reading carries the engine's steps for it (device
    # time vs the host's gap); a warm-up at start-up is the candidate fix; the profiled server
    # gives the host's ops and the kernels of the first and the second prompt.
    for side in cold:0 warm:16384; do
      serve "$new" random:llama-3.1-8b 8100 $logs/first-${side%:*}.log \
        --prefill-warm-up-tokens ${side#*:} && {
        grep -h "prefill warm-up" $logs/first-${side%:*}.log
        decode first-${side%:*} llama-3.1-8b "" 2048 16 --prefill-check 16384,32768 \
          --prefill-repeats 3 || rc=1
        stop 8100; }
    done
    serve "$new" random:llama-3.1-8b 8100 $logs/first-prof.log && {
      decode first-prof llama-3.1-8b "" 2048 16 --prefill-check 16384 --prefill-repeats 2 \
        --prefill-profile-steps 64 || rc=1
      stop 8100; }
    # Issue 17: the simulator's service profile at this revision.
    timeout 150 python3 -m bench.prefill_profile --model random:llama-3.1-8b --device cuda \
      --deadline-s 120 --rev "$rev" \
      --out "$OUT/prefill-profile-gpu-scheduling-$(date +%F)-$rev.json" || rc=1
    ;;
  kvsplit)
    # Decode attention in the graphs: FlashInfer's split + merge (always) against one chunk a
    # request (auto: from its tile budget on; never: everywhere). bench/attention_split.py
    # times the attention alone; this is the step through HTTP.
    i=0
    for m in ${KVSPLIT_8B-always auto auto always}; do
      i=$((i + 1))
      serve "$new" random:llama-3.1-8b 8100 $logs/kv-$m-$i-8b.log --decode-kv-split $m && {
        decode kv-$m-$i-8b llama-3.1-8b ${KVSPLIT_8B_BATCHES:-16,64} 2048 160 --repeats 1 || rc=1
        stop 8100; }
    done
    for m in ${KVSPLIT_3B-}; do
      i=$((i + 1))
      serve "$new" random:qwen2.5-3b 8100 $logs/kv-$m-$i-3b.log --decode-kv-split $m && {
        decode kv-$m-$i-3b qwen2.5-3b 48 512 256 --repeats 1 || rc=1; stop 8100; }
    done
    ;;
  kernels)
    python3 -m pytest -q tests/test_decode_kernels.py -p no:cacheprovider --tb=short 2>&1 \
      | tee $logs/pytest-kernels.txt | grep -E "^(FAILED|ERROR|E )|passed|failed" | head -40
    python3 -m bench.wide_decode --out "$OUT/wide-decode.json" ${WIDE_ARGS:-} 2>&1 \
      | tee $logs/wide-decode.txt | grep -vE "^\s" | tail -60 || rc=1
    ;;
  wide)
    # The fused decode up to 64 rows (tensor-core kernels) against the default (fused at batch
    # 1 only), a fresh server per side, alternated.
    i=0
    for m in ${WIDE_3B-1 64 64 1}; do
      i=$((i + 1))
      serve "$new" random:qwen2.5-3b 8100 $logs/wide-$m-$i-3b.log --fused-decode-max-batch $m && {
        decode wide-$m-$i-3b qwen2.5-3b 48 512 256 --repeats 1 || rc=1; stop 8100; }
    done
    for m in ${WIDE_8B-64 1}; do
      i=$((i + 1))
      serve "$new" random:llama-3.1-8b 8100 $logs/wide-$m-$i-8b.log --fused-decode-max-batch $m && {
        decode wide-$m-$i-8b llama-3.1-8b ${WIDE_8B_BATCHES:-4,16,64} 2048 160 --repeats 1 || rc=1
        stop 8100; }
    done
    ;;
  structured)
    # Since 5554ebd a constrained request is planned with its last sample in flight and the
    # runner waits for that token (before: it sat out every other step beside others). The
    # client is this tree's bench.decode for both servers; the old tree is e.g. dc82b8c
    # (`mkdir -p .old_rev && git archive --format=tar.gz -o .old_rev/old.tar.gz dc82b8c`).
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_structured_gpu.py \
      2>&1 | tail -3
    trees="new:$new"
    if [ -f .old_rev/old.tar.gz ]; then
      mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old && trees="$trees old:/tmp/old"
    fi
    for t in $trees; do
      name=${t%%:*}; tree=${t#*:}
      serve "$tree" random:qwen2.5-3b 8100 $logs/structured-$name-3b.log && {
        decode structured-$name-3b-16 qwen2.5-3b 16 512 256 --constrained-streams 8 || rc=1
        decode structured-$name-3b-48 qwen2.5-3b 48 512 256 --constrained-streams 16 || rc=1
        stop 8100; }
    done
    ;;
  final)
    serve "$new" random:qwen2.5-3b 8100 $logs/new-3b.log && {
      decode new-3b qwen2.5-3b 48 512 256 --py-spy-s 6 || rc=1; stop 8100; }
    for n in ${API_COUNTS:-2 4}; do
      serve "$new" random:qwen2.5-3b 8100 $logs/new-3b-api$n.log --api-server-count $n && {
        decode new-3b-api$n qwen2.5-3b 48 512 256 || rc=1; stop 8100; }
    done
    serve "$new" random:llama-3.1-8b 8100 $logs/new-8b.log && {
      decode new-8b llama-3.1-8b 1,16,64 2048 160 --prefill-check 16384 || rc=1; stop 8100; }
    mkdir -p /tmp/old && tar xzf .old_rev/old.tar.gz -C /tmp/old
    serve /tmp/old random:qwen2.5-3b 8100 $logs/old-3b.log && {
      decode old-3b qwen2.5-3b 48 512 256 || rc=1; stop 8100; }
    ;;
esac
# What comes back: results, the JIT cache if it grew, logs and profiles in one tarball.
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
if [ "$after" -gt "$fi_modules_before" ]; then
  tar czf "$OUT/fi_cache.tar.gz" -C ~/.cache flashinfer && echo "fi cache: $after modules"
fi
cp "$OUT"/pyspy-* $logs/ 2>/dev/null; rm -f "$OUT"/pyspy-*
tar czf "$OUT/logs-$part.tar.gz" -C /tmp serverlogs
echo "done in $(( $(date +%s) - t0 )) s, rc=$rc"
exit $rc
