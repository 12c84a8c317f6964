# Sourced (not run) by bench/gpu_run.sh and bench/gpu_next.sh on the device machine, from the
# repo root: install the carried wheels, restore the FlashInfer kernel cache, serve the default
# model's tokenizer to random:<preset> models. Carry: .whl .fi_cache .cache/smollm2-tok.
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# Console scripts of the wheels (py-spy, when its wheel is in .whl: bench.decode's profiles
# need it, and a profile asked for fails loudly without it).
export PATH=/tmp/site/bin:$PATH
if [ -f .fi_cache/fi_cache.tar.gz ]; then
  mkdir -p ~/.cache && tar xzf .fi_cache/fi_cache.tar.gz -C ~/.cache
fi
# Triton's cache (the fused decode's kernels, ~90 s to compile on a bare machine) travels the
# same way since the thirty-second session; as xz since the fifty-second (7.2 MB gzip, 1.6 MB
# xz: a call carries at most 64 MiB, and the tracked tree and wheels take ~45 of them).
if [ -f .fi_cache/triton_cache.tar.xz ]; then
  mkdir -p ~/.triton && tar xJf .fi_cache/triton_cache.tar.xz -C ~/.triton
elif [ -f .fi_cache/triton_cache.tar.gz ]; then
  mkdir -p ~/.triton && tar xzf .fi_cache/triton_cache.tar.gz -C ~/.triton
fi
# The tarball holds only the compiled .so files. FlashInfer's JIT path always runs ninja,
# which rebuilds a module whose objects are missing (60-100 s each) or older than its
# sources, and the pip install above gives the sources new times: on a bare H200
# (twenty-ninth session) the plan after `warm` in the same call spent 184 s silent where a
# later one spent 9 s with the AOT modules (a rebuild, by every sign). Installing the
# compiled .so files, from the tarball or from an earlier plan of this call, as FlashInfer's
# "AOT" modules makes it load them directly; anything not there is still JIT-compiled into
# ~/.cache as before.
aot=/tmp/site/flashinfer/data/aot
for so in ~/.cache/flashinfer/*/*/cached_ops/*/*.so; do
  [ -f "$so" ] || continue
  name=$(basename "$(dirname "$so")")
  mkdir -p "$aot/$name" && cp "$so" "$aot/$name/$name.so"
done
# Random presets need only the default model's tokenizer/config: serve them from a cache
# folder whose model.safetensors is an empty placeholder (never loaded for random:<preset>).
if [ -d .cache/smollm2-tok ] && [ ! -f .cache/models/SmolLM2-135M-Instruct/model.safetensors ]; then
  export GREENLANE_CACHE_DIR=/tmp/glcache
  d=$GREENLANE_CACHE_DIR/models/SmolLM2-135M-Instruct
  mkdir -p "$d" && cp .cache/smollm2-tok/* "$d/" && touch "$d/model.safetensors"
fi
# (no cache yet on a bare machine: find fails, and under pipefail so would this line)
fi_modules_before=$( (find ~/.cache/flashinfer -name '*.so' 2>/dev/null || true) | wc -l)
triton_before=$( (find ~/.triton/cache -type f 2>/dev/null || true) | wc -l)
