"""Does the carried vLLM start? Imports what its OpenAI server, engine core and GPU worker
import for a Llama/Qwen2 model, then parses the server's command line.

    PYTHONPATH=/tmp/vllm-site python3 bench/peer/check_vllm.py [--cpu] [--json OUT]

Run on the device after the install (bench/peer/run.sh does) and, in prepare.sh, here under a
Python 3.12 stand-in for the device image. Each failure names the missing module; exit 1 if any.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

try:
    from bench.peer.import_scan import START_UP_MODULES
except ModuleNotFoundError:  # run as a script (the device, prepare.sh): its folder is on the path
    from import_scan import START_UP_MODULES

MODULES = (
    "vllm",
    *START_UP_MODULES,
    "vllm.v1.structured_output",
    "vllm.entrypoints.chat_utils",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
    # what build_app() imports for a generate model with VLLM_SERVER_DEV_MODE=1
    "vllm.entrypoints.serve",
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.serve.sagemaker.api_router",
    # (and vllm.entrypoints.generate.api_router, among START_UP_MODULES)
    "vllm.entrypoints.serve.disagg.api_router",
    "vllm.entrypoints.serve.elastic_ep.api_router",
    "vllm.entrypoints.serve.render.api_router",
    "vllm.entrypoints.serve.utils.server_utils",
)

# Every option bench/peer/run.sh gives the server.
SERVER_ARGS = [
    "--model", "/tmp/x", "--served-model-name", "peer", "--port", "8200", "--seed", "0",
    "--enable-prefix-caching", "--return-tokens-as-token-ids", "--gpu-memory-utilization",
    "0.45", "--max-model-len", "32768", "--max-num-batched-tokens", "2048",
    "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/peer/vprof", '
    '"torch_profiler_with_stack": false, "ignore_frontend": true, "max_iterations": 200}',
]  # fmt: skip


# With a GPU (and its driver) only: the compiled kernels and the CUDA platform.
CUDA_MODULES = (
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm.platforms.cuda",
    "vllm.vllm_flash_attn.flash_attn_interface",
)


def main(argv: list[str]) -> int:
    report: dict[str, object] = {"python": sys.version.split()[0], "modules": {}}
    failed = 0
    import torch

    cuda = torch.cuda.is_available()
    report["torch"] = f"{torch.__version__} cuda={cuda}"
    for name in MODULES + (CUDA_MODULES if cuda else ()):
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
            report["modules"][name] = f"ok {time.monotonic() - t0:.1f}s"  # type: ignore[index]
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            failed += 1
            missing = getattr(exc, "name", None)
            report["modules"][name] = f"FAIL {type(exc).__name__}: {exc}"  # type: ignore[index]
            print(f"FAIL {name}: {type(exc).__name__}: {exc} (missing: {missing})", flush=True)
            traceback.print_exc(limit=-3)
    try:  # the server's argument parser and its FastAPI app (every router it registers)
        if "--cpu" in argv:  # no GPU here: a stand-in platform so the parser has a device
            import vllm.platforms
            from vllm.platforms.cpu import CpuPlatform

            vllm.platforms.current_platform = CpuPlatform()
        from vllm.entrypoints.openai.api_server import build_app
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(SERVER_ARGS)
        app = build_app(args, ("generate",))
        paths = sorted({getattr(r, "path", "") for r in app.routes})
        report["routes"] = paths
        need_routes = ("/v1/chat/completions", "/v1/completions", "/generative_scoring")
        for need in (*need_routes, "/start_profile", "/stop_profile"):
            if need not in paths:
                raise RuntimeError(f"the app has no {need}")
        report["arg_parser"] = "ok"
    except Exception as exc:  # noqa: BLE001
        failed += 1
        report["arg_parser"] = f"FAIL {type(exc).__name__}: {exc}"
        print(f"FAIL arg parser: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=-3)
    if cuda:
        try:
            from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported

            report["fa3_supported"] = bool(is_fa_version_supported(3))
        except Exception as exc:  # noqa: BLE001
            report["fa3_supported"] = f"FAIL {type(exc).__name__}: {exc}"
    try:
        import vllm

        report["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        pass
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(report, f, indent=1)
    total = len(report["modules"])  # type: ignore[arg-type]
    print(
        f"check_vllm: {total - min(failed, total)}/{total} imports, "
        f"{'all ok' if not failed else f'{failed} failed'}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
