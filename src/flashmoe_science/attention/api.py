"""The attention front door: check the inputs, normalise the layout to strided 4-D views, pick a kernel.

Kernels behind this module receive only checked 4-D tensors `(B, H, L, D)` with unit stride in the last dim;
they never validate user input or allocate behind this module's back.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from flashmoe_science.attention import reference
from flashmoe_science.attention.autograd import (  # noqa: F401 (_PREPARED_BACKWARD ... re-exported for tests)
    _PREPARED_BACKWARD,
    _backward_key,
    _NoKeys,
    _sm90_backward_runs,
    kernel_backward,
    new_outputs,
    run_kernel,
)
from flashmoe_science.attention.checks import (  # noqa: F401 (BACKENDS ... re-exported)
    BACKENDS,
    FLOAT_DTYPES,
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    check_alibi_slopes,
    check_attn_bias,
    check_flags,
    check_inputs,
    check_triton_layout,
)
from flashmoe_science.attention.features import PLAIN, CallFeatures, feature_names, sm90_missing
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.tiles import (
    ForwardPlan,
    autotune_enabled,
    device_traits,
    forward_tiles,
    sm90_cross_item,
    sm90_forward_tiles,
    sm90_persistent,
    sm90_q_buffers,
)
from flashmoe_science.device import on_another_cuda_device, triton_interpreter_on
from flashmoe_science.gluon.availability import unavailable_reason
from flashmoe_science.prepared_cache import remember, tensor_signature

@dataclass(frozen=True)
class Dispatch:
    """Which implementation a call runs, and why (shown by `flashmoe-science info`)."""

    backend: str  # "hopper", "triton" or "reference"
    kernel: str
    reason: str
    tiles: dict | None = None



@dataclass(frozen=True)
class _Problem:
    """A checked call: the 4-D views the kernels see (None where leading dims cannot merge without a copy), and
    its features over those views (see `_dense_features`)."""

    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    softmax_scale: float
    features: CallFeatures = PLAIN


def _as_4d(t: torch.Tensor) -> torch.Tensor | None:
    """A `(B, H, L, D)` view of `(..., H, L, D)` without copying, or None when the leading dims cannot merge."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    if t.dim() == 4:
        return t
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:
        return None


