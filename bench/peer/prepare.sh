#!/usr/bin/env bash
# Here (network, no GPU): vLLM 0.24.0 and the few packages its OpenAI server needs that the
# device image lacks, staged as one site folder, xz-compressed, split into pieces for the
# device calls (bench/peer/README.md has the whole procedure).
#
#   bash bench/peer/prepare.sh            # .peer_whp/{a,b,...}/part (ignored) + bench/peer/manifest.json
#   bash bench/peer/prepare.sh standin    # a Python 3.12 stand-in for the device image (torch
#                                         # 2.11, transformers 5.17, ...) in $WORK/venv312
#   bash bench/peer/prepare.sh check      # vLLM's imports + app build against the staged site,
#                                         # under the stand-in (bench/peer/check_vllm.py --cpu)
#
# How the set was found (and how to redo it on a newer vLLM): pip's resolver, run for CPython
# 3.12 manylinux x86-64 with stand-ins for torch/torchaudio/torchvision (the image has 2.11.0 /
# 2.11.0 / 0.26.0, vLLM 0.24.0's pins), lists 178 packages; minus what the image has (KINDS.md's
# list) leaves ~120; of those, the ones below are what `check` shows the server, engine core,
# GPU worker, Llama/Qwen2 models, FLASH_ATTN backend, sampler and FastAPI app import (the rest
# are optional features: FlashInfer and its CuTe-DSL kernels, quantisation, MoE kernels,
# OpenTelemetry, MCP, Anthropic's API, Mistral's tokenizer, grammar back ends other than the
# two imported at start-up, multimodal hashing, torch.compile debugging). bench/peer/import_scan.py
# gives the static view of the same import graph.
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/wheel_pieces.sh
mode=${1:-prepare}
work=${WORK:-/tmp/gl-peer}
# 50 MiB pieces: a call carries its piece plus the working tree (7.6 MB on 2026-12-02), under
# the device's 64 MiB; 57 MiB pieces stopped fitting as the tree grew.
part_mb=${PART_MB:-50}; first_mb=${FIRST_MB:-50}
VLLM_VERSION=0.24.0
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for p in manylinux_2_{5,17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
pip=(.venv/bin/python -m pip)

case $mode in
prepare)
  rm -rf "$work" && mkdir -p "$work/local" "$work/wh"
  # Stand-ins for the image's torch, torchaudio, torchvision (vLLM pins exactly those
  # versions), so the resolver does not pull CUDA builds.
  for spec in torch:2.11.0 torchaudio:2.11.0 torchvision:0.26.0; do
    n=${spec%%:*}; v=${spec##*:}; d=$work/stub-$n
    mkdir -p "$d/$n" && touch "$d/$n/__init__.py"
    printf '[project]\nname = "%s"\nversion = "%s+stub"\n[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' "$n" "$v" >"$d/pyproject.toml"
    "${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$work/local" "$d"
  done
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$work/report.json" \
    --find-links "$work/local" "${plat[@]}" --target "$work/t" \
    "vllm==$VLLM_VERSION" torch==2.11.0+stub torchaudio==2.11.0+stub torchvision==0.26.0+stub
  # The selection (names, reasons) and its downloads; manifest.json says what was left out.
  .venv/bin/python bench/peer/select_packages.py "$work" bench/peer/manifest.json
  (cd "$work/wh" && while read -r u; do
     case $u in file://*) cp "${u#file://}" . ;; *) curl -sSfL --remote-name-all "$u" ;; esac
   done <"$work/urls.txt")
  # One site folder, as `pip install --no-deps --target` makes it on the device (the same
  # files: wheels are unpacked, nothing is built), less what no run imports: xgrammar's static
  # library (65 MB, for linking C++ against it), console scripts (shebangs of this machine).
  "${pip[@]}" install -q --no-deps --no-compile --no-index "${plat[@]}" --target "$work/site" "$work"/wh/*.whl
  rm -rf "$work/site/bin" "$work/site/xgrammar/lib"
  find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$work/wh" "$work/site"
  # xz: the CUDA kernels in vLLM's .so files shrink by a third more than in the wheels' zip.
  tar cf - -C "$work" site | xz -T2 -6 >"$work/vllm-site.tar.xz"
  wp_split "$work/vllm-site.tar.xz" .peer_whp "$first_mb" "$part_mb"
  .venv/bin/python bench/peer/select_packages.py --sizes "$work" bench/peer/manifest.json .peer_whp
  ;;
standin)
  # A stand-in for the device image, for `check`: Python 3.12 (pyenv's here) with the image's
  # torch/triton/transformers/tokenizers/numpy versions and the image packages vLLM imports.
  py=${PY312:-$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12.*/bin/python 2>/dev/null | tail -1)}
  [ -x "$py" ] || { echo "no Python 3.12 here (set PY312)"; exit 2; }
  "$py" -m venv "$work/venv312"
  v=("$work/venv312/bin/python" -m pip install -q)
  "${v[@]}" torch==2.11.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2
  "${v[@]}" --no-deps torchvision==0.26.0 torchaudio==2.11.0
  .venv/bin/python bench/peer/select_packages.py --image-reqs "$work" >"$work/image-reqs.txt"
  "${v[@]}" -r "$work/image-reqs.txt"
  "${v[@]}" numpy==2.5.2
  ;;
check)
  [ -d "$work/site" ] || { echo "run prepare first"; exit 2; }
  [ -x "$work/venv312/bin/python" ] || { echo "run standin first"; exit 2; }
  (cd /tmp && VLLM_SERVER_DEV_MODE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="$work/site" \
     "$work/venv312/bin/python" "$OLDPWD/bench/peer/check_vllm.py" --cpu --json "$work/check.json")
  ;;
*) echo "usage: $0 [prepare|standin|check]"; exit 2 ;;
esac
