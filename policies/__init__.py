"""Prefill-queue policies. Pure Python: this package never imports torch."""

from __future__ import annotations

from policies.base import Policy, WaitingView, prefill_work
from policies.fcfs import FCFS
from policies.jct import JCTModel
from policies.spf import DEFAULT_GAMMA_TOKENS_PER_S, SPF
from policies.srjf import DEFAULT_FAIRNESS_LAMBDA, SRJF

# Names accepted by `--prefill-policy` and the admin API; srjf-oneshot is the ablation;
# srjf-cold-fcfs ranks cold requests alike (arrival order among them; policies/srjf.py).
POLICY_NAMES = ("srjf", "spf", "fcfs", "srjf-oneshot", "srjf-cold-fcfs")


def make_policy(
    name: str,
    *,
    jct_model: JCTModel | None = None,
    gamma: float | None = None,
    fairness_lambda: float | None = None,
    latency_slo_s: float | None = None,
    **_ignored: object,
) -> Policy:
    """Build a policy by name; unknown names raise ValueError (the app turns that into a 400).

    `gamma` (tokens/s) only affects spf, `fairness_lambda` (s/s), `latency_slo_s` (s: each
    request ages by its own slack instead of one lambda) and `jct_model` only srjf;
    None means the policy default. Parameters meant for another policy are ignored so that
    callers can pass all engine settings whatever the policy.
    """
    if name == "fcfs":
        return FCFS()
    if name == "spf":
        return SPF(gamma=gamma)
    if name in ("srjf", "srjf-oneshot", "srjf-cold-fcfs"):
        return SRJF(
            jct_model,
            fairness_lambda=fairness_lambda,
            oneshot=name == "srjf-oneshot",
            latency_slo_s=latency_slo_s,
            cold_fcfs=name == "srjf-cold-fcfs",
        )
    raise ValueError(f"unknown prefill policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = [
    "DEFAULT_FAIRNESS_LAMBDA",
    "DEFAULT_GAMMA_TOKENS_PER_S",
    "FCFS",
    "JCTModel",
    "POLICY_NAMES",
    "SPF",
    "SRJF",
    "Policy",
    "WaitingView",
    "make_policy",
    "prefill_work",
]