def _leading_views(q, k, alibi_slopes, attn_bias) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The checked slopes as `(*batch, H)` and the bias with q's rank, its leading (batch) dims broadcast to q's
    (views, no copies)."""
    num_heads = q.shape[-3] if q.dim() >= 3 else 1
    batch_shape = tuple(q.shape[:-3])
    slopes = check_alibi_slopes(alibi_slopes, batch_shape, num_heads, q.device)
    target = (*q.shape[:-1], k.shape[-2])
    bias = check_attn_bias(attn_bias, target, q.dtype, q.device)
    if bias is not None:
        bias = bias.view((1,) * (len(target) - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(*batch_shape, *bias.shape[-3:])  # stride 0 where it broadcasts over the batch
    return slopes, bias


def _features_4d(mask, slopes, bias, index: tuple = ()) -> CallFeatures:
    """The features over 4-D views: the whole (merged) batch, or one leading index of the per-index loop."""
    if slopes is not None:
        slopes = slopes[index].reshape(-1, slopes.shape[-1])  # (B, H); B merged from the leading dims
    if bias is not None:
        bias = bias[index] if bias.dim() > 3 and index else bias
        lead = bias.shape[:-3]
        if all(size == 1 for size in lead):
            bias = bias.reshape(1, *bias.shape[-3:])
        else:  # a bias that varies over several unmergeable leading dims of a >4-D q: reshape may copy it
            bias = bias.reshape(-1, *bias.shape[-3:])
    return CallFeatures(mask=mask, alibi_slopes=slopes, attn_bias=bias)


def _normalise(q, k, v, softmax_scale, mask=None, alibi_slopes=None, attn_bias=None) -> tuple[_Problem, tuple]:
    """The problem over 4-D views, and the leading views of the extras (for the per-index loop)."""
    scale = float(softmax_scale) if softmax_scale is not None else reference.default_softmax_scale(q.shape[-1])
    mask = make_mask(False) if mask is None else mask
    slopes, bias = _leading_views(q, k, alibi_slopes, attn_bias)
    features = _features_4d(mask, slopes, bias)
    return _Problem(_as_4d(q), _as_4d(k), _as_4d(v), scale, features), (mask, slopes, bias)


def describe_dispatch(q, k, v, *, causal: bool = False, window=None, softcap=None, alibi_slopes=None,
                      attn_bias=None, backend: str = "auto") -> Dispatch:
    """Which kernel `flash_attention_science` would run for these inputs, and why."""
    check_inputs(q, k, v, None, backend)
    check_flags(causal=causal)
    prob, _ = _normalise(q, k, v, None, make_mask(causal, window, softcap), alibi_slopes, attn_bias)
    return describe_plan(q, k, v, prob.features, backend)


def describe_plan(q, k, v, features: CallFeatures, backend: str, bias_grad: bool = False) -> Dispatch:
    """`describe_dispatch`'s sentences for checked inputs (the varlen front door's too)."""
    plan, why_not_sm90 = _dispatch(q, k, v, features, backend)
    if plan is not None:
        check_triton_layout(q, k, v)  # the call itself would raise here
    requested = "auto picks" if backend == "auto" else "requested:"
    names = sorted(feature_names(features, q.shape[-1], bias_grad))
    with_features = f" with {', '.join(names)}" if names else ""
    if plan is None:
        where = "backend='reference' was requested" if backend == "reference" else (
            "float64 has no tensor-core kernel" if q.is_cuda else f"{q.device.type} tensors run the PyTorch reference")
        return Dispatch("reference", "reference.attention_reference", where + with_features)
    tiles = plan.tiles
    shape = f"tiles {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages"
    if plan.kernel == "sm90":
        ctas = (f"persistent, one CTA per SM, {plan.q_buffers} Q buffer(s) per consumer"
                + (", consecutive query tiles overlapped" if plan.cross_item else "") if plan.persistent
                else "one CTA per query tile")
        why = (f"{requested} the Gluon sm_90 kernel{with_features} (TMA producer warp, two consumer warpgroups, "
               f"async wgmma, softmax overlapped with P·V; {ctas}); {shape}")
        missing_bwd = sm90_missing(feature_names(features, q.shape[-1], bias_grad), "backward")
        if missing_bwd:
            why += (f"; the backward runs the Triton kernels (the sm_90 backward does not take "
                    f"{', '.join(missing_bwd)} yet)")
        return Dispatch("hopper", "hopper.fwd_sm90.attention_forward_sm90_kernel", why, tiles.as_dict())
    traits = device_traits(q.device)
    where = "the Triton interpreter" if not q.is_cuda else f"sm_{traits.capability[0]}{traits.capability[1]}"
    tuned = q.is_cuda and autotune_enabled() and features.is_plain
    why = (f"{requested} the portable Triton kernel{with_features} on {where}"
           + (f" (not the sm_90 kernel: {why_not_sm90})" if why_not_sm90 else "")
           + ("; FLASHMOE_AUTOTUNE=1: tiles searched per shape, " if tuned else f"; {shape}, ")
           + ("TMA descriptors" if tiles.use_tma else "pointer loads"))
    if plan.portable:
        why += "; the backward runs the Triton kernels too"
    elif (q.is_cuda and traits.is_hopper and q.dtype in (torch.bfloat16, torch.float16) and _tma_compatible(q, k, v)
            and not sm90_missing(feature_names(features, q.shape[-1], bias_grad), "backward")):
        why += "; the backward runs the Gluon sm_90 kernels (where they take the head dim and length)"
    return Dispatch("triton", "triton_fwd._attention_forward_kernel", why, tiles.as_dict())


def _tma_compatible(q, k, v) -> bool:
    from flashmoe_science.attention.layout import tma_compatible

    # out = empty_like(q) shares q's strides or is contiguous; both are TMA-compatible when q is
    return tma_compatible(q, k, v)


def _hopper_unavailable(q, k, v, features: CallFeatures = PLAIN) -> str | None:
    """Why the Gluon sm_90 kernel should not take this call, or None when it should."""
    if not q.is_cuda or not device_traits(q.device).is_hopper:
        return "it needs a Hopper (sm_90) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "it runs bf16/fp16 only"
    gluon_off = unavailable_reason()
    if gluon_off is not None:
        return gluon_off
    missing = sm90_missing(feature_names(features, q.shape[-1]), "forward")
    if missing:
        return f"it does not take {', '.join(missing)} yet"
    if not _tma_compatible(q, k, v):
        return "TMA needs a unit last stride and 16-byte aligned base addresses and strides"
    return None


def _dispatch(q, k, v, features, backend: str) -> tuple[ForwardPlan | None, str | None]:
    """The kernel for this call (None: the PyTorch reference) and, on CUDA, why the sm_90 kernel was not taken.
    `features` is a `CallFeatures` (or the causal bool of a plain call).

    Runs on every call, so it only decides; `describe_plan` turns the decision into sentences.
    """
    if not isinstance(features, CallFeatures):
        features = PLAIN if features is False else CallFeatures(mask=make_mask(bool(features)))
    if backend == "reference" or (backend == "auto" and (not q.is_cuda or q.dtype == torch.float64)):
        return None, None
    if backend in ("triton", "hopper") and not q.is_cuda and not triton_interpreter_on():
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors, or TRITON_INTERPRET=1 to run the Triton kernels on the CPU "
            f"(slow; for tests), got tensors on {q.device}"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"backend={backend!r} supports bfloat16, float16 and float32, got {q.dtype}")

    why_not_sm90 = None
    if backend in ("auto", "hopper"):
        why_not_sm90 = _hopper_unavailable(q, k, v, features)
        if why_not_sm90 is None:
            # a right bound (causal or a window's) plans as causal: query tiles see unequal key ranges, and a
            # consumer may skip the CTA's last key tile (sm90_cross_item_safe)
            right_bounded = features.mask.bounded_right
            traits = device_traits(q.device)
            seqlen_q = q.shape[-2] if features.varlen is None else features.varlen.max_seqlen_q
            tiles = sm90_forward_tiles(q.shape[-1], right_bounded, seqlen_q)
            if features.varlen is not None and tiles.block_n == 128:
                # a packed batch with a right bound: the two-stage ring with two Q buffers measured +5.6% over the
                # causal plan's three stages (H200, 17 sequences of 64..8192, D=128: 421 vs 399 TFLOP/s)
                tiles = sm90_forward_tiles(q.shape[-1], False, seqlen_q)
            num_work = math.prod(q.shape[:-2]) * -(-seqlen_q // tiles.block_m)  # query tiles of all heads
            # Unequal items (what can make one CTA per tile win) come from a right bound without a left one; varlen
            # runs persistent always (the kernel numbers the real tiles itself)
            unequal = right_bounded and not features.mask.bounded_left
            persistent = features.varlen is not None or sm90_persistent(unequal, seqlen_q, num_work, traits.sm_count)
            q_buffers = sm90_q_buffers(tiles, q.shape[-1], persistent, traits)
            cross_item = sm90_cross_item(tiles, q.shape[-1], right_bounded, persistent, q_buffers)
            return ForwardPlan("sm90", tiles, persistent=persistent, q_buffers=q_buffers,
                               cross_item=cross_item, strict=backend == "hopper"), None
        if backend == "hopper":
            raise ValueError(f"backend='hopper' cannot run this call: {why_not_sm90}")
    return triton_plan(q, k, v, features, portable=backend == "triton"), why_not_sm90 if q.is_cuda else None


def triton_plan(q, k, v, features: CallFeatures, portable: bool = False) -> ForwardPlan:
    """The portable Triton forward's plan (also where a Gluon build failed: hopper.availability). ``portable``:
    backend="triton" was asked for, so the backward stays on the Triton kernels too."""
    tiles = forward_tiles(q.shape[-1], q.dtype, features.causal, device_traits(q.device))
    # decided here, once, so the launch and the report agree. Packed sequences are read with pointer loads: a
    # TMA box would cross into the next sequence's rows (and its stores would overwrite them).
    if tiles.use_tma and (features.varlen is not None or q.shape[-1] < 16 or not _tma_compatible(q, k, v)):
        tiles = replace(tiles, use_tma=False)
    return ForwardPlan("triton", tiles, portable=portable)


def _run(plan: ForwardPlan | None, q4, k4, v4, features: CallFeatures, scale, deterministic):
    if plan is None:
        return reference.attention_reference(q4, k4, v4, features, scale)
    return run_kernel(plan, q4, k4, v4, features, scale, deterministic)


# Calls whose signature ran before skip the checks, the plan and Triton's argument binding (host time per call:
# docs/perf-notes.md, session 4). Bounded (prepared_cache.CACHE_MAX). Plain calls only (no window, softcap,
# ALiBi or bias).
_PREPARED: dict[tuple, object] = {}


def _prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic) -> tuple | None:
    """Everything the checks, the plan and the kernel's specialisation read from a call, or None where the call must
    take the full path: autograd, or arguments of types whose equality would hide a failing check (True == 1)."""
    if (causal.__class__ is not bool or return_lse.__class__ is not bool or deterministic.__class__ is not bool
            or not (softmax_scale is None or softmax_scale.__class__ is float) or backend.__class__ is not str
            or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor))):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return (*map(tensor_signature, (q, k, v)), causal, softmax_scale, return_lse, backend, deterministic)


def _remember(key, plan: ForwardPlan, q, k, v, out, lse, causal, softmax_scale) -> None:
    """Keep this call's launch for the next call of its signature (the call just ran with `plan`)."""
    if plan.kernel == "sm90" and unavailable_reason() is not None:
        return  # it fell back to the Triton kernel: the next call plans (and remembers) that one
    if plan.kernel == "sm90":
        from flashmoe_science.attention.hopper.fwd_sm90 import prepare_forward

        num_ctas = device_traits(q.device).sm_count if plan.persistent else None
        prepared = prepare_forward(q, k, v, out, lse, causal, softmax_scale, plan.tiles, num_ctas, plan.q_buffers,
                                   plan.cross_item)
    else:
        from flashmoe_science.attention.triton_fwd import prepare_forward

        prepared = prepare_forward(q, k, v, out, lse, causal, softmax_scale, plan.tiles)
    remember(_PREPARED, key, prepared)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _checked_problem(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, attn_bias, backend,
                     **flags):
    """The full path's checks, normalisation and plan (shared by the front door and the lse functions)."""
    check_inputs(q, k, v, softmax_scale, backend)
    check_flags(causal=causal, **flags)
    mask = make_mask(causal, window, softcap)
    prob, extras = _normalise(q, k, v, softmax_scale, mask, alibi_slopes, attn_bias)
    plan, _ = _dispatch(q, k, v, prob.features, backend)
    if plan is not None:
        check_triton_layout(q, k, v)
    return prob, extras, plan


