"""The portable Triton backend: the forward (fwd.py) and backward (bwd.py) kernels on any CUDA GPU, and on
CPU tensors under TRITON_INTERPRET=1 when asked for by name.

`TRITON` meets the `backends.Backend` contract for the forward and, through `TRITON.backward`, for the backward;
its plans (`TritonForward`, `TritonBackward`) hold the tiles and run the kernels; the planner's walk also makes them
the planned fallback of a family before this one whose kernels may fail to build. `TRITON_FP8` is the e4m3 forward
(`fp8.py`) in the FP8 walk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashmoe_science.attention.layout import tma_compatible
from flashmoe_science.attention.problem import new_outputs
from flashmoe_science.attention.record import ran
from flashmoe_science.attention.tiles import (
    AttentionTiles,
    BackwardTiles,
    autotune_enabled,
    backward_tiles,
    forward_tiles,
    padded_head_dim,
)
from flashmoe_science.device import check_interpreter_operands, device_traits

FORWARD_KERNEL = "triton.fwd._attention_forward_kernel"
BACKWARD_KERNEL = "triton.bwd.attention_backward"
FP8_KERNEL = "triton.fp8.attention_forward_fp8"


@dataclass(frozen=True)
class TritonForward:
    """The Triton forward kernel with these tiles (`tiles.use_tma`: TMA descriptors, else pointer loads)."""

    tiles: AttentionTiles
    backend = "triton"
    kernel = FORWARD_KERNEL
    differentiable = False  # autograd runs it through attention.autograd

    def run(self, q, k, v, features, softmax_scale, out=None, lse=None):
        """(out, lse) on checked 4-D views (written into `out`, `lse` where given)."""
        from flashmoe_science.attention.triton.fwd import attention_forward

        check_interpreter_operands("q", q)
        if lse is None:
            out, lse = new_outputs(q, features, out)
        ran("forward", self.backend, self.kernel)
        attention_forward(q, k, v, out, lse, features, softmax_scale, self.tiles)
        return out, lse

    def launch(self, prepared, q, k, v, features=None, out=None, lse=None):
        """(out, lse) of a call through its signature's PreparedLaunch (`prepare`'s)."""
        if lse is None:
            out, lse = new_outputs(q, features, out)
        ran("forward", self.backend, self.kernel)
        prepared(q, k, v, out, lse)
        return out, lse

    def prepare(self, q, k, v, out, lse, features, softmax_scale: float):
        """This launch as a PreparedLaunch for the next call of its signature, called as `prepared(q, k, v, out,
        lse)`; None for calls with features beyond the plain causal mask (their arguments are per call)."""
        from flashmoe_science.attention.triton.fwd import prepare_forward

        if not features.is_plain:
            return None
        return prepare_forward(q, k, v, out, lse, features.causal, softmax_scale, self.tiles)

    def describe(self, problem, requested: str, with_features: str, declined: str) -> str:
        q = problem.q
        traits = device_traits(q.device)
        where = "the Triton interpreter" if not q.is_cuda else traits.arch
        tuned = q.is_cuda and autotune_enabled() and problem.features.is_plain
        tiles = self.tiles
        shape = f"tiles {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages"
        return (f"{requested} the portable Triton kernel{with_features} on {where}" + declined
                + ("; FLASHMOE_AUTOTUNE=1: tiles searched per shape, " if tuned else f"; {shape}, ")
                + ("TMA descriptors" if tiles.use_tma else "pointer loads"))


def forward_plan(q, k, v, features) -> TritonForward:
    """The Triton forward's plan for checked q, k, v."""
    tiles = forward_tiles(q.shape[-1], q.dtype, features.causal, device_traits(q.device))
    # decided here, once, so the launch and the report agree. Packed sequences are read with pointer loads: a
    # TMA box would cross into the next sequence's rows (and its stores would overwrite them). The output,
    # empty_like(q), shares q's strides or is contiguous: TMA-compatible when q is.
    if tiles.use_tma and (features.varlen is not None or q.shape[-1] < 16 or not tma_compatible(q, k, v)):
        tiles = replace(tiles, use_tma=False)
    return TritonForward(tiles)


def bias_grad_buffer(bias: torch.Tensor, full_shape, deterministic: bool) -> tuple[torch.Tensor, bool]:
    """The float32 buffer the dQ kernel writes the bias's gradient into, and whether it adds with atomics.

    A bias without broadcast dims gets each element from one program: stored, deterministic. A broadcast bias
    sums over programs: float32 atomics into a buffer of its own shape (O(bias) memory, last bits may vary), or,
    when determinism is asked for, a (B, H, Lq, Lk) buffer summed afterwards (O(B·H·Lq·Lk) memory)."""
    broadcast = tuple(bias.shape) != tuple(full_shape)
    if broadcast and deterministic:
        return torch.zeros(full_shape, dtype=torch.float32, device=bias.device), False
    return torch.zeros(bias.shape, dtype=torch.float32, device=bias.device), broadcast


