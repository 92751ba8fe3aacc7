"""One decision per MoE call: which family runs the experts, and which kernel family runs each expert GEMM, with
every declined family's reason.

Two ordered walks (``backends.choose``) over families that each say why they cannot take a call:

- ``LAYER_BACKENDS``: the kernel layer (``moe/layer.py``: the GPU token sort and the grouped GEMMs, or the one-launch
  decode kernel for a few tokens without autograd) or the PyTorch reference (``moe/reference.py``); the ``backend``
  argument of the front doors names one of them, or "auto".
- ``GEMM_BACKENDS``: per expert GEMM of the kernel layer (``gemms.GEMMS``: the forward's up and down, the backward's
  dh with the SwiGLU backward, dx, dw1, dw2) the first family that takes it; its plan is the runner the layer calls.

The plan is made once, before any work, and carried by the call: the forward runs it and keeps it for the backward
(``layer.SavedForBackward``), ``describe`` renders it, and nothing derives it again. (Under torch.compile the
backward is a custom op that receives tensors only: it asks this planner again, on the same tensors.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashmoe_science.architectures import MOE_GEMMS
from flashmoe_science.backends import Choice, choose
from flashmoe_science.device import triton_interpreter_on
from flashmoe_science.moe.gemms import BACKWARD_GEMMS, FORWARD_GEMMS, GemmProblem, TritonGemms
from flashmoe_science.moe.tiles import COMBINES, MoETiles, check_combine, choose_combine, choose_tiles

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The expert GEMMs' families, in the order they are asked: the architectures' own, then the portable kernels.
GEMM_BACKENDS = (*MOE_GEMMS, TritonGemms())


@dataclass(frozen=True)
class KernelPlan:
    """The kernel layer's plan: the tiles, and each planned GEMM's family (``Choice.plan`` is its runner). A plan
    for inference holds the forward's GEMMs only; ``decode``: the one-launch decode kernel runs the whole layer
    instead (no tiles, no GEMMs)."""

    tiles: MoETiles | None
    gemms: tuple[tuple[str, Choice], ...] = ()
    decode: bool = False
    combine_why: str = ""  # why tiles.combine (``combine_reason``)

    def choice(self, gemm: str) -> Choice:
        for name, choice in self.gemms:
            if name == gemm:
                return choice
        raise ValueError(f"this plan has no {gemm!r} GEMM (planned: {[name for name, _ in self.gemms]}): "
                         "plan the backward with training=True")

    def runner(self, gemm: str):
        """What the layer calls for ``gemm`` (see ``moe/gemms.py``)."""
        return self.choice(gemm).plan

    @property
    def trains(self) -> bool:
        """Whether the backward's GEMMs are planned (a training call's plan)."""
        return any(name in BACKWARD_GEMMS for name, _ in self.gemms)


def plan_kernels(x, w1, w2, top_k: int, tiles: MoETiles | None = None, training: bool = False) -> KernelPlan:
    """The kernel layer's plan for checked x (T, d), w1 (E, 2F, d), w2 (E, d, F) and top_k: ``tiles`` (default
    ``tiles.choose_tiles``; the tile sweep passes its candidates), each forward GEMM's family and, with
    ``training``, each backward GEMM's."""
    if tiles is None:
        tiles = default_tiles(x, w1, top_k)
    check_combine(tiles)
    names = FORWARD_GEMMS + (BACKWARD_GEMMS if training else ())
    return KernelPlan(tiles, tuple((name, choose(GEMM_BACKENDS, GemmProblem(name, x, w1, w2, top_k, tiles)))
                                   for name in names), combine_why=combine_reason(x, w1, top_k, tiles))


