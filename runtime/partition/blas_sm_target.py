"""Tell cuBLAS how many SMs its matrix products will run on (`cublasSetSmCountTarget`).

Why: cuBLAS picks a GEMM kernel and its tiling for the whole device (132 SMs on the H200). On
a green-context partition of, say, 112 SMs, a grid sized for 132 runs in two waves where one
would do (wave quantisation), and on a 12-SM partition some kernels it picks fail outright
(`CUBLAS_STATUS_EXECUTION_FAILED` was seen on the H200). cuBLAS has a per-handle setting for
exactly this case: the number of SMs to plan for (0 = the whole device).

The setting belongs to torch's cuBLAS handle of the calling thread (torch keeps one handle per
thread and device and only changes its stream), so the engine thread sets it before it launches
each phase's products: prefill SMs before a prefill slice, decode SMs before a split's decode
step or a split's decode-graph capture, 0 before whole-GPU work. It acts at launch time; a
captured CUDA graph keeps the kernels chosen when it was captured.

Where libcublas cannot be found or lacks the symbol, `BlasSmTarget.available` is False, `set`
does nothing, and `reason` says why (the engine logs it once: splits then run with kernels
planned for the whole device, as before).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger("greenlane.blas")


def _loaded_cublas_path() -> str | None:
    """The libcublas that this process has loaded (torch loads it with its first product)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(" ")[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


class BlasSmTarget:
    """`set(sms)` before launching products meant for `sms` SMs (0: the whole device)."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self.num_sets = 0  # calls that changed a handle's setting (tests and stats)
        self._fn = None
        self._local = threading.local()  # per thread, like torch's handles
        if not torch.cuda.is_available():
            self.reason = "no CUDA device"
            return
        # Make sure torch has created this thread's handle and loaded libcublas.
        torch.cuda.current_blas_handle()
        path = _loaded_cublas_path()
        if path is None:
            self.reason = "libcublas is not loaded in this process"
            return
        try:
            fn = ctypes.CDLL(path).cublasSetSmCountTarget
        except (OSError, AttributeError) as e:
            self.reason = f"{path} has no cublasSetSmCountTarget ({e})"
            return
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.available = True

    @property
    def current(self) -> int:
        """What the calling thread's handle is set to (0 = the whole device)."""
        return getattr(self._local, "sms", 0)

    def set(self, sms: int) -> None:
        """Plan the calling thread's next cuBLAS products for `sms` SMs (0: whole device)."""
        if self._fn is None or sms == self.current:
            return
        status = self._fn(ctypes.c_void_p(torch.cuda.current_blas_handle()), int(sms))
        if status != 0:
            # Not worth failing a step for: keep the kernels cuBLAS would pick anyway.
            log.warning("cublasSetSmCountTarget(%d) returned status %d; ignored", sms, status)
            return
        self._local.sms = sms
        self.num_sets += 1


_shared: BlasSmTarget | None = None
_shared_lock = threading.Lock()


def shared_blas_sm_target(enabled: bool = True) -> BlasSmTarget | None:
    """The process's one instance (None when disabled); says once why it is unavailable."""
    global _shared
    if not enabled:
        return None
    with _shared_lock:
        if _shared is None:
            _shared = BlasSmTarget()
            if _shared.available:
                log.info("cuBLAS products on a split are planned for its SM count")
            elif torch.cuda.is_available():
                log.warning(
                    "FALLBACK: cuBLAS products on a split are planned for the whole GPU (%s)",
                    _shared.reason,
                )
        return _shared
