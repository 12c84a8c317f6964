#!/usr/bin/env bash
# Device side of issue 18: Greenlane and vLLM 0.24.0 side by side on one H200, the same
# random weights, the same workloads and seeds, runs alternating between the two servers.
# One mode a device call, back to back (the machine goes back 30 s after a call; /tmp, the
# servers started here with setsid and ~/.cache stay while it is held). bench/peer/README.md
# lists the calls with their carry lists and times.
#
#   bash bench/peer/run.sh stash              # each piece's call: .peer_whp/X -> /tmp/peer_whp
#   bash bench/peer/run.sh setup REV          # join + unpack vLLM, install Greenlane, export the
#                                             # 8B folder, start both servers, same answers
#   bash bench/peer/run.sh scoring REV        # (a) post-recommendation, max QPS at the P99 SLO
#   bash bench/peer/run.sh chat REV [8b|3b]   # (b) 48 chat streams: tokens/s, ITL
#   bash bench/peer/run.sh long REV [MNBT..]  # (c) long prompts next to chat; vLLM at its default
#                                             # chunked prefill, then each --max-num-batched-tokens
#   bash bench/peer/run.sh longest REV        # (d) longest scoring prompt under the same cap
#   bash bench/peer/run.sh gputest REV [FILES] # GPU tests (before the servers start)
#   bash bench/peer/run.sh profile REV [8b|3b] # the torch profiler over N steps of each server
#                                             # under the 48-stream chat load (diagnostic)
#   bash bench/peer/run.sh options REV 8b|3b|long "OPTS" ["OPTS"...]
#                                             # (b) Greenlane only, restarted with each option
#                                             # set in turn (A/B against an earlier call's vLLM)
#
# Results: $OUT/peer-<mode>-<stamp>.json (every run's bench.serve record, each with a "peer"
# entry: command, Greenlane revision, vLLM version, device, date, server command lines) and the
# server logs as one tarball. Settings: the PEER_* variables below. REV is the Greenlane commit
# the lead runs from.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/wheel_pieces.sh
mode=${1:-}; rev=${2:-unknown}; shift 2 2>/dev/null || shift $#
sub=""
t0=$(date +%s); deadline=${DEADLINE_S:-570}
left() { echo $(( deadline - ($(date +%s) - t0) )); }
export OUT=${OUT:-/tmp/peer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
W=/tmp/peer                      # work folder on the device: models, logs, state
VSITE=/tmp/vllm-site             # vLLM and its packages (PYTHONPATH of the vLLM server only)
GL_PORT=8100; VL_PORT=8200
GL=http://127.0.0.1:$GL_PORT; VL=http://127.0.0.1:$VL_PORT
SEED=${PEER_SEED:-0}
PROF_STEPS=${PEER_PROFILE_STEPS:-200}        # `profile`: steps under the profiler, each server
VPROF=$W/vprof                               # vLLM's torch_profiler_dir
VPROF_CFG="{\"profiler\":\"torch\",\"torch_profiler_dir\":\"$VPROF\",\"torch_profiler_with_stack\":false,\"ignore_frontend\":true,\"max_iterations\":$PROF_STEPS}"
MAX_LEN=${PEER_MAX_MODEL_LEN:-32768}         # both servers: prompt + output limit
MEM_GB=${PEER_MEM_GB:-64}                    # both servers' GPU memory cap (both run at once)
CAP_GB=${PEER_CAP_GB:-24}                    # (d): the cap of the README's 8B figure
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RES=$W/res/$STAMP                # this call's results (collect sends them)
mkdir -p "$W/logs" "$RES"

gl_env() {  # Greenlane's packages (bench/gpu_setup.sh installed them into /tmp/site)
  export PYTHONPATH=/tmp/site:$PWD
  if [ -d /tmp/glcache ]; then export GREENLANE_CACHE_DIR=/tmp/glcache; fi
  return 0
}
healthy() { curl -sf -m 3 "$1/health" >/dev/null; }
wait_up() {  # URL NAME LOG TIMEOUT_S START_EPOCH PIDFILE
  local end=$(( $(date +%s) + $4 ))
  while [ "$(date +%s)" -lt "$end" ]; do
    if healthy "$1"; then echo "$2 up after $(( $(date +%s) - $5 )) s"; return 0; fi
    if ! kill -0 "$(cat "$6")" 2>/dev/null; then
      echo "$2 exited during start-up; log tail:"; tail -c 3000 "$3"; return 1
    fi
    sleep 2
  done
  echo "$2 NOT up after $4 s; log tail:"; tail -c 3000 "$3"; return 1
}
stop_one() {  # greenlane|vllm (its process group: vLLM's engine-core children too)
  local f="$W/$1.pid" url=$GL
  [ "$1" = vllm ] && url=$VL
  if [ -f "$f" ]; then
    kill -TERM -- "-$(cat "$f")" 2>/dev/null || kill "$(cat "$f")" 2>/dev/null
    rm -f "$f"
  fi
  rm -f "$W/$1.cfg"
  for _ in $(seq 40); do healthy "$url" || return 0; sleep 1; done
  echo "$1 still answering after 40 s"
}
stop_servers() { stop_one vllm; stop_one greenlane; }
# start_greenlane MODEL "ARGS" / start_vllm FOLDER "ARGS": started with setsid, so they run on
# into the next calls while the machine is held; a call asking for the configuration already
# running (and healthy) reuses it. Greenlane first: vLLM sizes its KV cache at start-up.
start_greenlane() {
  local model=$1 args=$2 cfg="$1|$2" ts log
  if [ "$(cat "$W/greenlane.cfg" 2>/dev/null)" = "$cfg" ] && healthy $GL; then
    echo "greenlane already up ($cfg)"; return 0
  fi
  stop_one greenlane
  # The old process may hold the port a moment after /health stops answering.
  for _ in $(seq 30); do
    python3 -c "import socket,sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))" \
      "$GL_PORT" 2>/dev/null && break
    sleep 1
  done
  ts=$(date +%s); log="$W/logs/greenlane-$ts.log"
  gl_env
  echo "python3 -m app serve --model $model --port $GL_PORT --seed $SEED $args" | tee "$log"
  # shellcheck disable=SC2086
  setsid python3 -m app serve --model "$model" --port $GL_PORT --seed "$SEED" $args \
    >>"$log" 2>&1 </dev/null & echo $! >"$W/greenlane.pid"
  wait_up $GL greenlane "$log" 300 "$ts" "$W/greenlane.pid" || return 1
  echo "$cfg" >"$W/greenlane.cfg"
  # Start-up time and the attention warm-up's line (FlashInfer compiling there, not in a run)
  # go into every result's "peer" entry (record_meta).
  echo "$(( $(date +%s) - ts ))" >"$W/greenlane_up_s.cfg"
  grep -h "attention kernels ready\|attention warm-up failed" "$log" | tail -1 >"$W/greenlane_warmup.cfg" || true
}
start_vllm() {
  local folder=$1 args=$2 cfg="$1|$2" ts log
  if [ "$(cat "$W/vllm.cfg" 2>/dev/null)" = "$cfg" ] && healthy $VL; then
    echo "vllm already up ($cfg)"; return 0
  fi
  stop_one vllm
  ts=$(date +%s); log="$W/logs/vllm-$ts.log"
  # Its own site folder only on the path (Greenlane's newer FastAPI and FlashInfer stay out);
  # dev mode for /reset_prefix_cache; FlashInfer is not carried, so its sampler is off (it only
  # serves top-p/top-k sampling: greedy and plain sampling run the same code either way).
  echo "python3 -m vllm.entrypoints.openai.api_server --model $folder --served-model-name peer --port $VL_PORT --seed $SEED --enable-prefix-caching --return-tokens-as-token-ids $args" | tee "$log"
  # Its torch profiler configured, idle until POST /start_profile (`profile`): it stops itself
  # after PROF_STEPS steps and writes the trace to $VPROF. Always given, so every mode runs the
  # same server (a profile needs no restart).
  mkdir -p "$VPROF"
  # shellcheck disable=SC2086
  env PYTHONPATH=$VSITE VLLM_SERVER_DEV_MODE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
    setsid python3 -m vllm.entrypoints.openai.api_server --model "$folder" \
    --served-model-name peer --port $VL_PORT --seed "$SEED" --enable-prefix-caching \
    --return-tokens-as-token-ids --profiler-config "$VPROF_CFG" $args >>"$log" 2>&1 </dev/null &
  echo $! >"$W/vllm.pid"
  wait_up $VL vllm "$log" 420 "$ts" "$W/vllm.pid" || return 1
  echo "$cfg" >"$W/vllm.cfg"
  grep -hiE "KV cache|max_num_batched_tokens|chunked prefill|Maximum concurrency|backend|graph" \
    "$log" | tail -12
}
mem_frac() {  # GB -> vLLM's --gpu-memory-utilization (a fraction of the whole GPU)
  python3 -c "import torch,sys; print(round(float(sys.argv[1])*2**30/torch.cuda.mem_get_info()[1], 4))" "$1"
}
folder_of() { echo "$W/models/$1"; }
# start_servers PRESET ["VLLM_EXTRA"]: both on the exported folder of the preset at the shared
# memory cap: the same weights and the same (padded) tokenizer, so both sample among the same
# ids (bench/peer/export_hf.py says why the tokenizer is padded). PEER_GL_ARGS: more Greenlane
# options (e.g. "--merge-mixed-steps true"; Greenlane restarts when they change).
start_servers() {
  local preset=$1 extra=${2:-} frac
  frac=$(mem_frac "$MEM_GB")
  start_greenlane "$(folder_of "$preset")" \
    "--max-gpu-memory-gb $MEM_GB --max-model-len $MAX_LEN${PEER_GL_ARGS:+ $PEER_GL_ARGS}" || return 1
  start_vllm "$(folder_of "$preset")" \
    "--gpu-memory-utilization $frac --max-model-len $MAX_LEN $extra"
}
export_model() {  # PRESET: the HF folder of random:PRESET, written here (CUDA, bf16, SEED)
  local f; f=$(folder_of "$1")
  [ -f "$f/greenlane_export.json" ] && return 0
  gl_env
  python3 -m bench.peer.export_hf --preset "$1" --out "$f" --device cuda --seed "$SEED"
}
record_meta() {  # JSON MODE REV COMMAND: add the "peer" entry (revisions, device, date)
  python3 - "$@" <<'PYEOF'
import datetime, json, os, subprocess, sys
path, mode, rev, cmd = sys.argv[1:5]
def sh(c):
    try:
        return subprocess.run(c, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"
def cfg(name):
    p = f"/tmp/peer/{name}.cfg"
    return open(p).read().strip() if os.path.exists(p) else None
meta = {
    "mode": mode, "command": cmd, "greenlane_revision": rev,
    "vllm_version": sh("cd /tmp && PYTHONPATH=/tmp/vllm-site python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1"),
    "device": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
    "torch": sh("python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'"),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "greenlane_server": cfg("greenlane"), "vllm_server": cfg("vllm"),
    "greenlane_up_s": cfg("greenlane_up_s"), "greenlane_warmup": cfg("greenlane_warmup"),
}
try:
    doc = json.load(open(path))
except (OSError, ValueError):
    doc = {}
doc["peer"] = meta
json.dump(doc, open(path, "w"), indent=1)
PYEOF
}
collect() {  # $OUT takes at most 8 files: this call's results in one JSON, the logs in a tarball
  python3 - "$RES" "$OUT/peer-$mode${sub:+-$sub}-$STAMP.json" "$mode" "$rev" <<'PYEOF'
import json, pathlib, sys
res, out, mode, rev = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runs = {p.stem: json.loads(p.read_text()) for p in sorted(res.glob("*.json"))}
json.dump({"mode": mode, "greenlane_revision": rev, "runs": runs}, open(out, "w"), indent=1)
print(f"{out}: {len(runs)} results")
PYEOF
  tar czf "$OUT/peer-logs-$mode${sub:+-$sub}.tar.gz" -C "$W" logs 2>/dev/null || true
  # FlashInfer's kernels compiled on this machine (a bare one JIT-compiles ~170 s): back once
  # the cache grew, for .fi_cache/ here.
  local n; n=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
  if [ "$n" -gt "$(cat "$W/fi_count" 2>/dev/null || echo 0)" ]; then
    tar czf "$OUT/fi_cache.tar.gz" -C ~/.cache flashinfer && echo "$n" >"$W/fi_count"
  fi
}
# bench SIDE NAME ARGS...: bench.serve against one server -> $RES/NAME-SIDE.json, then
# collect (so a call stopped at its limit still brings back every run that finished).
bench() {
  local side=$1 name=$2; shift 2
  local url=$GL
  [[ $side == vllm* ]] && url=$VL
  gl_env
  local out="$RES/$name-$side.json"
  python3 -m bench.serve --url "$url" --server "$side" --seed "$SEED" --no-progress \
    --tokenizer "$(folder_of "${PEER_PRESET:-llama-3.1-8b}")" --out "$out" "$@" 2>&1 | tail -n 6
  # Greenlane's own account of the run: its last 4,096 steps by kind (decode-only, mixed,
  # prefill), device time and host gap each (where its time per output token goes).
  [ "$side" = greenlane ] && python3 - "$out" "$url" <<'PYEOF'
import json, sys
from bench.gpu_serving import step_gaps
path, url = sys.argv[1:3]
try:
    doc = json.load(open(path))
except (OSError, ValueError):
    sys.exit(0)
doc["greenlane_steps"] = step_gaps(url)
json.dump(doc, open(path, "w"), indent=1)
kinds = doc["greenlane_steps"].get("by_kind", {})
print("steps:", {k: (v["num_steps"], v["device_ms_mean"], v["waited_ms_mean"]) for k, v in kinds.items()},
      "over N tokens:", doc["greenlane_steps"].get("num_steps_over_tokens"))
PYEOF
  record_meta "$out" "$mode" "$rev" "python3 -m bench.serve --url $url --server $side --seed $SEED $*"
  collect
}
# alternate NAME ROUNDS RUN_S ARGS...: greenlane, vllm, then vllm, greenlane (ABBA), ...; a
# run starts only while RUN_S (its expected length) + 25 s are left before the deadline.
# PEER_FIRST_ROUND=2 PEER_ROUNDS=2 runs round 2 alone (a mode too long for one call).
# PEER_VLLM_SIDE: bench.serve's --server for vLLM (vllm: scoring through /generative_scoring;
# vllm-completions: scoring as one-token completions with logprobs, its other way).
# PEER_SIDES=greenlane: Greenlane's runs only (an A/B of its own options against the vLLM
# runs of an earlier call of the same session: half the time).
VSIDE=${PEER_VLLM_SIDE:-vllm}
# (c)'s load: 60 % sharegpt + 40 % long-data (1k-16k-token prompts) at a fixed QPS, 40 s.
LONG_ARGS=(--workload mixed --duration 40 --qps "${PEER_LONG_QPS:-3}" --warmup-requests 2
           --request-timeout 120)
CHAT_ARGS=(--workload sharegpt --num-requests 480 --qps inf --max-concurrency 48
           --warmup-requests 4 --request-timeout 120)
alternate() {
  local name=$1 rounds=$2 run_s=$3 r side order; shift 3
  for r in $(seq "${PEER_FIRST_ROUND:-1}" "$rounds"); do
    order="greenlane $VSIDE"; [ $((r % 2)) = 0 ] && order="$VSIDE greenlane"
    [ "${PEER_SIDES:-both}" = greenlane ] && order=greenlane
    for side in $order; do
      if [ "$(left)" -le $((run_s + 25)) ]; then
        echo "deadline: $name round $r $side skipped"; return 0
      fi
      echo "== $name round $r: $side ($(left) s left)"
      bench "$side" "$name-r$r" "$@"
    done
  done
}

# vLLM's site folder from the stashed pieces (join, sha256, unpack: pip's --no-deps --target
# layout, made by prepare.sh), once a machine.
ensure_vllm() {
  [ -f "$VSITE/.complete" ] && return 0
  wp_join /tmp/peer_whp /tmp/vllm-site.tar.xz || return 1
  rm -rf "$VSITE" /tmp/site-unpack && mkdir -p /tmp/site-unpack
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
    /tmp/vllm-site.tar.xz /tmp/site-unpack || return 1
  mv /tmp/site-unpack/site "$VSITE" && touch "$VSITE/.complete" && rm -f /tmp/vllm-site.tar.xz
  echo "vLLM site ready ($(du -sh $VSITE | cut -f1)), $(left) s left"
}
# Greenlane's packages, FlashInfer's kernels and the tokenizer (the carried .whl .fi_cache
# .cache/smollm2-tok), once a machine: a mode called on a machine that lost its set-up (it
# went back between calls) installs them itself when its call carries the folders.
ensure_greenlane() {
  [ -f /tmp/site/.greenlane-ready ] && [ -d /tmp/glcache ] && return 0
  [ -d .whl ] || { echo "Greenlane not installed here: carry .whl .fi_cache .cache/smollm2-tok"; return 1; }
  source bench/gpu_setup.sh || return 1
  touch /tmp/site/.greenlane-ready
}
# Every mode but stash: what it needs on this machine, made when missing (after a machine went
# back: the stash calls, then the mode's call carrying Greenlane's folders).
case $mode in
  setup|gputest|scoring|chat|long|longest|profile|options) ensure_greenlane || exit 1 ;;
esac
case $mode in
  setup|scoring|chat|long|profile) ensure_vllm || exit 1 ;;
  longest) [ "${PEER_SIDES:-both}" = greenlane ] || ensure_vllm || exit 1 ;;
