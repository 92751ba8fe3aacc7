"""The building blocks every warp-specialised sm_90 Gluon kernel of the library shares (attention/hopper and
moe/hopper import them from here; neither imports the other).

Each kernel runs one producer warp (TMA copies only) beside two consumer warpgroups (wgmma and the math): the
register split between them (``PRODUCER_REGISTERS``, ``CONSUMER_REGISTERS``, ``REGISTER_CAP``), the launch
options that go with it (``LAUNCH_OPTIONS``), the consumers' accumulator layout (``wgmma_layout``) and its column
halves (``column_halves``, for epilogues in slices), ordered global counters between CTAs (``wait_counter``,
``release_counter_after_bulk``: a deterministic order of TMA reduce-adds), host-side TMA descriptors (``descriptor``) and offline sm_90
builds (``compile_offline``; the target-independent part is ``build``). Gluon's own names come from ``compat``.
Gluon inlines the device helpers: the kernels compile as if they were written out in place.
"""

from __future__ import annotations

import torch
import triton

from flashmoe_science.gluon import build
from flashmoe_science.gluon.compat import TensorDescriptor, gl, gluon

PRODUCER_REGISTERS = gl.constexpr(24)  # the fewest a warp may hold: the producer only computes coordinates
CONSUMER_REGISTERS = gl.constexpr(240)
# Registers per thread at launch: the three warpgroups (two consumers, the producer's) must fit the 64K register file;
# setmaxnreg then moves the producer's share to the consumers (2*240 + 24 = 504 <= 3*168).
REGISTER_CAP = 65536 // (3 * 128) // 8 * 8
NUM_WARPS = 4  # the default partition (consumer 0); the workers add 4 + 1 warps
BARRIER_BYTES = 1024  # mbarriers and alignment, beside the operand ring
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LAUNCH_OPTIONS = dict(num_warps=NUM_WARPS, maxnreg=REGISTER_CAP)


# ------------------------------------------------------------------------------------------------- device helpers
@gluon.constexpr_function
def wgmma_layout(N):
    """The consumers' wgmma accumulator layout of an N-column tile: the 4 warps stacked along the rows (16 rows each,
    repeated down the tile), each thread holding adjacent column pairs. Its column slices (``column_halves``) have
    the layout of the narrower tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def column_halves(t):
    """(left, right) column halves of a 2-D register tensor in a wgmma accumulator layout, without moving data: a
    thread holds columns c and c + N/2 of the same rows, so the split only selects registers (no shuffles)."""
    ROWS: gl.constexpr = t.shape[0]
    HALF: gl.constexpr = t.shape[1] // 2
    return t.reshape([ROWS, 2, HALF]).permute((0, 2, 1)).split()


LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # one element per lane of a one-warp partition


@gluon.jit
def wait_counter(counter, target):
    """Spin until the int32 at `counter` (global memory) equals `target`, from a one-warp partition: every lane
    loads it with acquire semantics at GPU scope (what another CTA's `release_counter_after_bulk` published is
    then visible), then fences the async proxy, so that TMA operations issued after this call are ordered after
    the observation. Gluon has no scalar acquire load: this is inline PTX, one copy per lane (the loop's label is
    scoped by the braces)."""
    lanes = gl.arange(0, 32, layout=LANES)
    gl.inline_asm_elementwise(
        "{ .reg .pred ctr_wait; .reg .b32 ctr_value; ctr_spin: ld.acquire.gpu.global.b32 ctr_value, [$1]; "
        "setp.ne.s32 ctr_wait, ctr_value, $2; @ctr_wait bra ctr_spin; fence.proxy.async.global; "
        "mov.b32 $0, ctr_value; }",
        "=r,l,r", [counter + lanes * 0, target + lanes * 0], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def release_counter_after_bulk(counter):
    """From a one-warp partition: wait until this warp's bulk asynchronous groups (TMA stores and reduce-adds) are
    complete, their writes performed (``cp.async.bulk.wait_group 0``; ``tma.store_wait`` only waits until their
    shared-memory source is read), fence the async proxy against the generic one, gather the warp (the issuing
    lane's completion then precedes lane 0's release), and add 1 to the int32 at `counter` with release semantics
    at GPU scope from lane 0: a CTA that observes the new value (`wait_counter`) sees those writes done."""
    lanes = gl.arange(0, 32, layout=LANES)
    gl.inline_asm_elementwise(
        "{ .reg .pred ctr_lead; cp.async.bulk.wait_group 0; fence.proxy.async.global; bar.warp.sync -1; "
        "setp.eq.u32 ctr_lead, $1, 0; @ctr_lead red.release.gpu.global.add.s32 [$2], 1; mov.b32 $0, 0; }",
        "=r,r,l", [lanes, counter + lanes * 0], dtype=gl.int32, is_pure=False, pack=1)


# --------------------------------------------------------------------------------------------------- host helpers
def descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A TMA descriptor over a checked 2-D tensor (unit last stride, 16-byte aligned rows), built without the
    class's re-validation (which also reads data_ptr, absent on the meta tensors of offline builds)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=list(block_shape),
                         layout=gl.NVMMASharedLayout.get_default_for(list(block_shape), GL_DTYPES[t.dtype]),
                         padding="zero")
    return desc


def compile_offline(fn, args, constexprs: dict):
    """``build.compile_offline`` for sm_90 with this module's LAUNCH_OPTIONS: the CompiledKernel of the Gluon kernel
    ``fn`` built without a GPU (meta tensors are enough)."""
    return build.compile_offline(fn, args, constexprs, arch=90, options=LAUNCH_OPTIONS)
