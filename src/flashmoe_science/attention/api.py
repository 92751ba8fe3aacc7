"""The dense attention front door: `flash_attention_science`, its lse variants, and `describe_dispatch`.

Each public function routes a torch.compile trace to its custom op (attention/ops.py), runs a call on another GPU
under that GPU, and otherwise hands its arguments to the layer below (`attention.call`: checked problem -> plan ->
execute). Kernels behind it receive only checked 4-D tensors `(B, H, L, D)` with unit stride in the last dim; they
never validate user input or allocate behind the planner's back.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention import call, ops
from flashmoe_science.attention.checks import check_flags, check_inputs
from flashmoe_science.attention.features import plain_call
from flashmoe_science.attention.fp8 import fp8_problem
from flashmoe_science.attention.plan import BACKENDS, Dispatch, describe, describe_fp8, plan_attention, plan_fp8  # noqa: F401,E501 (BACKENDS: the names `backend=` takes)
from flashmoe_science.attention.problem import dense_problem
from flashmoe_science.attention.reference import default_softmax_scale
from flashmoe_science.device import on_another_cuda_device

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_call(q, k, v, descales, window, softcap, alibi_slopes, attn_bias, mods=(None, None)) -> bool:
    """Whether a call is an FP8 one (e4m3 inputs or a descale given); raises for the features FP8 does not take."""
    if not (any(t is not None for t in descales) or any(getattr(t, "dtype", None) in _FP8_DTYPES for t in (q, k, v))):
        return False
    if not plain_call(window, softcap, alibi_slopes, attn_bias, *mods):
        raise ValueError("FP8 attention takes causal masks only: window, softcap, alibi_slopes, attn_bias, mask_mod "
                         "and score_mod are not supported with float8_e4m3fn inputs")
    return True


def describe_dispatch(q, k, v, *, causal: bool = False, window=None, softcap=None, alibi_slopes=None,
                      attn_bias=None, backend: str = "auto", q_descale=None, k_descale=None,
                      v_descale=None, mask_mod=None, score_mod=None) -> Dispatch:
    """Which kernels `flash_attention_science` would run for these inputs (forward and backward), and why. FP8
    inputs (with their descales) are described as the FP8 forward plans them."""
    if _fp8_call(q, k, v, (q_descale, k_descale, v_descale), window, softcap, alibi_slopes, attn_bias,
                 (mask_mod, score_mod)):
        return describe_fp8(plan_fp8(fp8_problem(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                                                 softmax_scale=None, backend=backend)))
    problem, _ = dense_problem(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                               attn_bias=attn_bias, backend=backend, mask_mod=mask_mod, score_mod=score_mod)
    return describe(plan_attention(problem))


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
    mask_mod=None,
    score_mod=None,
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
            added last; it gets a gradient when it requires grad (memory O(bias); see
            `triton.backend.bias_grad_buffer`). Read through stride-0 dims where it broadcasts (no copy); on Hopper
            by TMA tiles beside K where its query and key dims are its own with 16-byte aligned rows, else by
            masked loads (the forward; the backward then runs the Triton kernels).
        return_lse: also return the natural-log log-sum-exp of the (modified) scaled scores, float32
            `(..., Hq, Lq)` (float64 for float64 inputs), so partial results over key blocks can be merged.
        backend: "auto" (CUDA: the best kernel for the GPU; CPU: the PyTorch reference), "hopper" (the Gluon sm_90
            forward; a ValueError where it cannot run), "triton" (the portable kernels; on CPU tensors only under
            TRITON_INTERPRET=1), or "reference".
        deterministic: True, or `torch.use_deterministic_algorithms(True)`: bit-identical gradients run to run
            (a broadcast bias's gradient then goes through a (B, H, Lq, Lk) float32 buffer): on Hopper the Gluon
            sm_90 one pass up to D=128 with its dQ reduce-adds in key-block order, elsewhere a dK/dV pass and a
            dQ pass without atomics. False (default) allows, when q needs a
            gradient and k or v does too, one pass for all three that sums dQ with float32 atomics (dQ may then
            differ in its last bits run to run; dK and dV never do): on Hopper the Gluon sm_90 backward (head dims
            up to 128, after the sm_90 forward), under the Triton interpreter the fused Triton pass; other GPUs
            and head dims run the two passes either way. On Hopper, head dims 129..256 always run the Gluon
            dK/dV and dQ kernels (deterministic). The forward is always deterministic.
        q_descale, k_descale, v_descale: FP8 (forward only): with float8_e4m3fn q, k, v, float32 (B, Hkv) factors
            such that real value = fp8 value × descale (flash-attn's convention; `quantize_fp8` makes all six).
            The output is bfloat16. On Hopper, head dims 64/128/256 run an e4m3 tensor-core kernel; elsewhere the
            inputs are dequantised and the bf16 (GPU) or float32 (CPU) path runs. See attention/fp8.py.
        mask_mod: FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool` as a `@triton.jit` function, or
            `MaskMod(fn, *tensors)` for one that reads tensors (passed after the indices); ANDed with causal and
            window. Tiles it hides are skipped (a block mask built on the device, remembered per mod and shape).
        score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score` on the scaled score, `@triton.jit`, or
            `ScoreMod(fn, *tensors, grad=dfn)`; gradients need `grad`, its derivative with respect to the score.
            Not with softcap, alibi_slopes or attn_bias. The mods run in the portable Triton kernels (and the
            reference, through Triton's interpreter); under torch.compile a call with mods graph-breaks and runs
            eagerly. See attention/mods.py.

    Kernels: the first family of `plan.ATTENTION_BACKENDS` that takes the call, each family declaring what it takes
    (the README's table is `plan.policy_table()`, generated from those declarations); `describe_dispatch` says
    which, why, and with which tiles and schedule.

    Accuracy: bf16/fp16 inputs are multiplied on tensor cores with float32 accumulation and a float32 softmax.
    float32 inputs use 3xTF32 tensor-core products on the GPU (close to float32 accuracy, about 3x the cost of
    TF32); the CPU reference computes float32 exactly.

    Returns:
        `out` with q's shape and dtype, or `(out, lse)` when `return_lse=True`.
    """
    if mask_mod is not None or score_mod is not None:
        if torch.compiler.is_compiling():  # a function is no custom op argument: run this call eagerly
            return _eager_with_mods(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                    softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                    return_lse=return_lse, backend=backend, deterministic=deterministic,
                                    q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                    mask_mod=mask_mod, score_mod=score_mod)
        if on_another_cuda_device(q):
            with torch.cuda.device(q.device):
                return flash_attention_science(
                    q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_lse=return_lse, backend=backend,
                    deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                    mask_mod=mask_mod, score_mod=score_mod)
        _fp8_call(q, k, v, (q_descale, k_descale, v_descale), window, softcap, alibi_slopes, attn_bias,
                  (mask_mod, score_mod))
        out, lse = call.dense_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                      backend=backend, deterministic=deterministic, return_lse=return_lse, key=None,
                                      mask_mod=mask_mod, score_mod=score_mod)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        out, lse = _compiled(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_lse=return_lse, backend=backend,
                             deterministic=deterministic, fp8_descales=(q_descale, k_descale, v_descale))
        return (out, lse) if return_lse else out
    if on_another_cuda_device(q):
        with torch.cuda.device(q.device):  # Triton launches on the current device: make it q's
            return flash_attention_science(
                q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_lse=return_lse, backend=backend,
                deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if _fp8_call(q, k, v, (q_descale, k_descale, v_descale), window, softcap, alibi_slopes, attn_bias):
        out, lse = call.fp8_forward(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                                    softmax_scale=softmax_scale, backend=backend, deterministic=deterministic,
                                    return_lse=return_lse)
        return (out, lse) if return_lse else out
    # the host path of a repeated plain call: a dict lookup and the prepared launch (call.PREPARED)
    key = (call.prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic)
           if plain_call(window, softcap, alibi_slopes, attn_bias) else None)
    entry = call.PREPARED.get(key) if key is not None else None
    if entry is not None:
        out, lse = call.replay(entry, q, k, v)
    else:
        out, lse = call.dense_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                                      backend=backend, deterministic=deterministic, return_lse=return_lse, key=key)
    return (out, lse) if return_lse else out


