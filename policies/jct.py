"""The job-completion-time (JCT) model: predicted prefill seconds from (uncached, cached) tokens.

    predict_s(u, c) = a + b*u + k*u*(u/2 + c)

* `a` (seconds): per-forward floor -- streaming the weights once plus launch overhead.
* `b` (seconds per token): the token-wise work (projections, MLP), ~2*params FLOPs per token.
* `k` (seconds per query-key pair): attention. A prefill of `u` new tokens after `c` cached
  ones computes sum_{i=1..u} (c + i) ~= u*(u/2 + c) query-key pairs (causal mask).

A batch of prefills in one forward costs a + sum_i [b*u_i + k*u_i*(u_i/2 + c_i)]: the floor is
paid once, which is why short prompts are batched (`observe_batch`).

Pure Python (the policies package never imports torch). Fitting is a weighted least-squares
solve of a 3x3 system; weights are 1/measured^2 so the fit minimises *relative* error (the
samples span milliseconds to seconds and the scheduler cares about ratios). Coefficients are
kept non-negative by solving every subset of the three terms and keeping the best feasible one.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# The fallback default: Llama-3.1-8B, bf16, one H100/H200-class GPU (989 dense bf16 TFLOP/s).
# Derived from first principles, not measured; a calibration file replaces it.
#   token-wise FLOPs per token = 2 * 7.0e9 non-embedding parameters = 1.4e10
#       (the LM head runs on one token per scoring request, so it is left out)
#   attention FLOPs per query-key pair = 4 * num_layers * hidden = 4 * 32 * 4096 = 524,288
#       (QK^T and PV, 2 FLOPs per multiply-add each, over all query heads)
#   MFU assumptions: 50% for the GEMMs (495 TFLOP/s), 40% for attention (396 TFLOP/s)
#   b = 1.4e10 / 4.95e14 = 2.83e-5 s/token      (~35k tokens/s of uncached prefill)
#   k = 524,288 / 3.96e14 = 1.32e-9 s per pair
#   a = 5e-3 s: 16 GB of bf16 weights read once at ~3.3-4.8 TB/s (3.4-4.9 ms) plus launches
# Sanity: a 14k-token uncached prompt -> 0.005 + 0.40 + 0.13 = 0.53 s; 50k -> ~3.07 s.
# ---------------------------------------------------------------------------------------------
DEFAULT_PARAMS_NON_EMBEDDING = 7.0e9
DEFAULT_NUM_LAYERS = 32
DEFAULT_HIDDEN = 4096
DEFAULT_PEAK_FLOPS = 989e12
DEFAULT_MFU_GEMM = 0.50
DEFAULT_MFU_ATTENTION = 0.40
DEFAULT_A_S = 5e-3
DEFAULT_B_S_PER_TOKEN = 2 * DEFAULT_PARAMS_NON_EMBEDDING / (DEFAULT_PEAK_FLOPS * DEFAULT_MFU_GEMM)
DEFAULT_K_S_PER_PAIR = (
    4 * DEFAULT_NUM_LAYERS * DEFAULT_HIDDEN / (DEFAULT_PEAK_FLOPS * DEFAULT_MFU_ATTENTION)
)
# `a` for another shape (JCTModel.for_shape): its weights read once at the low end of the
# copy bandwidth, plus launches; 16.06 GB of Llama-3.1-8B bf16 weights -> 5.0 ms, DEFAULT_A_S.
DEFAULT_WEIGHT_READ_BYTES_PER_S = 3.3e12
DEFAULT_LAUNCH_S = 1.3e-4

# The JCT model's own format: an old standalone file (`jct-<device>--<model>.json`, still read)
# and the `jct` section of the one calibration file.
CALIBRATION_FORMAT = "greenlane-jct/1"
# The one calibration file per (device, model) (`calibration-<device>--<model>.json`, written by
# runtime/calibrate.py): `format`, `device`, `model`, and a section per model (`jct`: this
# model's `to_dict()`; `partition`: the SM-partition cost model's), either of which may be absent.
CALIBRATION_FILE_FORMAT = "greenlane-calibration/1"
JCT_SECTION = "jct"

_PRIOR_WEIGHT = 0.02  # weight of each prior pseudo-sample relative to one observation

# Feature scales keep the 3x3 normal equations well conditioned (u up to ~1e5, pairs ~1e10).
_SCALES = (1.0, 1e-3, 1e-9)


def attention_pairs(uncached_tokens: float, cached_tokens: float) -> float:
    """Query-key pairs of a causal prefill of `uncached_tokens` after `cached_tokens`."""
    return uncached_tokens * (uncached_tokens / 2.0 + cached_tokens)


@dataclass(frozen=True, slots=True)
class JCTSample:
    """One measurement: a forward over `items` ((uncached, cached) per request) took `seconds`."""

    items: tuple[tuple[int, int], ...]
    seconds: float

    def features(self) -> tuple[float, float, float]:
        u_sum = float(sum(u for u, _ in self.items))
        pairs = float(sum(attention_pairs(u, c) for u, c in self.items))
        return (1.0, u_sum, pairs)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (near-)singular."""
    n = len(rhs)
    m = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    if scale == 0.0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_coefficients(
    samples: Iterable[JCTSample], weights: Sequence[float] | None = None
) -> tuple[float, float, float] | None:
    """Non-negative weighted least squares for (a, b, k) minimising relative error.

    Returns None when the samples cannot determine any non-negative model.
    """
    rows: list[tuple[tuple[float, ...], float, float]] = []
    for i, s in enumerate(samples):
        if s.seconds <= 0.0 or not math.isfinite(s.seconds):
            continue
        w = (weights[i] if weights is not None else 1.0) / (s.seconds * s.seconds)
        x = tuple(f * sc for f, sc in zip(s.features(), _SCALES, strict=True))
        rows.append((x, s.seconds, w))
    if not rows:
        return None
    # Full normal equations once; every subset of terms is a sub-block of them.
    xtx = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in range(3)] for i in range(3)]
    xty = [sum(w * x[i] * y for x, y, w in rows) for i in range(3)]
    best: tuple[float, tuple[float, float, float]] | None = None
    for size in (3, 2, 1):
        for subset in itertools.combinations(range(3), size):
            sol = _solve([[xtx[i][j] for j in subset] for i in subset], [xty[i] for i in subset])
            if sol is None or any(v < 0.0 for v in sol):
                continue
            coef = [0.0, 0.0, 0.0]
            for idx, v in zip(subset, sol, strict=True):
                coef[idx] = v
            sse = sum(
                w * (y - sum(c * xi for c, xi in zip(coef, x, strict=True))) ** 2
                for x, y, w in rows
            )
            if best is None or sse < best[0] * (1 - 1e-12):
                best = (sse, (coef[0], coef[1], coef[2]))
        if best is not None and size == 3:
            break  # the unconstrained solution is feasible: it is the optimum
    if best is None:
        return None
    a, b, k = (c * sc for c, sc in zip(best[1], _SCALES, strict=True))
    return (a, b, k)


