"""The building blocks every warp-specialised sm_90 Gluon kernel of the library shares (attention/hopper and
moe/hopper import them from here; neither imports the other).

Each kernel runs one producer warp (TMA copies only) beside two consumer warpgroups (wgmma and the math; the
attention forward at small head dims three): the register split between them (``PRODUCER_REGISTERS``,
``consumer_registers``, ``register_cap``; ``CONSUMER_REGISTERS`` and ``REGISTER_CAP`` for two consumers), the
launch options that go with it (``launch_options``, ``LAUNCH_OPTIONS``), the consumers' accumulator layout
(``wgmma_layout``) and its column halves (``column_halves``, for epilogues in slices), ordered global counters
between CTAs (``wait_counter``, ``release_counter_after_bulk``: a deterministic order of TMA reduce-adds), host-side
TMA descriptors (``descriptor``) and offline sm_90 builds (``compile_offline``; the target-independent part is
``build``). Gluon's own names come from ``compat``.
Gluon inlines the device helpers: the kernels compile as if they were written out in place.
"""

from __future__ import annotations

import torch
import triton

from flashmoe_science.gluon import build
from flashmoe_science.gluon.compat import TensorDescriptor, gl, gluon

PRODUCER_REGISTERS = gl.constexpr(24)  # the fewest a warp may hold: the producer only computes coordinates
MAX_CONSUMER_REGISTERS = 240  # setmaxnreg's ceiling is 256; 240 is what two consumers get beside the producer
REGISTER_FILE = 65536  # 32-bit registers per SM, the CTA's whole budget
NUM_WARPS = 4  # the default partition (consumer 0); the workers add 4 warps per further consumer, then 1
BARRIER_BYTES = 1024  # mbarriers and alignment, beside the operand ring
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.constexpr_function
def register_cap(num_consumers):
    """Registers per thread at launch (``maxnreg``) of a kernel with `num_consumers` consumer warpgroups and the
    producer warp. Triton pads the producer warp to a whole warpgroup (setmaxnreg acts on warpgroups: 2 consumers
    launch 384 threads, 3 launch 512), and every thread must fit the register file at launch: 168 for 2
    consumers, 128 for 3."""
    return REGISTER_FILE // ((num_consumers + 1) * 128) // 8 * 8


@gluon.constexpr_function
def consumer_registers(num_consumers):
    """Registers per consumer thread after setmaxnreg: the launch's share of every warpgroup, less the producer's
    24, split between the consumers (multiples of 8, at most MAX_CONSUMER_REGISTERS): 2 consumers 240
    (2*240 + 24 = 504 = 3*168), 3 consumers 160 (3*160 + 24 <= 4*128; the default partition, consumer 0, keeps
    what the workers leave: 168)."""
    pool = (num_consumers + 1) * register_cap(num_consumers) - PRODUCER_REGISTERS.value
    return min(MAX_CONSUMER_REGISTERS, pool // num_consumers // 8 * 8)


def launch_options(num_consumers: int = 2) -> dict:
    """The launch options (num_warps of the default partition, maxnreg) of a kernel with `num_consumers` consumer
    warpgroups and the producer warp."""
    return dict(num_warps=NUM_WARPS, maxnreg=register_cap(num_consumers))


CONSUMER_REGISTERS = gl.constexpr(consumer_registers(2))
REGISTER_CAP = register_cap(2)
LAUNCH_OPTIONS = launch_options(2)


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


def compile_offline(fn, args, constexprs: dict, num_consumers: int = 2):
    """``build.compile_offline`` for sm_90 with the launch options of `num_consumers` consumer warpgroups
    (``launch_options``): the CompiledKernel of the Gluon kernel ``fn`` built without a GPU (meta tensors are
    enough)."""
    return build.compile_offline(fn, args, constexprs, arch=90, options=launch_options(num_consumers))