esac

case $mode in
stash)
  wp_stash .peer_whp /tmp/peer_whp ;;
setup)
  # 1. vLLM (unpacked above): check its imports and FastAPI app on this machine.
  (cd /tmp && PYTHONPATH=$VSITE VLLM_SERVER_DEV_MODE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
     python3 "$OLDPWD/bench/peer/check_vllm.py" --json "$OUT/peer-check-vllm.json") || exit 1
  # 2. Greenlane: installed above (ensure_greenlane).
  # 3. The 8B folder (16 GB, bf16, written from the GPU), then both servers on it.
  export_model llama-3.1-8b || exit 1
  echo "exported, $(left) s left"
  start_servers llama-3.1-8b || { collect; exit 1; }
  # 4. Same weights, same answers (exit 1 on a mismatch: then no benchmark means anything).
  gl_env
  python3 -m bench.peer.same_answers --greenlane $GL --vllm $VL \
    --tokenizer "$(folder_of llama-3.1-8b)" --out "$RES/same-answers.json"
  rc=$?
  record_meta "$RES/same-answers.json" setup "$rev" "python3 -m bench.peer.same_answers"
  collect; exit $rc ;;
scoring)
  # (a) post-recommendation at full scale through each server's scoring path (Greenlane
  # /v1/score, vLLM /generative_scoring: query + item token ids, Yes/No label ids), prefix
  # caching on in both, primed (one request per user first), max QPS at P99 latency <= 3 s by
  # bisection over 14-s probes (issue 17's setting), two rounds, ABBA. On 2026-12-02 a start
  # at 6 QPS with x1.5 steps never reached either server's limit in 4 probes, and 30 QPS with
  # x2 steps and 5 probes bracketed them in [120, 180) and [60, 75): 6 probes from 30 narrow
  # that; a side takes ~200 s, so one round a call (PEER_ROUNDS=1, then PEER_FIRST_ROUND=2).
  start_servers llama-3.1-8b || { collect; exit 1; }
  alternate scoring "${PEER_ROUNDS:-2}" 200 --workload post-recommendation --duration 14 \
    --qps "${PEER_SCORE_QPS:-30}" --find-max-qps --slo e2el:3000 --max-probes "${PEER_SCORE_PROBES:-6}" \
    --search-factor "${PEER_SCORE_FACTOR:-2}" --prime-prefixes --warmup-requests 2 --request-timeout 60
  collect ;;
