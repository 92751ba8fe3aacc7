"""FlashAttention-4's twins of the ``mask-mods`` suite's masks (`bench/mask_mods.py`): its ``fa4`` contender.

FA4 (`flash_attn.cute`) takes a mask as a CuTe DSL function, inlined into its kernels wherever a tile is masked:

    mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors) -> Boolean TensorSSA (True: the pair is attended)

each index an Int32 TensorSSA of shape (1,) (``idx[0]`` is its scalar), ``aux_tensors`` the CuTe views of the torch
tensors passed as ``flash_attn_func(..., aux_tensors=[...])``, read with scalar indices (``t[b, q]``). Constants enter
as Int32 SSAs (`flash_attn.cute.utils.scalar_to_ssa`). Each twin below is the same mask as the suite's `@triton.jit`
mod and reads the same tensors in the same order (`MaskMod.tensors` become the aux tensors).

FA4 visits only the tiles a block mask lists, FlexAttention's lists at FA4's own tile (`block_size`): the forward
takes the KV-direction lists, the backward the Q-direction ones, and full tiles skip the mask. They are built once
per case, outside timing, from the case's Flex twin.

Importing this module imports cutlass and flash_attn: import it only where `bench.attention.fa4_skip_reason` returned
None.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
import torch
from flash_attn.cute import flash_attn_func
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
from flash_attn.cute.utils import scalar_to_ssa

from flashmoe_science.attention.mods import MaskMod
from flashmoe_science.bench import mask_mods as mm
from flashmoe_science.bench.attention import fa4_output
from flashmoe_science.device import device_traits

WINDOW, NEIGHBOURS = mm.WINDOW, mm.NEIGHBOURS
FA4_TILE = 128  # FA4's forward tile (M and N) at D=128, sm_90 and sm_100 alike


@cute.jit
def document_window(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Same document, causal, at most WINDOW keys back (aux_tensors[0]: (B, LENGTH) document ids)."""
    doc = aux_tensors[0]
    q_doc = scalar_to_ssa(doc[batch[0], q_idx[0]], cutlass.Int32)
    kv_doc = scalar_to_ssa(doc[batch[0], kv_idx[0]], cutlass.Int32)
    return (q_doc == kv_doc) & (kv_idx <= q_idx) & (q_idx - kv_idx <= scalar_to_ssa(WINDOW, cutlass.Int32))


@cute.jit
def prefix_lm(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Keys in row batch's prefix (aux_tensors[0]: (B,) lengths) are seen by every query; the rest causally."""
    prefix = aux_tensors[0]
    return (kv_idx < scalar_to_ssa(prefix[batch[0]], cutlass.Int32)) | (kv_idx <= q_idx)


@cute.jit
def head_windows(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Causal, at most windows[head] keys back (aux_tensors[0]: (H,) widths)."""
    windows = aux_tensors[0]
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= scalar_to_ssa(windows[head[0]], cutlass.Int32))


@cute.jit
def neighbour_list(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Atom q_idx sees itself and the atoms of its row of aux_tensors[0] (B, LENGTH, NEIGHBOURS), -1 = none; the
    loop over the row is unrolled when the kernel is traced."""
    table = aux_tensors[0]
    seen = q_idx == kv_idx
    for n in cutlass.range_constexpr(NEIGHBOURS):
        seen = seen | (scalar_to_ssa(table[batch[0], q_idx[0], n], cutlass.Int32) == kv_idx)
    return seen


@cute.jit
def causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Causal at Lq == Lk."""
    return kv_idx <= q_idx


@cute.jit
def sliding_window(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Causal, at most WINDOW keys back."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= scalar_to_ssa(WINDOW, cutlass.Int32))


# case name (`mask_mods.mask_cases`) -> its CuTe DSL twin
TWINS = {"document window": document_window, "prefix-LM": prefix_lm, "head windows": head_windows,
         "neighbour list": neighbour_list, "causal": causal, "sliding window": sliding_window}


def block_size(length: int, device) -> tuple[int, int]:
    """The (query, key) block of FA4's block-sparse lists on this GPU at D=128: its forward's tile, (128, 128) on
    sm_90; on sm_100 a CTA takes two query tiles when the rows are longer than one, (256, 128). Its backward takes the
    same block (Q-direction lists)."""
    blackwell = device_traits(device).in_families((10,))
    return (2 * FA4_TILE if blackwell and length > FA4_TILE else FA4_TILE, FA4_TILE)


def block_sparse_tensors(flex_mask, length: int, device) -> tuple[BlockSparseTensorsTorch, BlockSparseTensorsTorch]:
    """FA4's forward and backward block-sparse tensors of the mask `flex_mask` (FlexAttention's signature) over
    (BATCH, HEADS, length, length): FlexAttention's block mask at `block_size`, its KV-direction lists for the
    forward, its Q-direction lists for the backward."""
    from torch.nn.attention.flex_attention import create_block_mask

    block = block_size(length, device)
    bm = create_block_mask(flex_mask, B=mm.BATCH, H=mm.HEADS, Q_LEN=length, KV_LEN=length, device=device,
                           BLOCK_SIZE=block, _compile=True)
    forward = BlockSparseTensorsTorch(mask_block_cnt=bm.kv_num_blocks, mask_block_idx=bm.kv_indices,
                                      full_block_cnt=bm.full_kv_num_blocks, full_block_idx=bm.full_kv_indices,
                                      block_size=block)
    backward = BlockSparseTensorsTorch(mask_block_cnt=bm.q_num_blocks, mask_block_idx=bm.q_indices,
                                       full_block_cnt=bm.full_q_num_blocks, full_block_idx=bm.full_q_indices,
                                       block_size=block)
    return forward, backward


def fa4_attend(name: str, ours: MaskMod, flex_mask, length: int, device) -> tuple[Callable, str]:
    """The ``fa4`` contender's call of case `name` and its note: `flash_attn_func` with the case's twin, `ours`'
    tensors as its aux tensors and the block-sparse tensors of `flex_mask`, on our (B, H, L, D) tensors viewed as its
    (B, L, H, D) layout (no copy); forward and backward (FA4 differentiates through its own backward, mask_mod
    included)."""
    if name not in TWINS:
        raise ValueError(f"name: no CuTe DSL twin of the mask {name!r} (twins: {', '.join(TWINS)})")
    twin = TWINS[name]
    aux = list(ours.tensors) or None
    forward, backward = block_sparse_tensors(flex_mask, length, device)

    def attend(q, k, v):
        out = fa4_output(flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask_mod=twin,
                                         aux_tensors=aux, block_sparse_tensors=forward,
                                         block_sparse_tensors_bwd=backward))
        return out.transpose(1, 2)

    return attend, f"CuTe DSL mask_mod, block-sparse at {forward.block_size}"
