"""Command line: `greenlane serve|calibrate [options]` / `python -m app serve|calibrate ...`.

* `serve`: the HTTP server. `--calibrate` first profiles prefill on the serving device (before
  the port opens), saves the JCT model's section of the calibration file in the cache folder
  and uses it.
* `calibrate`: only the profile: builds the engine for `--model`/`--device` once, profiles
  every model the device supports (the JCT model; on CUDA with green contexts also the
  SM-partition cost model) and writes their sections of one file,
  `<calibration-dir>/calibration-<device>--<model>.json` (or `--out FILE`), then exits. Later
  `serve` runs on the same device and model load it automatically. `--what jct|partition`
  restricts the profile to one model (the file's other section is kept).

Every option is also settable by its `GREENLANE_*` environment variable; a flag given on the
command line wins over the environment. Options are generated from `Settings`' fields (server
options plus every `EngineConfig` field), so `--help` always lists all of them. Boolean flags
take true/false, or nothing (`--calibrate` = `--calibrate true`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import types
import typing
from collections.abc import Sequence
from typing import Any

import uvicorn

from app import __version__
from app.settings import (
    AUTO_WHEN_UNSET,
    ENV_PREFIX,
    UNSET_WORDS,
    Settings,
    engine_field_names,
    unknown_env_options,
)
from runtime.config import (
    CHUNK_MEMORY_SHARE,
    PREFILL_CHUNK_CHOICES,
    PREFILL_CHUNK_TOKENS_UNSIZED,
)

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
    "max_score_tokens": "longest scoring prompt to reserve activation memory for on CUDA "
    "(default: max_model_len); longer ones get a 400",
    "max_num_seqs": "cap on running requests (decode batch)",
    "prefill_token_budget": "tokens per prefill step",
    "mixed_step_token_budget": "auto | none | N: tokens a step carrying decodes may take, "
    "decodes included; a TBT target may cut it shorter, and auto's chunks keep to it (auto: "
    "2048 on CUDA, none on CPU; none: --prefill-token-budget alone); steps without decodes "
    "keep the whole budget",
    "prefill_policy": "srjf-cold-fcfs (SRJF, cold requests in arrival order) | srjf | spf | "
    "fcfs | srjf-oneshot (ablation)",
    "fairness_lambda": "SRJF fairness offset",
    "ttft_slo_ms": "latency target in ms (a score's, a chat's time to first token) that SRJF "
    "derives its fairness offset from (instead of --fairness-lambda)",
    "spf_gamma": "SPF aging weight",
    "jct_calibration": "calibration file for the JCT model: a calibration-<device>--<model>.json "
    "(its jct section) or an old jct-*.json; default: the cached file for this device and model",
    "hybrid_prefill": "run token-wise ops of long prefills in chunks",
    "prefill_chunk_tokens": "tokens a long prompt's token-wise ops (the MLP) run at a time with "
    f"hybrid prefill (default: on CUDA the largest of {'/'.join(map(str, PREFILL_CHUNK_CHOICES))} "
    f"whose MLP temporaries take at most {CHUNK_MEMORY_SHARE * 100:g} %% of the memory the KV pool "
    f"and activations share; {PREFILL_CHUNK_TOKENS_UNSIZED} on the CPU)",
    "enable_prefix_cache": "reuse KV blocks of shared prompt prefixes",
    "cuda_graphs": "capture decode steps in CUDA graphs",
    "prefill_graph_max_tokens": "prefill parts of up to this many tokens replay piecewise CUDA "
    "graphs (dense work per token bucket, attention eager between; 0: off; at most "
    "--prefill-chunk-tokens)",
    "prefill_graph_padding": "from 256 tokens a prefill part is padded to its graph's bucket by "
    "at most this fraction (smaller: finer buckets, more graphs captured at start-up)",
    "merge_mixed_steps": "run a step's prefill parts and decodes as one forward when the "
    "merged rows fit a prefill graph (not for scoring prefills that discard their suffix KV)",
    "fused_rope_kv_write": "auto | true | false: RoPE and the K/V pool write in one Triton "
    "launch per layer instead of three (auto: with the FlashInfer backend; true: also with "
    "torch SDPA)",
    "prefill_graphs_write_kv": "auto | true | false: with the fused RoPE + K/V write, the "
    "prefill graphs run it inside their replays and attention alone runs between them (auto: "
    "wherever the graphs and the fused write run; true: also say where it cannot)",
    "decode_kv_split": "auto | always | never: decode attention's KV split in the FlashInfer "
    "CUDA graphs, batches above --fused-decode-max-batch "
    "(always: FlashInfer's split and its merge kernel a layer; never: one chunk a request, no "
    "merge; auto: one chunk where FlashInfer's split would give one chunk anyway)",
    "prefill_warm_up_tokens": "at start-up, run one discarded prefill of this many tokens "
    "(capped at the longest scoring prompt), then one of each form a chat's first chunked "
    "steps take, so the first requests are not the ones that pay first-use costs (default: "
    "16384 on CUDA, off on the CPU; 0: off)",
    "fused_decode_max_batch": "decode graphs of batches up to this size (at most 64) run the "
    "fused Triton decode kernels instead of FlashInfer + cuBLAS (0: never)",
    "wait_for_shared_prefix_tokens": "a waiting request whose next N+ prompt tokens a running "
    "request is prefilling now (a shared, not yet cached prefix) waits for them to be cached "
    "rather than computing them twice (0: off)",
    "partition": "off | static:<prefill_sms> | auto (green-context SM split)",
    "partition_kv_switch": "split controller: KV usage (0-1) above which decode is favoured "
    "over prefill",
    "partition_alpha": "split controller: prefill slack (>= 1) allowed while decode is favoured",
    "partition_beta": "split controller: decode slack (>= 1) allowed while prefill is favoured",
    "partition_hysteresis_sms": "split controller: ignore split moves smaller than this many SMs",
    "partition_min_gain": "split controller: a new split must improve the objective by this "
    "fraction",
    "partition_min_split_speedup": "split controller: split only when predicted this much faster "
    "than time-slicing the whole GPU",
    "partition_allow_time_slice": "split controller: may give every SM to one phase at a time "
    "when that is predicted faster",
    "tbt_slo_ms": "time-between-tokens target in ms, any --partition mode: in a step with "
    "decodes, prefill chunks and admissions are cut so that the step's predicted time (JCT "
    "model + recent decode step time) stays within it; --prefill-token-budget still caps it. "
    "In auto: the target of its chunked time-slicing, and of the split controller when "
    "--partition-tbt-slo-ms is not given",
    "chunk_fixed_share": "auto's chunks beside decodes grow past --mixed-step-token-budget "
    "until the step's fixed part (its decodes, the mixed step's offset, the prefix read) is "
    "at most this share of it (0-1; within the prefill budget and the TBT target; default: the cap "
    "alone)",
    "partition_tbt_slo_ms": "split controller (auto): TBT target in ms (default: "
    "--tbt-slo-ms); per step auto takes, of prefill chunks cut to the target on the whole GPU, "
    "a split and layer slices, what meets it and finishes the prefill first (a whole prefill: "
    "time-slice when a decode step can wait for it, else give prefill every SM the target "
    "allows); without any target: Nexus's relative decode slack, --partition-beta",
    "partition_layer_slicing": "split controller (auto, with --partition-tbt-slo-ms or "
    "--tbt-slo-ms): when a "
    "whole prefill would stall decode past the target, it may run the prefill on every SM in "
    "slices of layers with a decode step between slices, if predicted faster than a split; "
    "where no layer fits the target and the prompt streams its rows (hybrid prefill past the "
    "prefill budget), in row pieces of each layer",
    "partition_min_decode_sms": "fewest SMs a decode partition may get (default: the device's "
    "minimum partition)",
    "partition_calibration": "calibration file for the partition cost model: a "
    "calibration-<device>--<model>.json (its partition section) or an old partition-*.json; "
    "default: the cached file for this GPU and model, else a start-up profile in auto mode",
    "partition_calibration_dir": "folder whose calibration file holds the partition section "
    "(default: --calibration-dir)",
    "partition_startup_profile": "in auto mode with no calibration file, profile the GPU at "
    "start-up (seconds; cached for later starts)",
    "pd_slice_tokens": "split mode: prefill layers per launch = max(1, this // batch tokens)",
    "pd_max_queued_slices": "split mode: prefill slices queued ahead on the prefill stream",
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


def _optional(convert: Any, auto: bool = False) -> Any:
    unset = (*UNSET_WORDS, "", "auto") if auto else (*UNSET_WORDS, "")

    def parse(text: str) -> Any:
        return None if text.strip().lower() in unset else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


# Options of `calibrate`: the engine's (they decide what is measured) plus these.
_CALIBRATE_SETTINGS = ("calibration_dir", "log_level")


def _add_settings_options(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    for name in names:
        field = Settings.model_fields[name]
        scalar, optional = _scalar_type(field.annotation)
        convert: Any = _parse_bool if scalar is bool else scalar if scalar in (int, float) else str
        auto = name in AUTO_WHEN_UNSET
        if optional:
            convert = _optional(convert, auto)
        doc = _ENGINE_HELP.get(name) or field.description or name
        extra: dict[str, Any] = {"nargs": "?", "const": True} if scalar is bool else {}
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=convert,
            default=argparse.SUPPRESS,  # absent flags leave env / defaults in charge
            metavar=(
                f"{scalar.__name__.upper()}|auto"
                if auto
                else scalar.__name__.upper()
                if scalar in (int, float, bool)
                else "STR"
            ),
            help=f"{doc} [env {ENV_PREFIX}{name.upper()}; default "
            f"{'auto' if auto and field.default is None else repr(field.default)}]",
            **extra,
        )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="greenlane",
        description="Greenlane: one-GPU LLM serving for scoring and streaming chat.",
    )
    parser.add_argument("--version", action="version", version=f"greenlane {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start the server. Each option can also be set by the environment variable "
        "shown; the flag wins. Booleans take true/false (a bare flag means true).",
    )
    _add_settings_options(serve, list(Settings.model_fields))
    cal = sub.add_parser(
        "calibrate",
        help="profile this device and save its calibration file",
        description="Build the engine for --model on --device once and profile what the "
        "device supports: prefills over a grid of (uncached, cached) token counts for the JCT "
        "model, and on CUDA with green contexts prefill and decode on the whole GPU and on "
        "pre-created splits for the SM-partition cost model (one progress line per point with "
        "an ETA). Writes one file, <calibration-dir>/calibration-<device>--<model>.json (or "
        "--out), with a jct and a partition section. `serve` on the same device and model "
        "then loads it automatically.",
    )
    cal.add_argument(
        "--what",
        choices=("all", "jct", "partition"),
        default="all",
        help="all: every model the device supports (default; the partition section only on "
        "CUDA with green contexts); jct: only the prefill JCT model; partition: only the "
        "SM-partition cost model (times prefill and decode alone on the whole GPU and on 5 "
        "pre-created splits, and together). A restricted run keeps the file's other section",
    )
    cal.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the calibration file here instead of the cache folder",
    )
    cal.add_argument(
        "--uncached-tokens",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="uncached prompt lengths to time (default: a small CPU grid "
        "32,128,512,1024 or a GPU grid 128..16384)",
    )
    cal.add_argument(
        "--cached-tokens",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="cached-prefix lengths to time (default: CPU 0,1024; GPU 0,4096,16384)",
    )
    cal.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help="timings per point, median kept (default: CPU 2, GPU 3)",
    )
    _add_settings_options(cal, [*engine_field_names(), *_CALIBRATE_SETTINGS])
    sub.add_parser(
        "cluster",
        help="serve replicas on Ray Serve behind one endpoint (`greenlane cluster --help`)",
        add_help=False,
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


def _real_engine_factory(config: Any, sink: Any) -> Any:
    from runtime.engine import Engine  # lazily: loads torch

    return Engine(config, sink)


def _run_calibration(
    engine: Any, calibration_dir: str | None, model_key: str
) -> tuple[Any, str | None]:
    """`serve --calibrate`: profile `engine` (built, not started) for the JCT model and write
    its section of the calibration file: (the fitted JCTModel, the file)."""
    from runtime.calibrate import calibrate_device

    run = calibrate_device(engine, model=model_key, what="jct", cache_dir=calibration_dir)
    return run.jct, (run.paths or [None])[0]


class CalibratingFactory:
    """An engine factory that calibrates the engine it builds before it starts serving. A
    module-level class (not a closure): it is pickled into the engine core process."""

    def __init__(self, factory: Any, calibration_dir: str | None, model_key: str) -> None:
        self.factory = factory
        self.calibration_dir = calibration_dir
        self.model_key = model_key

    def __call__(self, config: Any, sink: Any) -> Any:
        engine = self.factory(config, sink)
        jct, path = _run_calibration(engine, self.calibration_dir, self.model_key)
        # The engine's policies share its JCT model object: update it in place.
        engine.jct_model.adopt(jct)
        log.info("JCT model: calibrated now, saved to %s and in use: %r", path, jct)
        return engine


def _calibrating_factory(settings: Settings, factory: Any) -> Any:
    return CalibratingFactory(factory, settings.calibration_dir, settings.calibration_model_key)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads, so a busy port is reported at
    once. Raises OSError (the caller prints one line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: Any, settings: Settings) -> GracefulServer:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # uvicorn's default (5 s) equals httpx's pool expiry: a client could send its next
        # request on an idle connection as the server closed it, and read an error for a
        # request the server never saw (the H200 load generator did, twice in ~5,000).
        timeout_keep_alive=settings.keep_alive_s,
        # Backstop only: the drain thread aborts stragglers after the grace period.
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    return GracefulServer(config, app, settings.shutdown_grace_s)


# Open files (sockets included) the server asks for: every kept-alive client connection holds
# one for `--keep-alive-s`, and a common soft limit of 1,024 would refuse connections
# (accept() failing with EMFILE) long before the host or the engine is the limit.
WANTED_OPEN_FILES = 65536


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE towards `wanted`, never past the hard limit: (old, new)
    when it changed, else None (already enough, or not settable on this platform)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    return soft, target


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def serve(settings: Settings, engine_factory: Any = None, sock: socket.socket | None = None) -> int:
    """Run the server until SIGTERM/SIGINT: the engine core in a process of its own and the
    HTTP front end here (`--api-server-count 1`) or in N processes sharing the socket.
    `engine_factory` is for tests and embedding (default: the real engine)."""
    from app.main import create_app

    _configure_logging(settings)
    raised = raise_open_file_limit()
    if raised is not None:
        logging.getLogger("greenlane.app").info(
            "open-file limit raised from %d to %d (client connections)", *raised
        )
    factory = engine_factory or _real_engine_factory
    if settings.calibrate:
        factory = _calibrating_factory(settings, factory)
    if sock is None:
        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as exc:
            print(
                f"greenlane: cannot listen on {settings.host}:{settings.port}: {exc.strerror}",
                file=sys.stderr,
            )
            return 2
    if settings.api_server_count > 1:
        return _serve_many(settings, factory, sock)
    app = create_app(settings, engine_factory=factory, freeze_gc_at_start=True)
    server = _uvicorn_server(app, settings)
    server.run(sockets=[sock])
    return 0 if server.started else 1


def _api_server_main(settings: Settings, handle: Any, sock: socket.socket) -> None:
    """One of several API-server processes: HTTP front end on the shared socket, connected
    to the engine core the launcher started."""
    from app.main import create_app

    _configure_logging(settings)
    app = create_app(settings, core=handle, freeze_gc_at_start=True)
    server = _uvicorn_server(app, settings)
    server.run(sockets=[sock])


def _serve_many(settings: Settings, factory: Any, sock: socket.socket) -> int:
    """Launcher of `--api-server-count N`: the engine core, then N API servers on one socket.
    SIGTERM/SIGINT: the API servers stop admitting, the core finishes what runs within the
    grace period, then everything exits."""
    import asyncio
    import multiprocessing as mp
    import signal

    from app.engine_view import load_frontend_tokenizer
    from runtime.core.client import EngineCoreClient
    from runtime.core.process import remove_ipc_folder, start_engine_core

    config = settings.to_engine_config()
    log.info(
        "starting engine core: model=%s, %d API servers", config.model, settings.api_server_count
    )
    try:
        handle, core_proc = start_engine_core(config, factory, log_level=settings.log_level)
    except RuntimeError as exc:
        print(f"greenlane: the engine could not start: {exc}", file=sys.stderr)
        return 1
    ctx = mp.get_context("spawn")
    servers = [
        ctx.Process(
            target=_api_server_main, args=(settings, handle, sock), name=f"greenlane-api-{i}"
        )
        for i in range(settings.api_server_count)
    ]
    for p in servers:
        p.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("serving on http://%s:%d", settings.host, settings.port)
    while not stop.is_set() and core_proc.is_alive() and any(p.is_alive() for p in servers):
        stop.wait(0.5)
    for p in servers:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)  # type: ignore[arg-type]

    async def shutdown_core() -> None:
        client = EngineCoreClient(handle, load_frontend_tokenizer(handle.info), process=core_proc)
        try:
            await client.start(timeout_s=10)
            await client.call(
                "shutdown", settings.shutdown_grace_s, timeout_s=settings.shutdown_grace_s + 60
            )
        finally:
            await client.close()

    if core_proc.is_alive():
        try:
            asyncio.run(shutdown_core())
        except Exception as exc:  # noqa: BLE001 - a dead core needs no shutdown
            log.warning("engine core shutdown: %s", exc)
    for p in servers:
        p.join(settings.shutdown_grace_s + 10)
        if p.is_alive():
            p.kill()
    core_proc.join(30)
    if core_proc.is_alive():
        core_proc.kill()
        core_proc.join(5)
    remove_ipc_folder(handle.input_address)
    return 0


def calibrate_command(
    settings: Settings,
    out_path: str | None,
    grid: dict[str, Any],
    engine_factory: Any = None,
    what: str = "all",
) -> int:
    """`greenlane calibrate`: build the engine once, profile (`what`: all the device supports,
    jct or partition: runtime/calibrate.py `calibrate_device`), write the one calibration file,
    print the path of each file written (one, unless --partition-calibration-dir differs)."""
    import dataclasses

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The profile measures the device; loading an old calibration first would be pointless,
    # and the engine must not run its own start-up partition profile.
    config = dataclasses.replace(
        settings.to_engine_config(resolve_calibration=False),
        jct_calibration=None,
        partition_calibration=None,
        partition_startup_profile=False,
    )
    from runtime.calibrate import calibrate_device

    engine = (engine_factory or _real_engine_factory)(config, lambda _out: None)
    try:
        log.info("calibrating %s on %s (progress on stderr)", what, engine.device_name)
        run = calibrate_device(
            engine,
            model=settings.calibration_model_key,
            what=what,
            out_path=out_path,
            cache_dir=settings.calibration_dir,
            partition_cache_dir=config.partition_calibration_dir,
            grid=grid,
        )
    except ValueError as exc:
        print(f"greenlane: calibration failed: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    if run.partition_skipped:
        print(
            f"greenlane: partition section not profiled: {run.partition_skipped}", file=sys.stderr
        )
    for path in run.paths or []:
        print(path)
    return 0


_DTYPE_CHOICES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def check_choices(settings: Settings) -> None:
    """Option values the engine would only reject after loading the model: checked first,
    so a mistake costs one line and exit code 2, not a traceback minutes later."""
    from policies import POLICY_NAMES
    from runtime.model.presets import PRESETS

    if settings.dtype not in _DTYPE_CHOICES:
        raise ValueError(f"dtype: {settings.dtype!r} is not one of {', '.join(_DTYPE_CHOICES)}")
    if settings.prefill_policy not in POLICY_NAMES:
        raise ValueError(
            f"prefill_policy: {settings.prefill_policy!r} is not one of {', '.join(POLICY_NAMES)}"
        )
    if settings.log_level.lower() not in _LOG_LEVELS:
        raise ValueError(
            f"log_level: {settings.log_level!r} is not one of {', '.join(_LOG_LEVELS)}"
        )
    device = settings.device
    if not (device in ("auto", "cpu") or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"device: {device!r} is not auto, cpu, cuda or cuda:N")
    model = settings.model
    if model.startswith("random:"):
        if model[7:] not in PRESETS:
            raise ValueError(
                f"model: unknown random preset {model[7:]!r}; available: {', '.join(sorted(PRESETS))}"
            )
    elif model != "default":
        folder = os.path.expanduser(model)
        if not os.path.isdir(folder):
            raise ValueError(f"model: {model!r} is not a folder, 'default' or random:<preset>")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"model: the folder {model!r} has no config.json")


def _one_line(exc: Exception) -> str:
    """pydantic's multi-line validation errors as one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return "; ".join(parts)
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cluster"]:  # its own options: app/cluster/cli.py (needs the `cluster` extra)
        from app.cluster.cli import main as cluster_main

        return cluster_main(argv[1:])
    args = build_parser().parse_args(argv)
    extra = ("command", "out", "uncached_tokens", "cached_tokens", "repeats", "what")
    overrides = {k: v for k, v in vars(args).items() if k not in extra}
    for name in unknown_env_options():
        print(f"greenlane: warning: {name} names no option: ignored", file=sys.stderr)
    try:
        settings = Settings(**overrides)
        # Validate engine options before loading anything (the calibration file is chosen,
        # and logged, when the engine is built).
        settings.to_engine_config(resolve_calibration=False)
        if settings.jct_calibration and not os.path.isfile(
            os.path.expanduser(settings.jct_calibration)
        ):
            raise ValueError(f"jct_calibration: no such file {settings.jct_calibration!r}")
        if settings.partition_calibration and not os.path.isfile(
            os.path.expanduser(settings.partition_calibration)
        ):
            raise ValueError(
                f"partition_calibration: no such file {settings.partition_calibration!r}"
            )
        check_choices(settings)
    except ValueError as exc:
        print(f"greenlane: invalid option: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.command == "serve":
        try:
            sock = bind_socket(settings.host, settings.port)
        except OSError as exc:
            print(
                f"greenlane: cannot listen on {settings.host}:{settings.port}: {exc.strerror}",
                file=sys.stderr,
            )
            return 2
        return serve(settings, sock=sock)
    if args.command == "calibrate":
        grid = {
            "uncached_tokens": args.uncached_tokens,
            "cached_tokens": args.cached_tokens,
            "repeats": args.repeats,
        }
        return calibrate_command(settings, args.out, grid, what=args.what)
    return 2


if __name__ == "__main__":
    sys.exit(main())