# A call with mods inside a compiled region: a graph break, then the eager call (mods.py: functions are not tensors,
# so no custom op can take them).
_eager_with_mods = torch.compiler.disable(flash_attention_science,
                                          reason="mask_mod/score_mod are functions: no custom op takes them")


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
    return call.dense_backward(q, k, v, out, lse, grad_out, causal=causal, softmax_scale=softmax_scale,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes, backend=backend,
                               deterministic=deterministic)


def _compiled(q, k, v, *, causal, softmax_scale, window, softcap, alibi_slopes, attn_bias, return_lse, backend,
              deterministic, fp8_descales):
    """`(out, lse)` of `flash_attention_science` as the compiler traces it: the `attention_forward` custom op on
    `(B, H, L, D)` views (its fake implementation runs the checks at trace time)."""
    if any(t is not None for t in fp8_descales):
        raise ValueError("the FP8 forward (q_descale, k_descale, v_descale) has no torch.compile custom op yet: "
                         "call it outside the compiled region (torch.compiler.disable)")
    if attn_bias is not None:
        raise ValueError("attn_bias has no torch.compile custom op yet: call flash_attention_science with a bias "
                         "outside the compiled region (torch.compiler.disable)")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):  # the eager message, before any shape is read
        check_inputs(q, k, v, softmax_scale)
    check_flags(return_lse=return_lse)
    slopes = alibi_slopes
    if slopes is not None and slopes.dim() > 2:  # (*batch, H) slopes follow q's leading dims into one batch dim
        slopes = slopes.reshape(-1, slopes.shape[-1])
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = ops.attention_forward(
        _compiled_4d(q), _compiled_4d(k), _compiled_4d(v), causal, scale,
        None if window is None else [int(side) for side in window], softcap, slopes, backend, deterministic)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _compiled_4d(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) of a 2-D, 3-D, 4-D or deeper tensor (a view; a copy only where deeper leading dims cannot
    merge, which eager mode avoids by looping and a compiled graph cannot)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])