def flash_attention_science(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Exact scaled-dot-product attention, softmax(q kᵀ · scale) v, without materialising the score matrix.

    Args:
        q: `(..., Hq, Lq, D)` as in `torch.nn.functional.scaled_dot_product_attention`, or 2-D `(Lq, D)` for one
            head. Any strides with a unit-stride last dim: `x.view(B, L, H, D).transpose(1, 2)` runs without a copy.
        k, v: `(..., Hkv, Lk, D)` with the same leading dims; `Hq % Hkv == 0` gives GQA/MQA without copying k/v.
            Any head dim D in [1, 256] (the kernels pad the tile, never the tensors).
        causal: bottom-right aligned mask (flash-attn convention): query i sees key j iff `j <= i + Lk - Lq`;
            identical to SDPA's `is_causal` when Lq == Lk. A query that sees no key gets zeros and lse -inf.
        softmax_scale: defaults to `1 / sqrt(D)`.
        window: `(left, right)` sliding window, -1 = unbounded: query i sees key j iff
            `i + Lk - Lq - left <= j <= i + Lk - Lq + right`; with `causal` the right side is 0 (flash-attn's
            `window_size`). Key tiles outside every row's window are skipped (cost ~ the pairs inside).
        softcap: `c > 0`: scores become `c · tanh(s / c)` before the softmax (Gemma 2, Grok); None or 0: off.
        alibi_slopes: float32 `(Hq,)` or `(*batch, Hq)`: adds `-slope · |i + Lk - Lq - j|` to the (softcapped)
            scores, as flash-attn. The slopes get no gradient (a slope tensor requiring grad is refused).
        attn_bias: an additive float bias broadcastable to `q.shape[:-1] + (Lk,)` ((B, H, Lq, Lk) for 4-D q),
            added last; it gets a gradient when it requires grad (memory O(bias); see `autograd._bias_grad_buffer`).
            Read through stride-0 dims where it broadcasts (no copy); slower than the mask-only kernels.
        return_lse: also return the natural-log log-sum-exp of the (modified) scaled scores, float32
            `(..., Hq, Lq)` (float64 for float64 inputs), so partial results over key blocks can be merged.
        backend: "auto" (CUDA: the best kernel for the GPU; CPU: the PyTorch reference), "hopper" (the Gluon sm_90
            forward; a ValueError where it cannot run), "triton" (the portable kernels; on CPU tensors only under
            TRITON_INTERPRET=1), or "reference".
        deterministic: True, or `torch.use_deterministic_algorithms(True)`: the backward runs a dK/dV pass and a
            dQ pass, no atomics, bit-identical gradients run to run (a broadcast bias's gradient then goes through
            a (B, H, Lq, Lk) float32 buffer). False (default) allows, when q needs a
            gradient and k or v does too, one pass for all three that sums dQ with float32 atomics (dQ may then
            differ in its last bits run to run; dK and dV never do): on Hopper the Gluon sm_90 backward (head dims
            up to 128, after the sm_90 forward), under the Triton interpreter the fused Triton pass; other GPUs
            and head dims run the two passes either way. On Hopper, head dims 129..256 always run the Gluon
            dK/dV and dQ kernels (deterministic). The forward is always deterministic.
        q_descale, k_descale, v_descale: FP8 (forward only): with float8_e4m3fn q, k, v, float32 (B, Hkv) factors
            such that real value = fp8 value × descale (flash-attn's convention; `quantize_fp8` makes all six).
            The output is bfloat16. On Hopper, head dims 64/128/256 run an e4m3 tensor-core kernel; elsewhere the
            inputs are dequantised and the bf16 (GPU) or float32 (CPU) path runs. See attention/fp8.py.

    Kernels: on Hopper, bf16/fp16 with TMA-compatible strides and only the features the Gluon kernels take
    (`hopper.SM90_FORWARD_FEATURES`) run the Gluon sm_90 kernel (warp-specialised: TMA producer warp, two consumer
    warpgroups, async wgmma; persistent CTAs except causal rows longer than 8192, or than 4096 with fewer than 12
    query tiles per SM); everything else on a GPU runs the portable Triton kernel; CPU tensors run the PyTorch
    reference. `describe_dispatch` says which and why.

    Accuracy: bf16/fp16 inputs are multiplied on tensor cores with float32 accumulation and a float32 softmax.
    float32 inputs use 3xTF32 tensor-core products on the GPU (close to float32 accuracy, about 3x the cost of
    TF32); the CPU reference computes float32 exactly.

    Returns:
        `out` with q's shape and dtype, or `(out, lse)` when `return_lse=True`.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        from flashmoe_science.integrations import ops

        return ops.compiled_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                      return_lse=return_lse, backend=backend, deterministic=deterministic,
                                      fp8_descales=(q_descale, k_descale, v_descale))
    if on_another_cuda_device(q):
        with torch.cuda.device(q.device):  # Triton launches on the current device: make it q's
            return flash_attention_science(
                q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_lse=return_lse, backend=backend,
                deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or getattr(q, "dtype", None) in _FP8_DTYPES or getattr(k, "dtype", None) in _FP8_DTYPES
            or getattr(v, "dtype", None) in _FP8_DTYPES):
        if not (window is None and softcap is None and alibi_slopes is None and attn_bias is None):
            raise ValueError("FP8 attention takes causal masks only: window, softcap, alibi_slopes and attn_bias "
                             "are not supported with float8_e4m3fn inputs")
        from flashmoe_science.attention.fp8 import fp8_front_door

        return fp8_front_door(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, return_lse, backend,
                              deterministic)
    plain = window is None and softcap is None and alibi_slopes is None and attn_bias is None
    key = _prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic) if plain else None
    prepared = _PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks and plan as then
        out, lse = new_outputs(q)
        prepared(q, k, v, out, lse)
        return (out, lse) if return_lse else out

    prob, (mask, slopes, bias), plan = _checked_problem(
        q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, attn_bias, backend,
        return_lse=return_lse, deterministic=deterministic)

    if q.numel() == 0 or k.shape[-2] == 0:
        # Nothing to attend over (or nobody asking): zero output, -inf log-sum-exp; still differentiable.
        out = _NoKeys.apply(q, k, v)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the reference's
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
        return (out, lse) if return_lse else out

    if prob.q is not None and prob.k is not None and prob.v is not None:
        out4, lse4 = _run(plan, prob.q, prob.k, prob.v, prob.features, prob.softmax_scale, deterministic)
        out, lse = out4.view(q.shape), lse4.view(q.shape[:-1])
        if key is not None and plan is not None and q.is_cuda and q.dim() == 4 and not autotune_enabled():
            _remember(key, plan, q, k, v, out, lse, causal, prob.softmax_scale)
    else:
        # Leading dims whose strides cannot merge into one batch dim: run each leading index on its own
        # (no input copies; the outputs are stacked).
        outs, lses = [], []
        for index in itertools.product(*(range(n) for n in q.shape[:-4])):
            features = _features_4d(mask, slopes, bias, index)
            o, l = _run(plan, q[index], k[index], v[index], features, prob.softmax_scale, deterministic)
            outs.append(o)
            lses.append(l)
        out = torch.stack(outs).view(q.shape)
        lse = torch.stack(lses).view(q.shape[:-1])
    return (out, lse) if return_lse else out


