"""Input checks of the attention front doors: every bad argument gets a TypeError/ValueError naming it.

The dense (`api.flash_attention_science`) and packed (`varlen.flash_attention_varlen`) entry points share these;
kernels behind them never validate user input.
"""

from __future__ import annotations

import math
import numbers

import torch

from flashmoe_science.attention.features import Varlen
from flashmoe_science.prepared_cache import TensorMemo

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
# Any head dim in [1, 256]: the Triton kernels pad the tile to a power of two (>= 16) inside; kernels that need
# more (TMA rows of 16-byte multiples) decline the others (the "odd_head_dim" feature) and leave them to Triton.
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32 (float64 on the reference), got {t.dtype}")
    if t.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (L, D), got shape {tuple(t.shape)}")


def check_head_dim(head_dim: int) -> None:
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q) must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")


def check_scale(softmax_scale) -> None:
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")


def check_backend(backend, names: tuple[str, ...]) -> None:
    """`backend` is one of `names` (the planner's list; a front door's own where it has one)."""
    if backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")


def check_same_kind(q, k, v) -> None:
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")


def check_heads(hq: int, hkv: int) -> None:
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's head count ({hq}) must be a multiple of k's head count ({hkv}) (GQA/MQA)")


def check_inputs(q, k, v, softmax_scale) -> None:
    """The dense front door's q, k, v `(..., H, L, D)` and scale (the planner checks the backend's name)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    check_same_kind(q, k, v)
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k and v must have the same number of dims, got {q.dim()}, {k.dim()}, {v.dim()}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q and k must have the same batch dims, got {tuple(q.shape[:-3])} and {tuple(k.shape[:-3])}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head dim must equal q's ({q.shape[-1]}), got {k.shape[-1]}")
    check_head_dim(q.shape[-1])
    if q.dim() >= 3:
        check_heads(q.shape[-3], k.shape[-3])
    check_scale(softmax_scale)


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_triton_layout(q, k, v, names=("q", "k", "v")) -> None:
    for name, t in zip(names, (q, k, v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride 1) for the Triton kernels, got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous() (the kernels never copy inputs behind your back)"
            )


def check_alibi_slopes(slopes, batch_shape: tuple[int, ...], num_heads: int, device) -> torch.Tensor | None:
    """alibi_slopes `(H,)` or `(*batch_shape, H)` float32 on q's device -> `(*batch_shape, H)` (a broadcast view,
    no copy). ALiBi slopes are constants of the model: a slope tensor that requires grad is refused rather than
    left without a gradient."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (as flash-attn's), got {slopes.dtype}")
    full = (*batch_shape, num_heads)
    if tuple(slopes.shape) not in ((num_heads,), full):
        raise ValueError(f"alibi_slopes must have shape ({num_heads},) or {full} (heads of q), "
                         f"got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {slopes.device}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes must not require grad: the kernels give no gradient to the slopes "
                         "(pass alibi_slopes.detach())")
    return slopes.expand(full)