def bias_grad_of_buffer(dbias: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The bias's gradient from `bias_grad_buffer`'s buffer once a backward wrote it: summed over the broadcast dims
    where determinism gave it the full shape, in the bias's dtype."""
    if dbias.shape != bias.shape:
        dims = [d for d in range(4) if bias.shape[d] == 1 and dbias.shape[d] != 1]
        dbias = dbias.sum(dim=dims, keepdim=True)
    return dbias.to(bias.dtype)


@dataclass(frozen=True)
class TritonBackward:
    """The Triton backward kernels with these tiles: a dK/dV pass and a dQ pass, or the fused single pass (dQ by
    float32 atomics) where `tiles.fused` is set and determinism is not asked for."""

    tiles: BackwardTiles
    backend = "triton"
    kernel = BACKWARD_KERNEL
    title = "the Triton kernels"

    def run(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float, deterministic: bool,
            need_dbias: bool):
        from flashmoe_science.attention.triton.bwd import attention_backward

        check_interpreter_operands("q", q)
        ran("backward", self.backend, self.kernel)
        # dQ and dK/dV both wanted, determinism not asked for, no bias gradient (formed by the dQ kernel) and the
        # fused single pass (5 products per tile pair instead of 7, dQ summed with float32 atomics into dq_accum)
        # measured faster on this GPU: take it. Otherwise the two passes: no atomics, bit-identical gradients.
        dq_accum = None
        if dq is not None and dk is not None and not deterministic and not need_dbias and self.tiles.fused is not None:
            dq_accum = torch.empty(*q.shape[:3], padded_head_dim(q.shape[-1]), dtype=torch.float32, device=q.device)
        dbias = dbias_atomic = None
        bias = features.attn_bias
        if need_dbias:
            full_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            dbias, dbias_atomic = bias_grad_buffer(bias, full_shape, deterministic)
        attention_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, self.tiles,
                           dq_accum, dbias=dbias, dbias_atomic=dbias_atomic)
        if dbias is not None:
            dbias = bias_grad_of_buffer(dbias, bias)
        return dq, dk, dv, dbias

    def prepare(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float):
        """None: the Triton backward's launches are bound by Triton on every call (autograd.BackwardPlan still
        skips the planning)."""
        return None


def backward_plan(problem) -> TritonBackward:
    """The Triton backward's plan."""
    q, bias = problem.q, problem.features.attn_bias
    return TritonBackward(backward_tiles(q.shape[-1], q.dtype, problem.features.causal, device_traits(q.device),
                                         0 if bias is None else bias.element_size()))


class _TritonAttentionBackward:
    """The backward half of the Triton family: takes the backward of any kernel forward."""

    name = "triton"
    title = "the Triton backward"

    def decline(self, question) -> str | None:
        if question.forward.differentiable:
            return "autograd differentiates the forward it ran"
        return None

    def plan(self, question) -> TritonBackward:
        return backward_plan(question.problem)


class TritonAttention:
    """The portable Triton kernels: every feature of `features.FEATURES`, every head dim in [1, 256],
    bf16/fp16/fp32 on CUDA; CPU tensors only when asked for by name under TRITON_INTERPRET=1."""

    name = "triton"
    title = "the portable Triton kernel"
    runs_kernels = True  # backend="triton" asks for CUDA tensors (or the interpreter) and a kernel dtype
    policy = ("other CUDA GPUs, float32, other strides or head dims", "Triton", "Triton (two passes, deterministic)")
    backward = _TritonAttentionBackward()

    def decline(self, problem) -> str | None:
        q = problem.q
        if problem.backend == "auto":
            if not q.is_cuda:
                return f"{q.device.type} tensors run the PyTorch reference"
            if q.dtype == torch.float64:
                return "float64 has no tensor-core kernel"
        return None

    def plan(self, problem) -> TritonForward:
        return forward_plan(problem.q, problem.k, problem.v, problem.features)


TRITON = TritonAttention()


# ------------------------------------------------------------------------------------------------------- FP8
@dataclass(frozen=True)
class TritonFp8Forward:
    """The e4m3 tensor-core forward in Triton (fp8.py): bf16 out, float32 lse."""

    backend = "triton"
    kernel = FP8_KERNEL
    tiles = None

    def run(self, problem):
        from flashmoe_science.attention.fp8 import fp8_outputs, no_keys
        from flashmoe_science.attention.triton.fp8 import attention_forward_fp8

        q, k = problem.q, problem.k
        out, lse = fp8_outputs(q)
        if not (q.numel() and k.shape[2]):
            return no_keys(out, lse)
        ran("forward", self.backend, self.kernel)
        attention_forward_fp8(q, k, problem.v, out, lse, *problem.descales, problem.causal, problem.softmax_scale)
        return out, lse

    def describe(self) -> str:
        return "the Triton e4m3 kernel (TMA loads, e4m3 wgmma, descales folded into the softmax multiplier)"


class TritonFp8:
    """The Triton e4m3 kernel: CUDA GPUs whose generation its TMA loads and tiles were written and measured on
    (`DeviceTraits.measured_tiles`), head dims 64, 128 and 256."""

    name = "triton"
    title = "the Triton e4m3 kernel"

    def decline(self, problem) -> str | None:
        from flashmoe_science.attention.fp8 import e4m3_kernel_refusal

        q = problem.q
        if not q.is_cuda or not device_traits(q.device).measured_tiles:
            return "its TMA loads and tiles are written for the GPU generation the tile tables were measured on"
        return e4m3_kernel_refusal(problem)

    def plan(self, problem) -> TritonFp8Forward:
        return TritonFp8Forward()


TRITON_FP8 = TritonFp8()