def attention_forward_lse(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window=None,
                          softcap=None, alibi_slopes=None, attn_bias=None, backend: str = "auto"):
    """`(out, lse)` of `flash_attention_science` without autograd (for callers that run the backward themselves
    through `attention_backward_lse`, e.g. ring attention merging partial results by their lse)."""
    with torch.no_grad():
        return flash_attention_science(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                       softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                       return_lse=True, backend=backend)


def attention_backward_lse(q, k, v, out, lse, grad_out, *, causal: bool = False, softmax_scale: float | None = None,
                           window=None, softcap=None, alibi_slopes=None, backend: str = "auto",
                           deterministic: bool = False):
    """`(dq, dk, dv)` of attention given its output `out` and natural-log `lse` (those of `attention_forward_lse`,
    or merged ones: with a merged out and lse over several key blocks this gives each block's share of the
    gradients, as ring attention needs). Runs the same backward kernels as autograd would after
    `flash_attention_science` with these arguments (Gluon sm_90 / Triton / the reference). q, k, v as there,
    with leading dims that merge into one batch dim; out and grad_out of q's shape; lse of shape q.shape[:-1],
    float32 (float64 for float64 inputs)."""
    prob, _, plan = _checked_problem(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, None, backend,
                                     deterministic=deterministic)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    for name, t, shape, dtype in (("out", out, q.shape, q.dtype), ("grad_out", grad_out, q.shape, q.dtype),
                                  ("lse", lse, q.shape[:-1], lse_dtype)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape or t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} on {q.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if prob.q is None or prob.k is None or prob.v is None:
        raise ValueError("attention_backward_lse needs q, k, v whose leading dims merge into one batch dim")
    if plan is not None and lse.stride(-1) != 1:
        lse = lse.contiguous()  # (B·H·Lq floats: the kernels index it densely)
    out4, grad4 = _as_4d(out), _as_4d(grad_out)
    if out4 is None or grad4 is None:
        raise ValueError("out and grad_out must have leading dims that merge into one batch dim")
    lse4 = lse.reshape(*prob.q.shape[:3])
    if q.numel() == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if plan is None:
        dq, dk, dv, _ = reference.attention_backward_reference(prob.q, prob.k, prob.v, out4, lse4, grad4,
                                                               prob.features, prob.softmax_scale)
    else:
        check_triton_layout(out4, grad4, grad4, names=("out", "grad_out", "grad_out"))
        dq, dk, dv, _ = kernel_backward(prob.q, prob.k, prob.v, out4, lse4.contiguous(), grad4, prob.features,
                                        prob.softmax_scale, plan=plan, deterministic=deterministic)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
