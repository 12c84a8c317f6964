"""Prefill-queue policies. Pure Python: this package never imports torch."""

from __future__ import annotations

from policies.base import Policy, WaitingView
from policies.fcfs import FCFS

POLICY_NAMES = ("srjf", "spf", "fcfs")


def make_policy(name: str, **params: float | None) -> Policy:
    """Build a policy by name; unknown names raise ValueError (the app turns that into a 400)."""
    if name == "fcfs":
        return FCFS()
    raise ValueError(f"unknown prefill policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = ["FCFS", "POLICY_NAMES", "Policy", "WaitingView", "make_policy"]
