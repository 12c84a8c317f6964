"""Command line: `greenlane serve [options]` / `python -m app serve [options]`.

Every option is also settable by its `GREENLANE_*` environment variable; a flag given on the
command line wins over the environment. Options are generated from `Settings`' fields (server
options plus every `EngineConfig` field), so `--help` always lists all of them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import types
import typing
from collections.abc import Sequence
from typing import Any

import uvicorn

from app.settings import ENV_PREFIX, Settings

log = logging.getLogger("greenlane.app")

# Help for the engine options (their fields carry no description of their own).
_ENGINE_HELP = {
    "model": "'default' (SmolLM2-135M-Instruct), a Hugging Face-format folder, or random:<preset>",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA, float32 on CPU)",
    "device": "auto | cpu | cuda[:N]",
    "seed": "seed for random weights and sampling defaults",
    "attention_backend": "auto | torch | flashinfer",
    "block_size": "tokens per KV block (power of two)",
    "num_kv_blocks": "KV blocks in the pool (default: sized from memory)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "max_gpu_memory_gb": "cap on GPU memory for the whole engine",
    "cpu_kv_cache_gb": "KV pool size on CPU",
    "max_model_len": "prompt + output token limit (default: the model's)",
    "max_num_seqs": "cap on running requests (decode batch)",
    "prefill_token_budget": "tokens per prefill step",
    "prefill_policy": "srjf | spf | fcfs",
    "fairness_lambda": "SRJF fairness offset",
    "spf_gamma": "SPF aging weight",
    "jct_calibration": "path of a JCT calibration file",
    "hybrid_prefill": "run token-wise ops of long prefills in chunks",
    "prefill_chunk_tokens": "chunk size for hybrid prefill",
    "enable_prefix_cache": "reuse KV blocks of shared prompt prefixes",
    "cuda_graphs": "capture decode steps in CUDA graphs",
    "partition": "off | static:<prefill_sms> | auto (green-context SM split)",
}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as `int | None`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return (non_none[0] if len(non_none) == 1 else str), len(non_none) < len(args)
    return annotation, False


def _optional(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null", "") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="greenlane",
        description="Greenlane: one-GPU LLM serving for scoring and streaming chat.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start the server. Each option can also be set by the environment variable "
        "shown; the flag wins. Booleans take true/false.",
    )
    for name, field in Settings.model_fields.items():
        scalar, optional = _scalar_type(field.annotation)
        convert: Any = _parse_bool if scalar is bool else scalar if scalar in (int, float) else str
        if optional:
            convert = _optional(convert)
        doc = _ENGINE_HELP.get(name) or field.description or name
        serve.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=convert,
            default=argparse.SUPPRESS,  # absent flags leave env / defaults in charge
            metavar=scalar.__name__.upper() if scalar in (int, float, bool) else "STR",
            help=f"{doc} [env {ENV_PREFIX}{name.upper()}; default {field.default!r}]",
        )
    return parser


class GracefulServer(uvicorn.Server):
    """uvicorn, plus the shutdown we want on SIGTERM/SIGINT: new requests get 503 at once,
    running ones get `shutdown_grace_s` to finish, the rest are aborted, and the process exits 0
    (uvicorn would re-raise the signal, making the exit status 128+signal)."""

    def __init__(self, config: uvicorn.Config, app: Any, grace_s: float):
        super().__init__(config)
        self._greenlane_app = app
        self._grace_s = grace_s
        self._draining = False

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        if not self._draining:
            self._draining = True
            log.info("signal %d: draining (grace %.1f s)", sig, self._grace_s)
            from app.main import stop_engine

            self._greenlane_app.state.client.start_draining()
            # The engine's shutdown blocks for up to the grace period: not on the loop thread.
            # When it returns, every stream has its final output, so uvicorn can finish.
            def drain() -> None:
                stop_engine(self._greenlane_app, self._grace_s)
                uvicorn.Server.handle_exit(self, sig, frame)
                self._captured_signals.clear()

            threading.Thread(target=drain, name="greenlane-drain", daemon=True).start()
            return
        # Second signal: uvicorn's own behaviour (SIGINT twice forces the exit).
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(settings: Settings, engine_factory: Any = None) -> int:
    """Run the server in this (main) thread until SIGTERM/SIGINT. `engine_factory` is for
    tests and embedding (default: the real engine)."""
    from app.main import create_app

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings, engine_factory=engine_factory)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # Backstop only: the drain thread aborts stragglers after the grace period.
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    server = GracefulServer(config, app, settings.shutdown_grace_s)
    server.run()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k != "command"}
        try:
            settings = Settings(**overrides)
            settings.to_engine_config()  # validate engine options before loading anything
        except ValueError as exc:
            print(f"greenlane: invalid option: {exc}", file=sys.stderr)
            return 2
        return serve(settings)
    return 2


if __name__ == "__main__":
    sys.exit(main())