def default_tiles(x, w1, top_k: int) -> MoETiles:
    """``tiles.choose_tiles`` for the call's dims, device and operand size."""
    num_experts, two_d_ff, _ = w1.shape
    return choose_tiles(x.shape[0], top_k, num_experts, x.shape[1], two_d_ff // 2, x.device, x.element_size())


def combine_reason(x, w1, top_k: int, tiles: MoETiles) -> str:
    """Why ``tiles.combine`` (``tiles.choose_combine``'s reason, or that the tiles were given with another)."""
    mode, why = choose_combine(x.shape[0], top_k, x.shape[1], w1.shape[1] // 2, tiles.block_m)
    return why if mode == tiles.combine else f"as the tiles give it (the heuristic would take {mode!r}: {why})"


@dataclass(frozen=True)
class ExpertsProblem:
    """A checked call of the experts: x (T, d), w1 (E, 2F, d), w2 (E, d, F), top_k, the ``backend`` asked for, and
    whether autograd records it (``training``: the backward is planned too, and the decode kernel is out)."""

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    top_k: int
    backend: str = "auto"
    training: bool = False


def triton_refusal(x, backend: str) -> str | None:
    """Why the Triton kernels cannot run on x (or None): triton missing, x's dtype, a CPU tensor without the
    interpreter or under "auto" (which runs them on CUDA tensors only)."""
    if not _triton_importable():
        return "triton is not installed"
    if x.dtype not in TRITON_DTYPES:
        return f"x is {x.dtype}: the Triton kernels take float16, bfloat16 and float32"
    if not x.is_cuda:
        if backend == "auto":
            return f"x is on {x.device.type}: 'auto' runs the Triton kernels on CUDA tensors only"
        if not triton_interpreter_on():
            return f"x is on {x.device.type}: the Triton kernels need a CUDA device, or TRITON_INTERPRET=1"
    return None


class KernelLayer:
    """The Triton kernels (and the families of ``GEMM_BACKENDS`` behind them): CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1 when asked for by name."""

    name = "triton"

    def decline(self, problem: ExpertsProblem) -> str | None:
        return triton_refusal(problem.x, problem.backend)

    def plan(self, problem: ExpertsProblem) -> KernelPlan:
        """The decode kernel, or the tiles (``plan_experts`` then plans each GEMM's family)."""
        from flashmoe_science.moe.triton_decode import decode_applies

        if not problem.training and decode_applies(problem.x.shape[0], problem.w1.shape[0]):
            return KernelPlan(None, decode=True)
        return KernelPlan(default_tiles(problem.x, problem.w1, problem.top_k))


class Reference:
    """The PyTorch reference (float32 accumulation, autograd through PyTorch): any device and dtype."""

    name = "reference"

    def decline(self, problem: ExpertsProblem) -> str | None:
        return None

    def plan(self, problem: ExpertsProblem) -> None:
        return None


LAYER_BACKENDS = (KernelLayer(), Reference())
BACKENDS = ("auto", *(backend.name for backend in LAYER_BACKENDS))


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def plan_experts(problem: ExpertsProblem, gemms: bool = True) -> Choice:
    """The call's plan: the layer family (``Choice.backend``: "triton" or "reference") with its ``KernelPlan``
    (None for the reference) and the reasons of the families declined before it. A ``backend`` named explicitly
    that cannot take the call raises ValueError (``backends.NoBackend``) with its reason. ``gemms=False``: the
    family and the tiles alone, without each GEMM's family (whose checks read the weights' addresses, which the
    tensors of a torch.compile fake implementation do not have)."""
    check_backend(problem.backend)
    choice = choose(LAYER_BACKENDS, problem, problem.backend)
    kernels = choice.plan
    if not gemms or kernels is None or kernels.decode:
        return choice
    return replace(choice, plan=plan_kernels(problem.x, problem.w1, problem.w2, problem.top_k, kernels.tiles,
                                             problem.training))


def describe(plan: Choice) -> str:
    """``plan_experts``' plan in sentences: the layer's family, then each GEMM's kernel and why the families before
    it declined."""
    lines = [f"experts: {plan.backend}"]
    lines += [f"  not {name}: {why}" for name, why in plan.declined]
    kernels = plan.plan
    if kernels is None:
        lines.append("  reference.fused_experts_reference (PyTorch, float32 accumulation)")
    elif kernels.decode:
        lines.append("  triton_decode.decode_forward: the whole layer in one launch (few tokens, no autograd)")
    else:
        for name, choice in kernels.gemms:
            lines.append(f"  {name}: {choice.backend}: {choice.plan.describe(kernels.tiles)}")
            lines += [f"    not {family}: {why}" for family, why in choice.declined]
            if choice.fallback is not None:
                lines.append(f"    where its build fails on this triton (once, remembered): {choice.fallback.backend}: "
                             f"{choice.fallback.plan.describe(kernels.tiles)}")
        combine = kernels.tiles.combine
        lines.append(f"  combine of down and dx: {combine}: {COMBINES[combine]}")
        if kernels.combine_why:
            lines.append(f"    why: {kernels.combine_why}")
    return "\n".join(lines)
