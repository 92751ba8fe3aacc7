"""What the Gluon sm_90 attention kernels share beside the mask and sequence rules (attention/mask.py,
attention/seqlen.py): their rank-4 TMA descriptors over the caller's strides (`descriptor`) and the release of ring
stages a consumer does not read (`release_unused`). The kernel files import this module, never each other."""

from __future__ import annotations

import functools

import torch

from flashmoe_science.attention.layout import tma_descriptor
from flashmoe_science.gluon.compat import TensorDescriptor, gl, gluon, mbarrier
from flashmoe_science.gluon.sm90 import GL_DTYPES


# what the TMA boxes carry: the kernels' operands (e4m3 too: the FP8 forward), and an attention bias (float32 too)
_BOX_DTYPES = {**GL_DTYPES, torch.float32: gl.float32, torch.float8_e4m3fn: gl.float8e4nv}


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, block_d: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, block_d], _BOX_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int, block_d: int) -> TensorDescriptor:
    """Gluon's rank-4 TMA descriptor over a (B, H, L, D) tensor, boxes of (1, 1, rows, block_d): layout.tma_box plus
    the shared-memory layout of the box. (An attention bias (Bb, Hb, Lq, Lk) takes boxes of (1, 1, rows, keys).)"""
    return tma_descriptor(t, rows, block_d, TensorDescriptor, layout=_smem_layout(rows, block_d, t.dtype))


@gluon.jit
def release_unused(k_ready, v_ready, k_empty, v_empty, first, end, NUM_STAGES: gl.constexpr):
    """Ring positions [first, end) of a K/V ring whose "empty" barriers take one arrival per consumer: tiles the
    other consumer still needs. Release each stage in order, once its copy has landed, so the two arrivals on an
    "empty" barrier always belong to the same tile."""
    for r in range(first, end):
        stage = r % NUM_STAGES
        phase = (r // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        mbarrier.arrive(k_empty.index(stage), count=1)
        mbarrier.wait(v_ready.index(stage), phase)
        mbarrier.arrive(v_empty.index(stage), count=1)
