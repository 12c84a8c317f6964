#!/usr/bin/env bash
# Device-machine wrapper for bench/gpu_suite.py: install the carried wheels, restore the
# FlashInfer JIT cache, run the suite, and send the (possibly grown) JIT cache back via $OUT.
# Usage (on the device machine, from the repo root): bash bench/gpu_run.sh <suite args...>
set -u
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
if [ -f .fi_cache/fi_cache.tar.gz ]; then
  mkdir -p ~/.cache && tar xzf .fi_cache/fi_cache.tar.gz -C ~/.cache
fi
before=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
python3 -m bench.gpu_suite "$@"
rc=$?
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
echo "flashinfer JIT modules: $before before, $after after"
if [ "${OUT:-}" != "" ] && [ "$after" != "$before" ]; then
  # Only compiled modules matter; sources and build trees are regenerated on demand.
  (cd ~/.cache && tar czf "$OUT/fi_cache.tar.gz" flashinfer) && ls -la "$OUT/fi_cache.tar.gz"
fi
exit $rc
