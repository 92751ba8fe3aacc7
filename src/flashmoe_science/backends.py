"""The contract every kernel family meets, and the one walk over them that picks a family for a call.

A kernel family (the Gluon sm_90 kernels, the portable Triton kernels, the PyTorch reference; the same for the MoE
GEMMs) is a ``Backend``: it says why it cannot take a checked problem (``decline``, None when it can) and, when it
can, plans the call (``plan``: tiles and schedule for the forward and the backward alike). ``choose`` walks an
ordered list of backends and returns the first that takes the problem, with every earlier family's reason, so that
``describe_dispatch``/``info`` render the decision instead of deriving it again. Nothing here names an architecture:
the ordered lists live beside the front doors that own them (the architectures' families in ``architectures.py``).

Some kernels are built at their first launch (Gluon's), and a build can fail on a triton outside the tested range.
Their plans have a ``fallback`` field: the walk fills it with the plan of the first later family that takes the same
call (None where the family was asked for by name: the failure then raises), so the fallback is the planner's
decision, with the reasons, and ``describe_dispatch`` shows it before the call runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Generic, Protocol, Sequence, TypeVar

P = TypeVar("P")  # a checked problem
K = TypeVar("K", covariant=True)  # what a backend plans for it


class Backend(Protocol[P, K]):
    """A kernel family behind a front door."""

    name: str

    def decline(self, problem: P) -> str | None:
        """Why this family does not take ``problem`` (a phrase that completes "not <name>: ..."), or None."""

    def plan(self, problem: P) -> K:
        """The family's plan for a problem it takes (only called when ``decline`` returned None)."""


@dataclass(frozen=True)
class Choice(Generic[K]):
    """The family that takes a call, its plan, and why each family before it in the walk declined."""

    backend: str
    plan: K
    declined: tuple[tuple[str, str], ...] = ()
    fallback: Choice | None = None  # the plan.fallback's choice: which family, and why the ones between declined

    def why_not(self, name: str) -> str | None:
        """The reason ``name`` declined this call, or None when it was not asked (or took it)."""
        return dict(self.declined).get(name)


class NoBackend(ValueError):
    """No family in the walk takes the call: the message lists each one's reason."""


def choose(backends: Sequence[Backend], problem, requested: str = "auto") -> Choice:
    """The first backend of ``backends`` that takes ``problem``; ``requested`` other than "auto" walks that one
    alone (its refusal raises NoBackend naming the reason, as a requested backend must not be swapped silently)."""
    walk = backends if requested == "auto" else [b for b in backends if b.name == requested]
    if not walk:
        raise NoBackend(f"backend must be 'auto' or one of {[b.name for b in backends]}, got {requested!r}")
    declined = []
    for index, backend in enumerate(walk):
        reason = backend.decline(problem)
        if reason is None:
            plan = backend.plan(problem)
            fallback = None
            if builds_at_launch(plan) and index + 1 < len(walk):
                fallback = choose(walk[index + 1:], problem)
                plan = replace(plan, fallback=fallback.plan)
            return Choice(backend.name, plan, tuple(declined), fallback)
        declined.append((backend.name, reason))
    raise NoBackend("; ".join(f"backend={name!r} cannot take this call: {why}" for name, why in declined))


def builds_at_launch(plan) -> bool:
    """Whether ``plan`` runs a kernel whose build may fail at its first launch: it has a ``fallback`` field."""
    return "fallback" in getattr(type(plan), "__dataclass_fields__", ())
