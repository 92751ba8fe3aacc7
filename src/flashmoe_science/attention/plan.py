"""The planner: one decision per attention call, forward and backward together, with the reason for each.

A checked problem (`problem.AttentionProblem`) goes to `plan_attention`, which walks the ordered backend list with
`backends.choose`: the first family that takes the call plans its forward (tiles, schedule). The backward is chosen
by the same walk over the families' backward halves, starting at the family asked for (all of them for "auto"), the
first time a backward needs it (autograd, `attention_backward_lse`), so inference calls pay nothing for it.
`describe` renders a `Plan` as the sentences of `describe_dispatch` / `flashmoe-science info`; the execute layer
(`attention.autograd`, `attention.call`) runs `plan.forward` and `plan.backward`. Nothing else decides a kernel: a
kernel built at its first launch carries the walk's plan for a failed build (`backends.choose`), which `describe`
shows with the rest.

FP8 calls walk `FP8_BACKENDS`: the e4m3 kernels, else the dequantised inputs planned as a dense call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from flashmoe_science.architectures import ATTENTION, ATTENTION_FP8
from flashmoe_science.attention.autograd import forward
from flashmoe_science.attention.checks import KERNEL_DTYPES, check_backend, check_triton_layout
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.problem import AttentionProblem
from flashmoe_science.attention.reference_backend import REFERENCE
from flashmoe_science.attention.triton.backend import TRITON, TRITON_FP8
from flashmoe_science.backends import Choice, NoBackend, choose
from flashmoe_science.device import triton_interpreter_on

# The ordered backend list: the first family that takes a call runs it (an architecture's own kernels first:
# architectures.py).
ATTENTION_BACKENDS = (*ATTENTION, TRITON, REFERENCE)
BACKENDS = ("auto", *(b.name for b in ATTENTION_BACKENDS))  # what `backend=` takes


@dataclass(frozen=True)
class Dispatch:
    """Which implementation a call runs, and why (shown by `flashmoe-science info`): the forward's backend, kernel
    and tiles, and the backward's backend and kernel."""

    backend: str  # a name of ATTENTION_BACKENDS
    kernel: str
    reason: str
    tiles: dict | None = None
    backward_backend: str | None = None
    backward_kernel: str | None = None


@dataclass(frozen=True)
class BackwardQuestion:
    """What a family's backward half decides on: the call, and the forward that ran."""

    problem: AttentionProblem
    forward: object


class Plan:
    """The decision for one call: `forward` (the chosen family's forward plan, which runs itself), `backward` (its
    backward plan, chosen on first use), and why the families before each one declined (`forward_choice`,
    `backward_choice`: `backends.Choice`)."""

    def __init__(self, problem: AttentionProblem, forward_choice: Choice, backward_walk: tuple):
        self.problem = problem
        self.forward_choice = forward_choice
        self.forward = forward_choice.plan
        self.backend = forward_choice.backend
        self._backward_walk = backward_walk

    @cached_property
    def backward_choice(self) -> Choice:
        """The backward halves' walk; a family asked for by name walks alone, as in the forward: its refusal raises
        NoBackend (ValueError) naming `backend=` and the reason."""
        requested = self.problem.backend
        try:
            return choose(self._backward_walk, BackwardQuestion(self.problem, self.forward), requested)
        except NoBackend as error:
            raise NoBackend(f"{error} (in the backward; backend='auto' runs another family's backward there)") from None

    @property
    def backward(self):
        return self.backward_choice.plan


def _by_name(name: str):
    return next(b for b in ATTENTION_BACKENDS if b.name == name)


def plan_attention(problem: AttentionProblem) -> Plan:
    """The plan of a checked dense or packed call. A backend asked for by name that cannot take the call raises
    (ValueError; TypeError for a dtype no kernel runs) instead of being swapped for another."""
    requested = problem.backend
    check_backend(requested, BACKENDS)
    q = problem.q
    if requested != "auto" and _by_name(requested).runs_kernels:
        if not q.is_cuda and not triton_interpreter_on():
            raise ValueError(
                f"backend={requested!r} needs CUDA tensors, or TRITON_INTERPRET=1 to run the Triton kernels on the "
                f"CPU (slow; for tests), got tensors on {q.device}")
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"backend={requested!r} supports bfloat16, float16 and float32, got {q.dtype}")
    forward = choose(ATTENTION_BACKENDS, problem, requested)
    if not forward.plan.differentiable:
        check_triton_layout(problem.q, problem.k, problem.v)
    start = 0 if requested == "auto" else ATTENTION_BACKENDS.index(_by_name(requested))
    return Plan(problem, forward, tuple(b.backward for b in ATTENTION_BACKENDS[start:]))


def policy_table() -> str:
    """The README's "which kernel runs" table: one row per family of ATTENTION_BACKENDS, in the walk's order, from
    each family's `policy` (what it takes, its forward, its backward). benchmarks/tools/benchmarks_doc.py writes
    it into the README and tests/test_docs.py checks it there."""
    rows = ["| inputs | forward | backward |", "|---|---|---|"]
    rows += [f"| {' | '.join(family.policy)} |" for family in ATTENTION_BACKENDS]
    return "\n".join(rows) + "\n"


