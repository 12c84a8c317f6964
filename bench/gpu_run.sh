#!/usr/bin/env bash
# Device-machine wrapper for bench/gpu_suite.py: install the carried wheels, restore the
# FlashInfer JIT cache, run the suite, and send the (possibly grown) JIT cache back via $OUT.
# Usage (on the device machine, from the repo root): bash bench/gpu_run.sh <suite args...>
# Carry: .whl .fi_cache .cache/smollm2-tok (tokenizer/config files of SmolLM2 only).
set -u
source bench/gpu_setup.sh
before=$fi_modules_before
python3 -m bench.gpu_suite "$@"
rc=$?
after=$(find ~/.cache/flashinfer -name '*.so' 2>/dev/null | wc -l)
echo "flashinfer JIT modules: $before before, $after after"
if [ "${OUT:-}" != "" ] && [ "$after" != "$before" ]; then
  # Only compiled modules matter; sources and build trees are regenerated on demand.
  (cd ~/.cache && tar czf "$OUT/fi_cache.tar.gz" --exclude='*.o' --exclude='*.cu' \
     --exclude='*.ninja*' --exclude='*.lock' flashinfer) && ls -la "$OUT/fi_cache.tar.gz"
fi
exit $rc