chat)
  # (b) 48 chat streams: sharegpt-like requests, 48 in flight (closed loop), ignore_eos;
  # output tokens/s and the gaps between tokens. 8B, then 3B in its own call.
  sub=${1:-8b}; preset=llama-3.1-8b
  [ "$sub" = 3b ] && preset=qwen2.5-3b
  export_model "$preset" || exit 1
  start_servers "$preset" || { collect; exit 1; }
  # 480 requests: ~25 s a run on the 8B (240 took 11-12.5 s on 2026-12-02).
  PEER_PRESET=$preset alternate "chat-$sub" "${PEER_ROUNDS:-2}" 60 "${CHAT_ARGS[@]}"
  collect ;;
long)
  # (c) long prompts next to chat: mixed (60% sharegpt + 40% long-data, 1k-16k-token prompts)
  # at a fixed QPS; P99 TTFT and time between tokens. Both at their defaults first (vLLM's
  # chunked prefill at its default budget), then vLLM restarted at each
  # --max-num-batched-tokens of the sweep (about a minute each: its compile cache is warm)
  # against the same Greenlane, which stays up.
  sweep=("$@"); [ ${#sweep[@]} -gt 0 ] || sweep=(2048 4096 16384)
  args=("${LONG_ARGS[@]}")
  # PEER_LONG_DEFAULT=0: the sweep alone (its defaults ran in an earlier call of the session;
  # no restart of vLLM at its default on the way).
  if [ "${PEER_LONG_DEFAULT:-1}" != 0 ]; then
    start_servers llama-3.1-8b || { collect; exit 1; }
    alternate long-default 1 80 "${args[@]}"
  fi
  for m in "${sweep[@]}"; do
    [ "$(left)" -gt 190 ] || { echo "deadline: the sweep stops before $m"; break; }
    start_servers llama-3.1-8b "--max-num-batched-tokens $m" || break
    bench vllm "long-mnbt$m" "${args[@]}"
  done
  collect ;;
gputest)
  # GPU tests of options about to be A/B'd, run before the servers hold the memory (carry .whl
  # .fi_cache .cache/smollm2-tok, as for setup). Args: test files (default: the prefill graphs,
  # merged steps on FA2 among them). Result: $RES/gputest.json (exit code, tail).
  tests=("$@")
  [ ${#tests[@]} -gt 0 ] || tests=(tests/gpu/test_prefill_graphs_gpu.py)
  gl_env  # a second gputest on the machine skips the install, not the environment
  python3 -m pytest -q -m "gpu or kernels" -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$W/gputest.log"
  rc=${PIPESTATUS[0]}
  python3 - "$W/gputest.log" "$RES/gputest.json" "$rc" "${tests[*]}" <<'PYEOF'
import json, sys
log, out, rc, tests = sys.argv[1:5]
json.dump({"tests": tests.split(), "exit_code": int(rc), "tail": open(log).read()[-4000:]},
          open(out, "w"), indent=1)
PYEOF
  record_meta "$RES/gputest.json" gputest "$rev" "python3 -m pytest -q -m 'gpu or kernels' ${tests[*]}"
  collect; exit "$rc" ;;
profile)
  # Where each server's step time goes under the 48-stream chat load: one chat run a server
  # (the same requests as `chat`), and while it runs the torch profiler over PROF_STEPS steps
  # (Greenlane: POST /admin/api/profile; vLLM: POST /start_profile). Both traces are read by
  # the same code (bench/peer/profile_steps.py). Diagnostic: the profiler slows both.
  sub=${1:-8b}; preset=llama-3.1-8b
  [ "$sub" = 3b ] && preset=qwen2.5-3b
  export_model "$preset" || exit 1
  start_servers "$preset" || { collect; exit 1; }
  gl_env
  for side in greenlane vllm; do
    url=$GL; [ "$side" = vllm ] && url=$VL
    [ "$(left)" -gt 120 ] || { echo "deadline: profile of $side skipped"; break; }
    PEER_PRESET=$preset bench "$side" "profiled-chat-$sub" "${CHAT_ARGS[@]}" &
    bpid=$!
    sleep "${PEER_PROFILE_AFTER_S:-10}"  # past the first prefills: the streams decode
    python3 -m bench.peer.profile_steps --server "$side" --url "$url" --steps "$PROF_STEPS" \
      --trace-dir "$VPROF" --out "$RES/profile-$sub-$side.json"
    wait "$bpid"
    record_meta "$RES/profile-$sub-$side.json" profile "$rev" "python3 -m bench.peer.profile_steps --server $side --steps $PROF_STEPS"
    collect
  done
  collect ;;
options)
  # Greenlane's own options A/B'd in one call: for each option set (one argument each, e.g.
  # "--merge-mixed-steps false"), Greenlane restarts with it and runs the `chat` load twice
  # (8b, 3b) or the `long` load once (long: the 8B, e.g. "--prefill-token-budget 2048");
  # vLLM stays up untouched (its runs come from a `chat` or `long` call of the same session).
  # One call instead of one per option: every turn-around between calls risks the machine
  # going back (30 s idle) with both servers and /tmp. A set that would overrun the deadline
  # is skipped.
  sub=${1:-8b}; shift 2>/dev/null; preset=llama-3.1-8b
  [ "$sub" = 3b ] && preset=qwen2.5-3b
  load=("${CHAT_ARGS[@]}"); rounds=${PEER_ROUNDS:-2}; run_s=60; name=chat-$sub
  [ "$sub" = long ] && { load=("${LONG_ARGS[@]}"); rounds=1; run_s=80; name=long; }
  export_model "$preset" || exit 1
  declare -A seen=()  # a set given twice gets its own run names (-2, -3): no result overwritten
  for opts in "$@"; do
    [ "$(left)" -gt $((run_s * rounds + 50)) ] || { echo "deadline: option set '$opts' skipped"; continue; }
    slug=$(echo "$opts" | tr -c 'a-zA-Z0-9\n' '-' | sed 's/^-*//; s/-*$//; s/--*/-/g')
    seen[_$slug]=$(( ${seen[_$slug]:-0} + 1 ))
    [ "${seen[_$slug]}" -gt 1 ] && slug="$slug-${seen[_$slug]}"
    start_greenlane "$(folder_of "$preset")" \
      "--max-gpu-memory-gb $MEM_GB --max-model-len $MAX_LEN${opts:+ $opts}" || continue
    PEER_SIDES=greenlane PEER_PRESET=$preset alternate "$name-$slug" "$rounds" "$run_s" "${load[@]}"
  done
  collect ;;
longest)
  # (d) the longest scoring prompt each server takes under the same GPU memory cap (24 GB, the
  # README's 8B figure), one server at a time, bisection by requests (bench/peer/longest_prompt.py).
  stop_servers
  big=${PEER_LONGEST_HI:-262144}
  export_model llama-3.1-8b || exit 1
  # PEER_GL_ARGS: more Greenlane options (e.g. "--prefill-token-budget 2048": the KV pool's
  # floor is one step's budget, so a smaller budget leaves scoring more of the cap).
  if start_greenlane "$(folder_of llama-3.1-8b)" \
      "--max-gpu-memory-gb $CAP_GB --max-model-len $big${PEER_GL_ARGS:+ $PEER_GL_ARGS}"; then
    gl_env
    # PEER_LONGEST_LO: a length known to fit (the search starts there: fewer long probes).
    python3 -m bench.peer.longest_prompt --url $GL --server greenlane --hi "$big" \
      --lo "${PEER_LONGEST_LO:-8192}" --out "$RES/longest-greenlane.json"
    record_meta "$RES/longest-greenlane.json" longest "$rev" "bench.peer.longest_prompt greenlane"
    collect
  fi
  stop_one greenlane
  # PEER_SIDES=greenlane: Greenlane's side alone (a fresh machine without vLLM's pieces).
  [ "${PEER_SIDES:-both}" = greenlane ] && { collect; exit 0; }
  # vLLM sizes its KV cache at start-up and refuses a --max-model-len it cannot hold, naming the
  # longest it could ("... estimated maximum model length is N"): start at the same length, and
  # on that refusal again at N.
  frac=$(mem_frac "$CAP_GB"); len=$big
  for attempt in 1 2; do
    if start_vllm "$(folder_of llama-3.1-8b)" "--gpu-memory-utilization $frac --max-model-len $len"; then
      gl_env
      python3 -m bench.peer.longest_prompt --url $VL --server vllm --hi "$len" \
        --out "$RES/longest-vllm.json"
      record_meta "$RES/longest-vllm.json" longest "$rev" "bench.peer.longest_prompt vllm"
      break
    fi
    n=$(cat "$W"/logs/vllm-*.log | grep -oE "estimated maximum model length is [0-9]+" \
        | grep -oE "[0-9]+$" | tail -1)
    stop_one vllm
    [ -n "$n" ] && [ "$attempt" = 1 ] || break
    len=$n; echo "vLLM: again at --max-model-len $len"
  done
  stop_servers
  collect ;;
*) echo "usage: $0 stash|setup|gputest|scoring|chat|long|longest|profile|options REV [args]"; exit 2 ;;
esac
