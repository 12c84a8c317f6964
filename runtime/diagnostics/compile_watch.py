"""Kernel variants compiled while serving: first uses the start-up did not cover.

Why: a Triton kernel compiles a variant on the first call of each specialization (its integer
arguments' divisibility, its constants), 150-300 ms of host time on the engine thread with the
decodes beside it waiting. Start-up compiles what it runs: the decode graphs, the prefill
graphs' buckets, the prefill warm-up and the forms of a chat's first chunked steps
(runtime/startup.py `warm_up_forms`). A variant compiled later is a form that list missed. On
the H200 at `bf68d3a` two such variants stalled eight chats for 160-300 ms
(docs/benchmarks.md, "GPU tests at `bf68d3a` / `3ba50cc`"); nothing said so but a test.

`CompileWatch` counts the compiled variants in the kernels' own caches (Triton's per-device
`device_caches`), from a mark at the start of serving, at the stats rate (O(kernels), nothing
per step), and says in the log which kernel grew, once per growth. Where the Triton in use
keeps no such cache (its interpreter on a CPU) the count is None: unknown, not zero."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType
from typing import Any

log = logging.getLogger("greenlane.compile")


def _variants(kernel: Any) -> int | None:
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        return None
    return sum(len(entry[0]) for entry in caches.values())


def triton_kernels(modules: Iterable[ModuleType]) -> dict[str, Any]:
    """The Triton kernels defined in `modules` whose compiled variants can be counted, by
    qualified name."""
    out = {}
    for mod in modules:
        for name, obj in vars(mod).items():
            if _variants(obj) is not None:
                out[f"{mod.__name__}.{name}"] = obj
    return out


class CompileWatch:
    """Compiled variants of `kernels` ({name: Triton kernel}) since `mark()`."""

    def __init__(self, kernels: dict[str, Any]) -> None:
        self._kernels = kernels
        self._base: dict[str, int] | None = None  # None until `mark()`: start-up is not serving
        self._said: dict[str, int] = {}

    def _counts(self) -> dict[str, int]:
        counts = {name: _variants(k) for name, k in self._kernels.items()}
        return {name: n for name, n in counts.items() if n is not None}

    def mark(self) -> None:
        """Serving starts now: later variants count."""
        self._base = self._counts()
        self._said = dict(self._base)

    def compiled_since_mark(self) -> int | None:
        """Variants compiled since `mark()`, all kernels; None before it and when none can be
        counted. Says in the log (a warning) each kernel that grew since it was last said."""
        if not self._kernels or self._base is None:
            return None
        counts = self._counts()
        grew = {n: c for n, c in counts.items() if c > self._said.get(n, 0)}
        if grew:
            log.warning(
                "compiled while serving (a first use the start-up did not cover, paid on the "
                "engine thread): %s",
                ", ".join(f"{n} +{c - self._said.get(n, 0)}" for n, c in sorted(grew.items())),
            )
            self._said.update(grew)
        return sum(c - self._base.get(n, 0) for n, c in counts.items())