def file_slug(name: str) -> str:
    """A device or model name as it appears in calibration file names (lower case, runs of
    other characters than a-z, 0-9 and "." become "-")."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "unknown"


def one_calibration_filename(device_name: str, model_name: str) -> str:
    """File name of THE calibration file of a (device, model) pair (every model's section),
    e.g. `calibration-nvidia-h200--llama-3.1-8b.json`."""
    return f"calibration-{file_slug(device_name)}--{file_slug(model_name)}.json"


def calibration_filename(device_name: str, model_name: str) -> str:
    """The OLD JCT-only file name for a (device, model) pair, e.g. `jct-nvidia-h200--llama.json`
    (still read; new calibrations go to the one file, runtime/calibrate.py
    `calibration_file_name`)."""
    return f"jct-{file_slug(device_name)}--{file_slug(model_name)}.json"


class JCTModel:
    """Predicts prefill seconds; fitted offline (`fit`) and refined online (`observe`).

    Online refinement is a sliding-window refit: the base samples (a calibration profile, or
    pseudo-samples drawn from the prior coefficients when there is none) plus the last
    `window` observations are refitted every `refit_every` observations. Refits are cheap
    (a few 3x3 solves over <= base + window rows) and bounded, and the prior keeps a window of
    near-identical observations from collapsing the model.
    """

    def __init__(
        self,
        a_s: float = DEFAULT_A_S,
        b_s_per_token: float = DEFAULT_B_S_PER_TOKEN,
        k_s_per_pair: float = DEFAULT_K_S_PER_PAIR,
        *,
        device: str = "h100/h200-class (assumed)",
        model: str = "llama-3.1-8b",
        source: str = "fallback-default",
        window: int = 256,
        refit_every: int = 16,
        error_window: int = 100,
    ) -> None:
        self.a_s = a_s
        self.b_s_per_token = b_s_per_token
        self.k_s_per_pair = k_s_per_pair
        self.device = device
        self.model = model
        # "fallback-default", "fallback-shape" (for_shape), "fit", or "calibration:<path>"
        self.source = source
        self.window = window
        self.refit_every = refit_every
        self._base: list[JCTSample] = []
        # A measured profile counts as much as an observation; pseudo-samples of a prior only
        # regularise (they must not pull a well-observed device back towards the default).
        self._base_weight = 1.0
        self._recent: deque[JCTSample] = deque(maxlen=window)
        self._since_refit = 0
        self._errors: deque[float] = deque(maxlen=error_window)  # |pred - meas| / meas
        self.num_observed = 0

    # -- prediction -----------------------------------------------------------------------
    def predict_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted seconds to prefill `uncached_tokens` after `cached_tokens` of cached prefix."""
        u = max(0, uncached_tokens)
        return (
            self.a_s
            + self.b_s_per_token * u
            + self.k_s_per_pair * attention_pairs(u, max(0, cached_tokens))
        )

    def predict_batch_s(self, items: Iterable[tuple[int, int]]) -> float:
        """Predicted seconds for one forward over several prefills (the floor paid once)."""
        total = self.a_s
        for u, c in items:
            total += self.b_s_per_token * u + self.k_s_per_pair * attention_pairs(u, c)
        return total

    def predict_totals_s(self, uncached_tokens: float, attention_pairs: float) -> float:
        """Predicted seconds for one forward over prefills totalling `uncached_tokens` new
        tokens and `attention_pairs` query-key pairs (the floor paid once): the whole-GPU
        prefill of the SM-partition cost model (runtime/partition/cost_model.py), so that
        the splits and the chunks are predicted by one prefill model."""
        return (
            self.a_s
            + self.b_s_per_token * max(0.0, uncached_tokens)
            + self.k_s_per_pair * max(0.0, attention_pairs)
        )

    @property
    def calibrated(self) -> bool:
        """Fitted to this device (a calibration file or a profile), not a first-principles
        fallback (the default's or `for_shape`'s)."""
        return not self.source.startswith("fallback")

    @classmethod
    def for_shape(
        cls,
        *,
        non_embedding_params: float,
        num_layers: int,
        attention_width: int,
        weight_bytes: float,
        model: str,
    ) -> JCTModel:
        """The first-principles fallback for a model of this shape on an H100/H200-class GPU:
        the default's derivation (comment at DEFAULT_*) with this model's numbers instead of
        Llama-3.1-8B's, so an uncalibrated 3B model is not predicted at an 8B model's cost.
        `attention_width` = query heads x head dim; `weight_bytes` = all weights in memory.
        Derived, not measured: a calibration replaces it, online refinement corrects it."""
        return cls(
            a_s=weight_bytes / DEFAULT_WEIGHT_READ_BYTES_PER_S + DEFAULT_LAUNCH_S,
            b_s_per_token=2 * non_embedding_params / (DEFAULT_PEAK_FLOPS * DEFAULT_MFU_GEMM),
            k_s_per_pair=4
            * num_layers
            * attention_width
            / (DEFAULT_PEAK_FLOPS * DEFAULT_MFU_ATTENTION),
            model=model,
            source="fallback-shape",
        )

    def marginal_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds `uncached_tokens` add to a forward that runs anyway (a step with decodes
        already pays the floor `a`: the weights are read once for both)."""
        u = max(0, uncached_tokens)
        return self.b_s_per_token * u + self.k_s_per_pair * attention_pairs(
            u, max(0, cached_tokens)
        )

    def max_tokens_within(self, seconds: float, cached_tokens: int = 0) -> int:
        """The most new tokens whose `marginal_s` after `cached_tokens` fits in `seconds`."""
        if seconds <= 0.0:
            return 0
        b = self.b_s_per_token + self.k_s_per_pair * max(0, cached_tokens)
        k = self.k_s_per_pair
        if k <= 0.0:
            return int(seconds / b) if b > 0.0 else 1 << 62
        # k/2 u^2 + b u = seconds, the positive root
        return int((-b + math.sqrt(b * b + 2.0 * k * seconds)) / k)

    @property
    def coefficients(self) -> dict[str, float]:
        return {
            "a_s": self.a_s,
            "b_s_per_token": self.b_s_per_token,
            "k_s_per_pair": self.k_s_per_pair,
        }

    # -- fitting --------------------------------------------------------------------------
    def fit(self, samples: Iterable[tuple[int, int, float]] | Iterable[JCTSample]) -> None:
        """Least-squares fit from (uncached, cached, seconds) triples or `JCTSample`s.

        The samples become the base that online refinement refits together with new
        observations. Raises ValueError if no non-negative model fits them.
        """
        base = [
            s if isinstance(s, JCTSample) else JCTSample(((int(s[0]), int(s[1])),), float(s[2]))
            for s in samples
        ]
        coef = fit_coefficients(base)
        if coef is None:
            raise ValueError("JCT fit failed: need positive timings over at least one term")
        self.a_s, self.b_s_per_token, self.k_s_per_pair = coef
        self._base = base
        self._base_weight = 1.0
        self._recent.clear()
        self.source = "fit"

    def adopt(self, other: JCTModel) -> None:
        """Take `other`'s coefficients, profile, keys and source in place.

        For a calibration run on an engine that already shares this object with its policies
        (`serve --calibrate`): they keep their reference and see the new model. Online
        observations made so far are dropped (they were judged against the old model)."""
        self.a_s, self.b_s_per_token, self.k_s_per_pair = (
            other.a_s,
            other.b_s_per_token,
            other.k_s_per_pair,
        )
        self.device, self.model, self.source = other.device, other.model, other.source
        self._base = list(other._base)
        self._base_weight = other._base_weight
        self._recent.clear()
        self._errors.clear()
        self._since_refit = 0
        self.num_observed = 0

    def _prior_samples(self) -> list[JCTSample]:
        """Pseudo-samples from the current coefficients (used when there is no profile)."""
        grid = [(u, c) for u in (64, 512, 4096, 16384) for c in (0, 16384)]
        return [JCTSample(((u, c),), self.predict_s(u, c)) for u, c in grid]

    def observe(self, uncached_tokens: int, cached_tokens: int, measured_s: float) -> None:
        """Record one measured single-request prefill; refits every `refit_every` calls."""
        self.observe_batch([(uncached_tokens, cached_tokens)], measured_s)

    def observe_batch(self, items: Sequence[tuple[int, int]], measured_s: float) -> None:
        """Record a measured forward over several prefills ((uncached, cached) each)."""
        if measured_s <= 0.0 or not math.isfinite(measured_s) or not items:
            return
        predicted = self.predict_batch_s(items)
        self._errors.append(abs(predicted - measured_s) / measured_s)
        self._recent.append(JCTSample(tuple((int(u), int(c)) for u, c in items), measured_s))
        self.num_observed += 1
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        self._since_refit = 0
        if not self._base:
            self._base = self._prior_samples()
            self._base_weight = _PRIOR_WEIGHT
        weights = [self._base_weight] * len(self._base) + [1.0] * len(self._recent)
        coef = fit_coefficients([*self._base, *self._recent], weights)
        if coef is not None:  # keep the old coefficients rather than adopt a degenerate fit
            self.a_s, self.b_s_per_token, self.k_s_per_pair = coef

    def mape(self) -> float | None:
        """Mean absolute percentage error (as a fraction) of the last predictions, or None."""
        if not self._errors:
            return None
        return sum(self._errors) / len(self._errors)

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        return {
            "format": CALIBRATION_FORMAT,
            "device": self.device,
            "model": self.model,
            "created_unix_s": time.time(),
            "coefficients": self.coefficients,
            "samples": [
                {"items": [list(it) for it in s.items], "seconds": s.seconds} for s in self._base
            ],
        }

    def save(self, path: str) -> None:
        """Write this model alone as a standalone `greenlane-jct/1` file (atomically: temp file
        + rename), which every reader accepts. The profiler writes the one calibration file
        instead (runtime/calibrate.py `write_section`, this model's `to_dict()` as its `jct`
        section)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, *, device: str | None = None, model: str | None = None) -> JCTModel:
        """Read a calibration file: the one file's `jct` section, or an old standalone
        `greenlane-jct/1` file. When `device`/`model` are given they must match its keys.
        ValueError: another format, or a one file without a `jct` section."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("format") == CALIBRATION_FILE_FORMAT:
            data = data.get(JCT_SECTION)
            if not isinstance(data, dict):
                raise ValueError(f"{path}: this calibration file has no {JCT_SECTION} section")
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(
                f"{path}: not a {CALIBRATION_FILE_FORMAT} file with a {JCT_SECTION} section "
                f"nor a {CALIBRATION_FORMAT} one"
            )
        return cls.from_dict(data, source=f"calibration:{path}", device=device, model=model)

    @classmethod
    def from_dict(
        cls,
        data: dict,
        *,
        source: str,
        device: str | None = None,
        model: str | None = None,
    ) -> JCTModel:
        """The model of a `to_dict()` (a `jct` section); `device`/`model` as in `load`."""
        where = source.removeprefix("calibration:")
        if device is not None and data["device"] != device:
            raise ValueError(f"{where}: calibrated on {data['device']!r}, not {device!r}")
        if model is not None and data["model"] != model:
            raise ValueError(f"{where}: calibrated for {data['model']!r}, not {model!r}")
        coef = data["coefficients"]
        jct = cls(
            float(coef["a_s"]),
            float(coef["b_s_per_token"]),
            float(coef["k_s_per_pair"]),
            device=data["device"],
            model=data["model"],
            source=source,
        )
        jct._base = [
            JCTSample(tuple((int(u), int(c)) for u, c in s["items"]), float(s["seconds"]))
            for s in data.get("samples", [])
        ]
        return jct

    @classmethod
    def for_device(cls, directory: str, device: str, model: str) -> JCTModel:
        """The calibration for (device, model) from `directory` (the one file's `jct` section,
        else the old `jct-...json`), else the fallback default."""
        one = os.path.join(directory, one_calibration_filename(device, model))
        if os.path.exists(one):
            with open(one, encoding="utf-8") as f:
                has_jct = JCT_SECTION in json.load(f)  # it may hold only the partition section
            if has_jct:
                return cls.load(one, device=device, model=model)
        old = os.path.join(directory, calibration_filename(device, model))
        if os.path.exists(old):
            return cls.load(old, device=device, model=model)
        return cls()

    def __repr__(self) -> str:
        return (
            f"JCTModel(a_s={self.a_s:.4g}, b_s_per_token={self.b_s_per_token:.4g}, "
            f"k_s_per_pair={self.k_s_per_pair:.4g}, source={self.source!r})"
        )
