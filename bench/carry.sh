#!/usr/bin/env bash
# Here (network, no GPU): the git-ignored folders the device calls carry, made again on a new
# checkout (the developer machine's checkout loses them between sessions). One command instead
# of the steps in bench/README.md "Preparing the carried folders"; each part is skipped when
# its folder is already complete, so a second run is fast.
#
#   bash bench/carry.sh          # .venv + default model, .whl, .cache/smollm2-tok
#   bash bench/carry.sh peer     # the same, then vLLM's pieces (.peer_whp, ~6 min of xz)
#
# .fi_cache/fi_cache.tar.gz cannot be made here (it is compiled on the GPU): the first device
# run without it compiles FlashInfer's kernels and sends the tarball back through $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}

make setup model

# Python 3.12 wheels the device image lacks: FlashInfer and the server's packages (msgspec and
# pyzmq carry the engine core's IPC), py-spy for profiles. One version of each.
if ! ls .whl/flashinfer_python-0.5.3-*.whl .whl/pyzmq-*.whl .whl/msgspec-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 \
    fastapi starlette uvicorn sse-starlette pydantic pydantic-core pydantic-settings python-dotenv \
    annotated-types typing-inspection opentelemetry-api prometheus-client msgspec pyzmq httptools \
    uvloop py-spy
fi
# Structured outputs' grammar library (abi3, glibc 2.31): its own download, as .whl folders made
# before it was a dependency lack it.
if ! ls .whl/llguidance-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1
fi

# The default model's tokenizer and config files (not its 540 MB of weights): the device runs
# random:<preset> models with this tokenizer.
tok=.cache/smollm2-tok
src=.cache/models/SmolLM2-135M-Instruct
mkdir -p "$tok"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$tok/$f" ] || cp "$src/$f" "$tok/"
done

if [ "$what" = peer ]; then
  grep -q '^/.peer_whp/' .git/info/exclude 2>/dev/null || echo /.peer_whp/ >>.git/info/exclude
  if [ ! -f .peer_whp/a/sha256 ]; then
    bash bench/peer/prepare.sh
    # prepare.sh rewrites the committed manifest with this run's resolver output (the same
    # set): keep the committed one unless the set changed on purpose.
    git checkout -- bench/peer/manifest.json 2>/dev/null || true
  fi
fi

du -sh .whl "$tok" ${what:+.peer_whp} 2>/dev/null || true
[ -f .fi_cache/fi_cache.tar.gz ] || echo "no .fi_cache/fi_cache.tar.gz: the first device run compiles FlashInfer (~100-170 s) and sends it back"
