"""The engine's SM-partition set-up: which manager, which cost-model parameters, the start-up
profile.

`make_partition` returns a `GreenContextPartition` on CUDA with green contexts (pairs
pre-created whatever the initial mode, so the admin page can switch at run time), else an
`UnavailablePartition` that says why; a failure to create the pairs falls back too, and says
so. The cost model's parameters come from `choose_partition_calibration` (explicit file >
the cached calibration file's `partition` section > an old `partition-*.json` > start-up
profile in auto > built-in H200 fallback > uncalibrated); splits that failed when the file was
profiled start disabled. `profile_at_startup` runs the bounded profile when that choice says
so and writes its section of the calibration file (the JCT section there is kept), and keeps
the fallback (and says so) if it fails.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.diagnostics import fallbacks
from runtime.partition import PartitionManager, UnavailablePartition
from runtime.partition.cost_model import ControllerConfig

log = logging.getLogger("greenlane.partition")


def controller_config_from(config: EngineConfig) -> ControllerConfig:
    """The split controller's thresholds from the engine config. Its TBT target is
    `--partition-tbt-slo-ms`, else `--tbt-slo-ms` (which any mode honours): one target for
    the splits and for auto's chunked time-slicing unless both are given."""
    return ControllerConfig(
        kv_switch=config.partition_kv_switch,
        alpha=config.partition_alpha,
        beta=config.partition_beta,
        hysteresis_sms=config.partition_hysteresis_sms,
        min_gain=config.partition_min_gain,
        min_split_speedup=config.partition_min_split_speedup,
        allow_time_slice=config.partition_allow_time_slice,
        tbt_slo_ms=(
            config.partition_tbt_slo_ms
            if config.partition_tbt_slo_ms is not None
            else config.tbt_slo_ms
        ),
        layer_slicing=config.partition_layer_slicing,
    )


@dataclass(slots=True)
class PartitionSetup:
    manager: PartitionManager  # what the engine exposes as `engine.partition`
    green: Any = None  # the GreenContextPartition, or None when partitioning is unavailable
    calibration_choice: Any = None  # runtime.partition.calibrate.CalibrationChoice, or None


def make_partition(config: EngineConfig, device: torch.device, device_name: str) -> PartitionSetup:
    from runtime.partition.green_ctx import green_contexts_unavailable_reason

    if device.type != "cuda":
        reason = "no CUDA device"
    else:
        reason = green_contexts_unavailable_reason(device.index or 0)
    if not reason:
        # Outside the try below: a bad explicit --partition-calibration must stop the
        # start-up, not be swallowed.
        from runtime.calibrate import model_key
        from runtime.partition.calibrate import choose_partition_calibration

        total_sms = torch.cuda.get_device_properties(device).multi_processor_count
        choice = choose_partition_calibration(
            explicit_path=config.partition_calibration,
            cache_dir=config.partition_calibration_dir,
            device=device_name,
            total_sms=total_sms,
            model=model_key(config.model),
            mode=config.partition.split(":")[0],
            startup_profile=config.partition_startup_profile,
        )
        (log.info if choice.action in ("explicit", "cached", "profile") else log.warning)(
            "%s", choice.reason
        )
        try:
            from runtime.partition.gpu import GreenContextPartition

            t0 = time.perf_counter()
            green = GreenContextPartition(
                config.partition,
                cost_model=choice.cost_model(total_sms),
                controller_config=controller_config_from(config),
                min_decode_sms=config.partition_min_decode_sms,
                device_index=device.index or 0,
            )
            log.info(
                "green-context partition: %d splits pre-created in %.0f ms (mode %s)",
                len(green.splits),
                (time.perf_counter() - t0) * 1e3,
                config.partition,
            )
            # Splits that failed when this GPU and model were profiled stay out of service.
            profile = getattr(choice.calibration, "profile", None) or {}
            for split, why in (profile.get("failed_splits") or {}).items():
                green.disable_split(int(split), f"failed when profiled: {why}")
            return PartitionSetup(green, green, choice)
        except Exception as e:  # noqa: BLE001 - any failure: run time-sliced, say why
            reason = f"green-context pairs could not be created: {type(e).__name__}: {e}"
    if config.partition != "off":
        log.warning(
            "partition %s requested but unavailable (%s); falling back to "
            "time-slicing (partition=off)",
            config.partition,
            reason,
        )
    return PartitionSetup(UnavailablePartition(reason))


def profile_at_startup(engine: Any, green: Any, choice: Any) -> None:
    """The bounded start-up profile (`--partition auto`, no partition calibration): measure the
    model on a few pre-created splits, fit, write the `partition` section of the calibration
    file for this GPU and model (runtime/calibrate.py), install the parameters, and take
    out of service any split that failed. A failure keeps the fallback chosen at start-up
    (built-in H200 parameters or none) and says so."""
    from runtime.partition.gpu import profile_engine

    try:
        cal = profile_engine(engine, full=False, cache_dir=engine.config.partition_calibration_dir)
        green.set_cost_model(cal.cost_model())
        for split, why in (cal.profile.get("failed_splits") or {}).items():
            green.disable_split(int(split), f"failed in the start-up profile: {why}")
    except Exception as e:  # noqa: BLE001 - serve anyway, on the fallback, and say so
        torch.cuda.synchronize(engine.device)
        fallback = choice.calibration
        fallbacks.take(
            "partition start-up profile",
            e,
            fallback.source if fallback else "uncalibrated, auto time-slices",
            log,
        )


def capture_split_graphs(runner: Any, green: Any) -> list[str]:
    """Capture at start-up the decode graph sets of the splits the initial mode will use: every
    usable split in `auto`, the pinned one in `static`, none in `off` (a later switch from the
    admin page captures on first use). Returns the labels captured.

    Why up front: a set is otherwise captured inside the first decode step on its split, which
    stalls the engine loop for the capture (~1.6 s for 15 batch sizes of an 8B model on the
    H200) once per split, i.e. many seconds of stalls spread over the first minute of serving
    in auto. All sets share one graph memory pool, so this costs start-up time, not memory."""
    if runner.graph_registry is None:
        return []
    mode = green.mode
    if mode == "auto":
        splits = list(green.splits)
    elif mode == "static":
        splits = [s for s in (green.controller.pinned,) if s is not None]
    else:
        return []
    total = green.layout.total_sms
    labels = []
    t0 = time.perf_counter()
    for i, s in enumerate(splits):
        label = f"{s}/{total - s}"
        runner.capture_for_streams({label: green.pairs[s].decode.stream})
        why = runner.graph_registry.capture_errors.get(label)
        if why is not None:
            # Seen on the H200: cuBLAS failing on a 12-SM decode side. Decoding there would
            # fail the same way (or run eagerly, several times slower): out of service now
            # rather than after a failed step while serving.
            green.disable_split(s, f"decode graphs could not be captured: {why}")
            continue
        labels.append(label)
        log.info("decode graphs: split %s done (%d/%d)", label, i + 1, len(splits))
    log.info(
        "decode graphs for %d split(s) captured in %.1f s", len(labels), time.perf_counter() - t0
    )
    return labels
