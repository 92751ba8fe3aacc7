"""Attention forward in Triton: FlashAttention-2 work split with an online softmax in base 2.

Read top to bottom:

1. One program owns a tile of BLOCK_M query rows of one (batch, query head). Programs of the same head are
   launched next to each other so their K/V tiles are shared through L2; with causal masking the heaviest
   (bottom) query tiles are launched first.
2. The keys a tile sees split into full tiles, where no score needs a mask, and at most a few boundary tiles
   (the causal diagonal, the ragged end of the sequence), where it does. Full tiles run a loop without any mask
   arithmetic; keys no row of the tile can see are never loaded.
3. Per key tile: s = q kᵀ, a running row max m and row sum l, and an fp32 accumulator rescaled by
   exp2(m_old - m_new) when the max grows. The softmax scale and log2(e) are folded into one multiplier so each
   score costs one FMA before its exp2.
4. The output is acc / l; the log-sum-exp is (m + log2 l) · ln 2. A row that sees no key writes zeros and -inf.

GQA/MQA maps query head h to key/value head h // group: no copy of K/V. Head dims that are not a power of two
are padded inside the kernel (zero-filled loads, masked stores). On Hopper, Q/K/V/O move through TMA tensor
descriptors over the caller's 4-D strides (out-of-bounds rows and columns are zero-filled by the copy engine);
elsewhere, and under the interpreter, through masked pointer loads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashmoe_science.attention.mask import key_tile_bounds  # noqa: F401 (re-exported for the kernels)
from flashmoe_science.attention.tiles import (
    AttentionTiles,
    autotune_enabled,
    device_traits,
    forward_search_space,
    forward_tiles,
    padded_head_dim,
)
from flashmoe_science.device import dot_precision
from flashmoe_science.prepared_launch import PreparedLaunch

LOG2_E = 1.4426950408889634  # host side: folded into the softmax scale
LN_2 = tl.constexpr(0.6931471805599453)  # in kernels: base-2 log-sum-exp -> natural log


@triton.jit
def _load_tile(base, desc_ptr, batch, head, row0, n_rows, stride_row,
               ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (ROWS, BLOCK_D) tile starting at row `row0` of one head; rows past `n_rows` and columns past HEAD_DIM read 0."""
    if USE_TMA:
        tile = desc_ptr.load([batch, head, row0, 0]).reshape(ROWS, BLOCK_D)
    else:
        rows = row0 + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + rows[:, None] * stride_row + cols[None, :]
        if CHECK_ROWS:
            mask = rows[:, None] < n_rows
            if BLOCK_D != HEAD_DIM:
                mask = mask & (cols[None, :] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, offs_m, start_n, seqlen_k, diagonal, qk_scale,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Fold one tile of raw scores s = q kᵀ and its values v into the running (acc, l, m)."""
    if MASKED:
        key_pos = start_n + tl.arange(0, BLOCK_N)
        visible = key_pos[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= offs_m[:, None] + diagonal)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(s * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_key_tiles(acc, l_i, m_i, q, offs_m,
                      k_base, v_base, K, V, batch, kv_head, stride_kn, stride_vn,
                      key_start, key_end, seqlen_k, diagonal, qk_scale,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Fold key tiles [key_start, key_end) into the running (acc, l, m). MASKED tiles apply bounds/causal masks."""
    for start_n in range(key_start, key_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_tile(k_base, K, batch, kv_head, start_n, seqlen_k, stride_kn,
                       BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = _load_tile(v_base, V, batch, kv_head, start_n, seqlen_k, stride_vn,
                       BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA, MASKED)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, offs_m, start_n, seqlen_k, diagonal,
                                             qk_scale, BLOCK_N, MASKED, CAUSAL, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attention_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW64: tl.constexpr,
):
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_qm, stride_kn = stride_qm.to(tl.int64), stride_kn.to(tl.int64)
        stride_vn, stride_om = stride_vn.to(tl.int64), stride_om.to(tl.int64)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest query tiles first: a shorter tail of lone programs
    batch = pid_bh // num_q_heads
    q_head = pid_bh % num_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)

    batch64 = batch.to(tl.int64)
    if USE_TMA:  # descriptors carry their own addressing
        q_base, k_base, v_base = Q, K, V
    else:  # 64-bit head offsets: B·H·L·D can pass 2**31 elements
        q_base = Q + batch64 * stride_qb + q_head.to(tl.int64) * stride_qh
        k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
        v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh

    q = _load_tile(q_base, Q, batch, q_head, start_m, seqlen_q, stride_qm,
                   BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diagonal = seqlen_k - seqlen_q  # query i sees key j iff j <= i + diagonal
    full_end, key_end = key_tile_bounds(start_m, seqlen_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)

    acc, l_i, m_i = _attend_key_tiles(acc, l_i, m_i, q, offs_m, k_base, v_base, K, V, batch, kv_head,
                                      stride_kn, stride_vn, 0, full_end, seqlen_k, diagonal, qk_scale,
                                      BLOCK_N, BLOCK_D, HEAD_DIM, False, CAUSAL, USE_TMA, DOT_PRECISION)
    acc, l_i, m_i = _attend_key_tiles(acc, l_i, m_i, q, offs_m, k_base, v_base, K, V, batch, kv_head,
                                      stride_kn, stride_vn, full_end, key_end, seqlen_k, diagonal, qk_scale,
                                      BLOCK_N, BLOCK_D, HEAD_DIM, True, CAUSAL, USE_TMA, DOT_PRECISION)

    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(no_key, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN_2)
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)

    if USE_TMA:
        O.store([batch, q_head, start_m, 0], out.to(O.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        cols = tl.arange(0, BLOCK_D)
        o_ptrs = O + batch64 * stride_ob + q_head.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + cols[None, :]
        mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            mask = mask & (cols[None, :] < HEAD_DIM)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask)


def tma_box(t: torch.Tensor, block_rows: int, block_d: int) -> dict:
    """The fields of a rank-4 TMA descriptor over t's own strides, boxes of (1, 1, block_rows, block_d).

    Shared by the Triton and the Gluon launchers. The descriptors are built from these without their classes'
    re-validation (`tma_compatible` was checked once by the caller): this runs on every call, and host time matters
    for small problems, where the GPU idles while Python prepares a launch.
    """
    shape, strides = list(t.shape), list(t.stride())
    # Size-1 dims are never stepped over, but TMA still wants every outer stride 16-byte aligned.
    for dim in (2, 1, 0):
        if shape[dim] == 1:
            strides[dim] = shape[dim + 1] * strides[dim + 1]
    return {"base": t, "shape": shape, "strides": strides, "block_shape": [1, 1, block_rows, block_d], "padding": "zero"}


def _tma_descriptor(t: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor:
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(tma_box(t, block_rows, block_d))
    return desc


def needs_64bit_rows(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel's row offsets (row index × row stride, in elements) can reach 2**31 for these (..., L, D)
    tensors. The kernels compute them in 32 bits unless told otherwise (ROW64): 64-bit offsets cost registers in
    the common case, but a transposed (B, L, H, D) buffer has row stride H·D, so H=32, D=128 passes 2**31 at
    L = 524288. Batch and head offsets are always 64-bit; TMA descriptors address on their own."""
    return any(t is not None and t.shape[-2] > 1 and (t.shape[-2] - 1) * t.stride(-2) + t.shape[-1] >= 2**31
               for t in tensors)


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride, 16-byte aligned base addresses and outer strides (size-1 dims excepted).

    Holds for any rank: every view the API derives (merged leading dims, unsqueezed 2-D/3-D) keeps the property.
    """
    for t in tensors:
        align = 16 // t.element_size()
        if t.data_ptr() % 16 or (t.shape[-1] > 1 and t.stride(-1) != 1):
            return False
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            if size > 1 and stride % align:
                return False
    return True


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float, tiles: AttentionTiles,
):
    """Launch the forward kernel on checked 4-D tensors: q/out `(B, Hq, Lq, D)`, k/v `(B, Hkv, Lk, D)` with
    unit stride in the last dim, lse a contiguous float32 `(B, Hq, Lq)`; `tiles.use_tma` only where
    `tma_compatible(q, k, v, out)` holds. Writes `out` and `lse` in place and
    returns Triton's compiled kernel (registers, spills and SASS for diagnostics)."""
    common, strides = _scalar_args(q, k, v, out, causal, softmax_scale, tiles)
    if autotune_enabled() and q.is_cuda:
        kernel = _autotuned_kernel(q.shape[-1], q.dtype, device_traits(q.device))
        # box rows are placeholders: each config's pre_hook sets its own
        tensor_args = _tensor_args(tiles.use_tma, 16, 16, common["BLOCK_D"], q, k, v, out, lse)
        grid = lambda meta: (triton.cdiv(q.shape[2], meta["BLOCK_M"]), q.shape[0] * q.shape[1])  # noqa: E731
        return kernel[grid](*tensor_args, *strides, **common, **dot_precision(q))

    grid, bound, options = _launch(q, k, v, out, lse, tiles, common, strides)
    return _attention_forward_kernel[grid](**bound, **options)


def _scalar_args(q, k, v, out, causal, softmax_scale, tiles: AttentionTiles) -> tuple[dict, tuple]:
    """The kernel's scalars and constexprs (but the tile shape) by name, and its strides in order."""
    num_q_heads = q.shape[1]
    common = dict(
        num_q_heads=num_q_heads, group_size=num_q_heads // k.shape[1], seqlen_q=q.shape[2], seqlen_k=k.shape[2],
        qk_scale=softmax_scale * LOG2_E, HEAD_DIM=q.shape[3], BLOCK_D=padded_head_dim(q.shape[3]), CAUSAL=causal,
        USE_TMA=tiles.use_tma,  # the caller checked tma_compatible(q, k, v, out) when it chose TMA
        ROW64=needs_64bit_rows(q, k, v, out),
    )
    return common, (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])


def _tensor_args(use_tma, block_m, block_n, block_d, q, k, v, out, lse):
    """The kernel's per-call arguments Q, K, V, O, LSE: the tensors, or TMA descriptors over them."""
    if not use_tma:
        return q, k, v, out, lse
    return (_tma_descriptor(q, block_m, block_d), _tma_descriptor(k, block_n, block_d),
            _tma_descriptor(v, block_n, block_d), _tma_descriptor(out, block_m, block_d), lse)


def _launch(q, k, v, out, lse, tiles: AttentionTiles, common: dict, strides: tuple):
    """(grid, every kernel parameter by name, launch options) of a launch with the heuristic's tiles."""
    tensor_args = _tensor_args(tiles.use_tma, tiles.block_m, tiles.block_n, common["BLOCK_D"], q, k, v, out, lse)
    bound = dict(zip(_attention_forward_kernel.arg_names, (*tensor_args, *strides)), **common,
                 BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **dot_precision(q))
    grid = (triton.cdiv(q.shape[2], tiles.block_m), q.shape[0] * q.shape[1])
    return grid, bound, dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def prepare_forward(q, k, v, out, lse, causal: bool, softmax_scale: float, tiles: AttentionTiles) -> PreparedLaunch:
    """This launch as a PreparedLaunch, called as `prepared(q, k, v, out, lse)` on new tensors of the same shapes,
    strides, dtypes, device and 16-byte alignment (arguments as attention_forward, which must have run on them
    without autotuning: the kernel is taken from Triton's cache)."""
    common, strides = _scalar_args(q, k, v, out, causal, softmax_scale, tiles)
    grid, bound, options = _launch(q, k, v, out, lse, tiles, common, strides)
    make_head = functools.partial(_tensor_args, tiles.use_tma, tiles.block_m, tiles.block_n, common["BLOCK_D"])
    return PreparedLaunch(_attention_forward_kernel, grid, bound, options, make_head, (q, k, v, out, lse))


def _set_descriptor_blocks(nargs: dict) -> None:
    # Autotune picks BLOCK_M/BLOCK_N per config; the host TMA descriptors must carry the same box shape.
    block_d = nargs["BLOCK_D"]
    for name, rows in (("Q", nargs["BLOCK_M"]), ("O", nargs["BLOCK_M"]), ("K", nargs["BLOCK_N"]), ("V", nargs["BLOCK_N"])):
        if hasattr(nargs[name], "block_shape"):
            nargs[name].block_shape = [1, 1, rows, block_d]


@functools.lru_cache(maxsize=None)
def _autotuned_kernel(head_dim: int, dtype: torch.dtype, traits):
    """The forward kernel wrapped in `triton.autotune` over `tiles.forward_search_space` (FLASHMOE_AUTOTUNE=1),
    one wrapper per (head dim, dtype, GPU); each wrapper tunes once per causal flag, GQA group and lengths."""
    configs = [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps, num_stages=t.num_stages,
                      pre_hook=_set_descriptor_blocks)
        # no contender fits (fp32 at D=256): the heuristic's own tile, which is shrunk to fit
        for t in forward_search_space(head_dim, dtype, traits) or [forward_tiles(head_dim, dtype, False, traits)]
    ]
    return triton.autotune(configs=configs, key=["CAUSAL", "seqlen_q", "seqlen_k", "group_size"])(
        _attention_forward_kernel)
