"""The packages carried for vLLM (used by bench/peer/prepare.sh): from pip's resolution of
vLLM 0.24.0 for the device (WORK/report.json), keep vLLM and what its OpenAI server imports
that the device image lacks; write the download list and the manifest.

    python bench/peer/select_packages.py WORK MANIFEST                 # WORK/urls.txt, MANIFEST
    python bench/peer/select_packages.py --sizes WORK MANIFEST PIECES  # add sizes, print them
    python bench/peer/select_packages.py --image-reqs WORK             # the stand-in's packages
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KINDS = Path("/work/.library/device/KINDS.md")

# name -> why it is needed (what imports it at start-up; bench/peer/check_vllm.py checks it).
CARRIED: dict[str, str] = {
    "vllm": "the server itself (0.24.0 pins torch 2.11.0 / torchvision 0.26.0 / torchaudio "
    "2.11.0, the image's; its CUDA kernels and FlashAttention 2/3 are inside the wheel)",
    "fastapi": "the OpenAI server's app (vllm.entrypoints.openai.api_server); 0.136, vLLM "
    "pins <0.137",
    "starlette": "fastapi's base; vLLM's middlewares",
    "pydantic": "every request/response model and vLLM's config classes",
    "pydantic-core": "pydantic's compiled core",
    "annotated-types": "pydantic dependency",
    "typing-inspection": "pydantic / fastapi dependency",
    "uvicorn": "the HTTP server vLLM runs its app in (vllm.entrypoints.launcher)",
    "httptools": "uvicorn's fast HTTP parser (http=auto picks it; without it uvicorn falls "
    "back to h11, slower, which would handicap vLLM)",
    "msgspec": "vLLM's engine-core <-> front-end messages (vllm.v1.serial_utils, engine)",
    "pyzmq": "the sockets between the API server and the engine-core process",
    "cbor2": "prefix-cache block hashing serialisation (vllm.utils.hashing)",
    "cachetools": "vllm.utils.cache, structured-output utils (module level)",
    "pybase64": "imported at module level by the serving code (embeddings/logprob encoding)",
    "partial-json-parser": "tool parsers, imported by chat serving at module level",
    "openai": "vLLM's protocol types come from the openai package (chat_utils, serving)",
    "jiter": "openai dependency (JSON parsing)",
    "sniffio": "openai dependency",
    "httpx2": "openai dependency (imported by openai at import)",
    "httpcore2": "httpx2's transport (openai's client, imported lazily by httpx2)",
    "openai-harmony": "chat_utils / responses serving import it at module level",
    "model-hosting-container-standards": "the SageMaker router build_app() always registers",
    "jmespath": "model-hosting-container-standards dependency (imported)",
    "watchfiles": "vllm.entrypoints.serve.utils.ssl (module level)",
    "python-multipart": "FastAPI refuses to register vLLM's form/upload routes without it",
    "prometheus-fastapi-instrumentator": "the /metrics route build_app() registers",
    "llguidance": "structured output back end imported by vllm.v1.structured_output at start",
    "xgrammar": "structured output back end imported by vllm.v1.structured_output at start "
    "(its 65 MB static library, lib/libxgrammar.a, is dropped: nothing links against it)",
    "apache-tvm-ffi": "xgrammar's runtime (0.1.9, vLLM's pin; Greenlane's 0.1.15 stays in "
    "Greenlane's own site folder)",
}

# Notes for packages pip resolves that are NOT carried (the big or surprising ones).
LEFT_OUT_NOTES: dict[str, str] = {
    "torch": "in the image (2.11.0, vLLM's pin)",
    "torchaudio": "in the image",
    "torchvision": "in the image",
    "flashinfer-python": "optional: vLLM uses FLASH_ATTN on Hopper; the FlashInfer sampler is "
    "turned off (VLLM_USE_FLASHINFER_SAMPLER=0; only top-p/top-k sampling uses it)",
    "flashinfer-cubin": "optional (FlashInfer's prebuilt kernels, hundreds of MB)",
    "nvidia-cutlass-dsl": "optional (CuTe-DSL kernels: FA4 on Blackwell, quack)",
    "nvidia-cutlass-dsl-libs-base": "optional",
    "nvidia-cutlass-dsl-libs-cu13": "optional",
    "quack-kernels": "optional (CuTe-DSL kernels)",
    "tilelang": "optional (kernels not used by Llama/Qwen2 in bf16)",
    "tokenspeed-mla": "optional (MLA attention: DeepSeek models)",
    "tokenspeed-triton": "optional (tokenspeed-mla's Triton)",
    "humming-kernels": "optional (quantised kernels)",
    "compressed-tensors": "optional (quantised checkpoints)",
    "fastsafetensors": "optional (--load-format fastsafetensors)",
    "mistral-common": "optional (Mistral tokenizer mode)",
    "depyf": "optional (torch.compile debug dumps only)",
    "dill": "optional (torch uses it when present; depyf's dependency)",
    "blake3": "optional (multimodal hashing)",
    "setproctitle": "optional (process titles; vLLM skips it when absent)",
    "opentelemetry-sdk": "optional (tracing)",
    "mcp": "optional (MCP tool server)",
    "anthropic": "optional (Anthropic messages API types, imported lazily)",
    "outlines-core": "optional (outlines grammar back end, lazy)",
    "lm-format-enforcer": "optional (grammar back end, lazy)",
    "numba": "in the image (n-gram speculative decoding only)",
    "triton": "in the image (3.6.0, torch 2.11's; the resolver's 3.9 is not carried)",
    "transformers": "in the image (5.17.0; vLLM needs >= 5.5.3)",
    "tokenizers": "in the image",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    if not KINDS.exists():
        return set()
    m = re.search(r"Packages: (.*?)\.\s*$", KINDS.read_text(), re.M)
    return {norm(n.strip()) for n in m.group(1).split(",")} if m else set()


def resolved(work: Path) -> dict[str, dict]:
    report = json.loads((work / "report.json").read_text())
    return {norm(it["metadata"]["name"]): it for it in report["install"]}


def select(work: Path, manifest: Path) -> None:
    res = resolved(work)
    image = image_packages()
    missing = [n for n in CARRIED if n not in res]
    if missing:
        raise SystemExit(f"not in pip's resolution (a newer vLLM?): {missing}")
    in_image = [n for n in CARRIED if n in image]
    if in_image:
        raise SystemExit(f"selected but in the image: {in_image}")
    urls = [res[n]["download_info"]["url"] for n in CARRIED]
    (work / "urls.txt").write_text("\n".join(urls) + "\n")
    left_out = {}
    for n, it in sorted(res.items()):
        if n in CARRIED:
            continue
        why = LEFT_OUT_NOTES.get(n) or (
            "in the image" if n in image else "optional: not imported when the server starts"
        )
        left_out[n] = {"version": it["metadata"]["version"], "why": why}
    doc = {
        "vllm": res["vllm"]["metadata"]["version"],
        "target": "CPython 3.12, manylinux x86_64; the device image's torch 2.11.0",
        "resolved_packages": len(res),
        "carried": [
            {
                "name": n,
                "version": res[n]["metadata"]["version"],
                "wheel": Path(res[n]["download_info"]["url"]).name,
                "why": CARRIED[n],
            }
            for n in CARRIED
        ],
        "left_out": left_out,
    }
    manifest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"selected {len(CARRIED)} of {len(res)} resolved packages", file=sys.stderr)


def sizes(work: Path, manifest: Path, pieces: Path) -> None:
    doc = json.loads(manifest.read_text())
    wh = work / "wh"
    for c in doc["carried"]:
        c["wheel_bytes"] = (wh / c["wheel"]).stat().st_size
    site = work / "site"
    doc["sizes"] = {
        "wheels_bytes": sum(c["wheel_bytes"] for c in doc["carried"]),
        "site_bytes": sum(f.stat().st_size for f in site.rglob("*") if f.is_file()),
        "xz_bytes": (work / "vllm-site.tar.xz").stat().st_size,
        "pieces": {p.name: (p / "part").stat().st_size for p in sorted(pieces.iterdir())},
        "sha256": (pieces / "a" / "sha256").read_text().strip(),
    }
    manifest.write_text(json.dumps(doc, indent=1) + "\n")
    (pieces / "a" / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")
    mib = 2**20
    s = doc["sizes"]
    print(f"\nvLLM {doc['vllm']} + {len(doc['carried']) - 1} packages:")
    for c in sorted(doc["carried"], key=lambda c: -c["wheel_bytes"]):
        print(f"  {c['wheel_bytes'] / mib:7.1f} MiB  {c['name']}=={c['version']}")
    print(
        f"wheels {s['wheels_bytes'] / mib:.1f} MiB; installed site {s['site_bytes'] / mib:.1f} MiB;"
        f" tar.xz {s['xz_bytes'] / mib:.1f} MiB"
    )
    print("pieces: " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in s["pieces"].items()))
    print(f"device calls to carry them: {len(s['pieces'])} (one piece each)")


def image_reqs(work: Path) -> None:
    """name==version of the resolved packages the image has, for the stand-in (torch & co.,
    CUDA wheels and the versions pinned separately are left to prepare.sh standin)."""
    res = resolved(work)
    image = image_packages()
    skip = {
        "torch",
        "torchaudio",
        "torchvision",
        "triton",
        "transformers",
        "tokenizers",
        "numpy",
        "huggingface-hub",
    }
    for n, it in sorted(res.items()):
        if n in image and n not in skip and not n.startswith(("nvidia-", "cuda-")):
            print(f"{n}=={it['metadata']['version']}")


def main(argv: list[str]) -> int:
    if argv[0] == "--sizes":
        sizes(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    elif argv[0] == "--image-reqs":
        image_reqs(Path(argv[1]))
    else:
        select(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