def _declined(choice: Choice, walk) -> str:
    titles = {b.name: b.title for b in walk}
    return "".join(f" (not {titles[name]}: {why})" for name, why in choice.declined)


def _fallback(choice: Choice, walk, rule: str = "") -> str:
    """The sentence of a plan's fallback (`backends.choose`): what runs where its kernel does not build at the first
    launch (`rule`: what else only the launch sees), or nothing."""
    fallback = choice.fallback
    if fallback is None:
        return ""
    title = next(b.title for b in walk if b.name == fallback.backend)
    return (f"; {rule + ' or ' if rule else ''}where its build fails on this triton (once, remembered): {title}"
            + _declined(fallback, walk))


def describe(plan: Plan) -> Dispatch:
    """`describe_dispatch`'s sentences for a plan."""
    problem, forward = plan.problem, plan.forward
    on_gpu = problem.q.is_cuda  # on the CPU the declines only say "no GPU"
    requested = "auto picks" if problem.backend == "auto" else "requested:"
    names = sorted(problem.feature_names())
    with_features = f" with {', '.join(names)}" if names else ""
    declined = _declined(plan.forward_choice, ATTENTION_BACKENDS) if on_gpu else ""
    reason = forward.describe(problem, requested, with_features, declined)
    reason += _fallback(plan.forward_choice, ATTENTION_BACKENDS)
    try:
        backward_choice = plan.backward_choice
    except NoBackend as error:  # a family asked for by name whose backward half declines: a backward raises
        reason += f"; a backward raises: {error}"
        return Dispatch(plan.backend, forward.kernel, reason, forward.tiles.as_dict() if forward.tiles else None)
    backward = backward_choice.plan
    if not forward.differentiable:
        halves = [b.backward for b in ATTENTION_BACKENDS]
        reason += f"; the backward runs {backward.title}" + (" too" if backward.backend == plan.backend else "")
        if on_gpu:
            reason += _declined(backward_choice, halves)
        reason += _fallback(backward_choice, halves, getattr(backward, "launch_rule", ""))
    return Dispatch(plan.backend, forward.kernel, reason, forward.tiles.as_dict() if forward.tiles else None,
                    backward.backend, backward.kernel)


# ------------------------------------------------------------------------------------------------------- FP8
@dataclass(frozen=True)
class DequantisedForward:
    """The FP8 call's inputs dequantised (bf16 on a GPU, float32 on the CPU) and planned as a dense call."""

    problem: AttentionProblem
    plan: Plan
    backend = "dequantised"

    @property
    def kernel(self) -> str:
        return self.plan.forward.kernel

    def run(self, fp8):
        out, lse = forward(self.plan)
        return out.to(torch.bfloat16), lse


class _Dequantised:
    """Takes every FP8 call: dequantise, then the dense walk (slow, never wrong)."""

    name = "dequantised"
    title = "the dequantised inputs"

    def decline(self, problem) -> str | None:
        return None

    def plan(self, fp8) -> DequantisedForward:
        from flashmoe_science.attention.fp8 import dequantize

        dtype = torch.bfloat16 if fp8.q.is_cuda else torch.float32
        q, k, v = (dequantize(t, d, dtype) for t, d in zip((fp8.q, fp8.k, fp8.v), fp8.descales))
        dense = AttentionProblem(q, k, v, q, k, v, fp8.softmax_scale, CallFeatures(mask=make_mask(fp8.causal)),
                                 "reference" if fp8.backend == "reference" else "auto")
        return DequantisedForward(dense, plan_attention(dense))


DEQUANTISED = _Dequantised()
# The FP8 walk: the e4m3 kernels, else the dequantised inputs (backend="reference": those alone, on the reference).
FP8_BACKENDS = (*ATTENTION_FP8, TRITON_FP8, DEQUANTISED)


def describe_fp8(choice: Choice) -> Dispatch:
    """`describe_dispatch`'s sentences for an FP8 call's plan (`plan_fp8`): the e4m3 kernel, or the dequantised
    inputs and the dense plan they get."""
    plan = choice.plan
    declined = _declined(choice, FP8_BACKENDS) if plan.backend == DEQUANTISED.name else ""
    if isinstance(plan, DequantisedForward):
        dense = describe(plan.plan)
        return Dispatch(dense.backend, dense.kernel, f"FP8 inputs dequantised{declined}; then {dense.reason}",
                        dense.tiles)
    declined = _declined(choice, FP8_BACKENDS) if choice.declined else ""
    return Dispatch(plan.backend, plan.kernel,
                    f"FP8 (e4m3, forward only): {plan.describe()}{declined}{_fallback(choice, FP8_BACKENDS)}",
                    plan.tiles.as_dict() if plan.tiles else None)


def plan_fp8(problem) -> Choice:
    """The plan of a checked FP8 call (`fp8.Fp8Problem`): `choice.plan.run(problem)` gives (out, lse)."""
    kernels = [b.name for b in FP8_BACKENDS if b is not DEQUANTISED]
    if problem.backend not in ("auto", "reference", *kernels):
        raise ValueError(f"FP8 attention runs backend 'auto', {', '.join(map(repr, kernels))} or 'reference', "
                         f"got {problem.backend!r}")
    return choose(FP8_BACKENDS, problem, DEQUANTISED.name if problem.backend == "reference" else problem.backend)