def check_attn_bias(bias, target: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor | None:
    """attn_bias: a floating tensor on q's device broadcastable to `target` = q.shape[:-1] + (Lk,), i.e.
    (B, H, Lq, Lk) for 4-D q. Returned as is (broadcast happens in the kernels, through stride-0 dims)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(f"attn_bias must be a floating-point tensor (an additive bias; a boolean mask is not "
                        f"taken), got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"attn_bias must be on q's device {device}, got {bias.device}")
    if dtype != torch.float64 and bias.dtype == torch.float64:
        raise TypeError(f"attn_bias must be bfloat16, float16 or float32 for {dtype} inputs, got {bias.dtype}")
    ok = bias.dim() <= len(target) and all(b in (1, t) for b, t in zip(reversed(bias.shape), reversed(target)))
    if not ok:
        raise ValueError(f"attn_bias of shape {tuple(bias.shape)} does not broadcast to {tuple(target)} "
                         f"(q.shape[:-1] + (Lk,))")
    return bias


def _check_cu_seqlens(name: str, cu: torch.Tensor, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (flash-attn's cumulative lengths), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (host synchronisation is not allowed then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def resolve_check_values(check_values, device: torch.device) -> bool:
    """`check_values` of the calls whose lengths live on the device: None checks in eager calls and skips during
    graph capture; True while capturing is refused (the check must read values on the host)."""
    if check_values is None:
        return not capturing(device)
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool or None, got {type(check_values).__name__}")
    if check_values and capturing(device):
        raise ValueError("check_values=True reads the lengths on the host, which a CUDA graph capture forbids: pass "
                         "None (checks eager calls only) or False")
    return check_values


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values=None) -> Varlen:
    """The packed layout's arguments (q `(total_q, Hq, D)`, k/v `(total_k, Hkv, D)`) -> a checked `Varlen`.

    The values of cu_seqlens are checked too (start 0, non-decreasing, last entry the tensor's total, no sequence
    longer than max_seqlen): one small device-to-host copy (8 numbers; a sync on a GPU), once per pair of
    cu_seqlens tensors: a model's layers (forward and backward) share one pair per batch, so a batch pays one sync,
    not one per layer (`values_checked`; inference tensors, which have no version counter, on every call). While a
    CUDA graph is captured the values are not read (a capture forbids the copy; as flash_attn, the graph trusts them),
    nor with `check_values=False` (`resolve_check_values`): then the last entries may fall short of the totals (rows
    after the last sequence are padding, which no sequence reads), and values out of range are the caller's
    guarantee, as in a captured graph."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")
    check_same_kind(q, k, v)
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head dim must equal q's ({q.shape[-1]}), got {k.shape[-1]}")
    check_head_dim(q.shape[-1])
    check_heads(q.shape[1], k.shape[1])
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    bounds = (q.shape[0], k.shape[0], int(max_seqlen_q), int(max_seqlen_k))
    if resolve_check_values(check_values, q.device) and not values_checked(cu_seqlens_q, cu_seqlens_k, bounds):
        _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, *bounds)
        _VALUES_CHECKED.put((cu_seqlens_q, cu_seqlens_k), bounds, True)
    return Varlen(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))


# The cu_seqlens pairs whose values passed, with the bounds they were checked against (prepared_cache.TensorMemo:
# only while both are the very tensors checked and unwritten since).
_VALUES_CHECKED = TensorMemo()


def values_checked(cu_q: torch.Tensor, cu_k: torch.Tensor, bounds: tuple) -> bool:
    """Whether this pair of cu_seqlens passed `check_varlen`'s value rules for `bounds` (total_q, total_k,
    max_seqlen_q, max_seqlen_k) and neither was written since."""
    return _VALUES_CHECKED.get((cu_q, cu_k), bounds) is not None


def _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k) -> None:
    """The value rules of `check_varlen`, from one device-to-host copy."""
    lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    empty = cu_seqlens_q.new_zeros(1)
    first_q, first_k, last_q, last_k, min_q, min_k, max_q, max_k = torch.cat([
        cu_seqlens_q[:1], cu_seqlens_k[:1], cu_seqlens_q[-1:], cu_seqlens_k[-1:],
        lengths_q.min().view(1) if lengths_q.numel() else empty, lengths_k.min().view(1) if lengths_k.numel() else empty,
        lengths_q.max().view(1) if lengths_q.numel() else empty, lengths_k.max().view(1) if lengths_k.numel() else empty,
    ]).tolist()
    for name, first, last, shortest, longest, total, bound, bound_name in (
        ("cu_seqlens_q", first_q, last_q, min_q, max_q, total_q, max_seqlen_q, "max_seqlen_q"),
        ("cu_seqlens_k", first_k, last_k, min_k, max_k, total_k, max_seqlen_k, "max_seqlen_k"),
    ):
        if first != 0:
            raise ValueError(f"{name} must start at 0, got {first}")
        if shortest < 0:
            raise ValueError(f"{name} must be non-decreasing (cumulative lengths)")
        if last != total:
            raise ValueError(f"{name}'s last entry ({last}) must equal the number of packed tokens ({total})")
        if longest > bound:
            raise ValueError(f"{bound_name} ({bound}) is smaller than the longest sequence ({longest})")
