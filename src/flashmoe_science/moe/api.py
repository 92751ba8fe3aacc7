"""The MoE front door: input checks, backend choice, autograd.

Kernels behind this file take already-checked tensors and never validate user input. An inference call whose
signature ran before skips the checks and the launch planning (``_PREPARED``, at the end of this file).
"""


import torch

from flashmoe_science.device import on_another_cuda_device, triton_interpreter_on
from flashmoe_science.prepared_cache import remember, tensor_signature
from flashmoe_science.moe.reference import fused_experts_reference
from flashmoe_science.moe.routing import SCORING_FUNCTIONS, route

BACKENDS = ("auto", "triton", "reference")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------- checks
def _check_tensor(name, value, ndim, dtypes=None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")


def _check_same_device(name, value, x):
    if value.device != x.device:
        raise ValueError(f"{name} is on {value.device} but x is on {x.device}; all tensors must share a device")


def _check_top_k(top_k, num_experts):
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def _check_routing_options(renormalize, scoring):
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring must be one of {SCORING_FUNCTIONS}, got {scoring!r}")


def _check_router_logits(router_logits, num_tokens=None, num_experts=None):
    _check_tensor("router_logits", router_logits, 2, _FLOAT_DTYPES)
    if num_tokens is not None and router_logits.shape[0] != num_tokens:
        raise ValueError(
            f"router_logits must have x.shape[0]={num_tokens} rows, got shape {tuple(router_logits.shape)}"
        )
    if num_experts is not None and router_logits.shape[1] != num_experts:
        raise ValueError(
            f"router_logits must have num_experts={num_experts} columns (w1.shape[0]), "
            f"got shape {tuple(router_logits.shape)}"
        )


def _check_experts(x, w1, w2):
    """Checks x (T, d), w1 (E, 2F, d), w2 (E, d, F); returns (T, d, E, F)."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("w1", w1, 3)
    _check_tensor("w2", w2, 3)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} dtype {w.dtype} must match x dtype {x.dtype}")
        _check_same_device(name, w, x)
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, w1_d_model = w1.shape
    if w1_d_model != d_model:
        raise ValueError(f"w1 must have shape (E, 2*F, d) with d = x.shape[1] = {d_model}, got {tuple(w1.shape)}")
    if two_d_ff == 0 or two_d_ff % 2 != 0:
        raise ValueError(f"w1.shape[1] must be 2*F (gate rows then up rows) with F >= 1, got {tuple(w1.shape)}")
    if num_experts == 0:
        raise ValueError(f"w1 must hold at least one expert, got shape {tuple(w1.shape)}")
    d_ff = two_d_ff // 2
    if tuple(w2.shape) != (num_experts, d_model, d_ff):
        raise ValueError(f"w2 must have shape (E, d, F) = {(num_experts, d_model, d_ff)}, got {tuple(w2.shape)}")
    return num_tokens, d_model, num_experts, d_ff


def _check_topk(topk_weights, topk_ids, num_tokens, x):
    _check_tensor("topk_weights", topk_weights, 2, _FLOAT_DTYPES)
    _check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    if topk_weights.shape[0] != num_tokens:
        raise ValueError(f"topk_weights must have x.shape[0]={num_tokens} rows, got shape {tuple(topk_weights.shape)}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids shape {tuple(topk_ids.shape)} must equal topk_weights shape {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have at least one column (top_k >= 1), got shape {tuple(topk_ids.shape)}")
    _check_same_device("topk_weights", topk_weights, x)
    _check_same_device("topk_ids", topk_ids, x)


def _choose_backend(backend, x):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    triton_ok = (x.is_cuda or triton_interpreter_on()) and x.dtype in _TRITON_DTYPES and _triton_importable()
    if backend == "triton":
        if not triton_ok:
            raise ValueError(
                "backend='triton' needs triton, x on a CUDA device (or TRITON_INTERPRET=1 on CPU) and dtype in "
                f"(float16, bfloat16, float32); got x on {x.device} with dtype {x.dtype}"
            )
        return "triton"
    if backend == "auto":
        return "triton" if triton_ok and x.is_cuda else "reference"
    return "reference"


def _triton_importable():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- autograd
class _FusedExpertsTriton(torch.autograd.Function):
    """Triton forward/backward; the token sort is computed once and reused by the backward."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_weights, topk_ids):
        from flashmoe_science.moe import layer

        weights32 = topk_weights.float().contiguous()
        out, saved = layer.moe_forward(x, w1, w2, weights32, topk_ids, save_for_backward=True)
        ctx.saved_sort = saved
        ctx.weights_dtype = topk_weights.dtype
        ctx.save_for_backward(x, w1, w2, weights32)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from flashmoe_science.moe import layer

        x, w1, w2, weights32 = ctx.saved_tensors
        need_dx, need_dw1, need_dw2, need_dweights = ctx.needs_input_grad[:4]
        dx, dw1, dw2, dweights = layer.moe_backward(
            grad_out, x, w1, w2, weights32, ctx.saved_sort, need_dx=need_dx, need_dw1=need_dw1, need_dw2=need_dw2)
        return dx, dw1, dw2, dweights.to(ctx.weights_dtype) if need_dweights else None, None


# ------------------------------------------------------------------------------------------- public API
def moe_route(router_logits, top_k, renormalize=True, scoring="softmax"):
    """Router logits ``(T, E)`` -> ``(topk_weights, topk_ids)``, both ``(T, top_k)``.

    Scores are ``softmax`` (over all E experts) or ``sigmoid`` of the logits, computed in float32; the top_k best
    experts are kept and, with ``renormalize``, their weights rescaled to sum to 1. Weights are float32 (float64 for
    float64 logits), ids int64. Differentiable with respect to ``router_logits``.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        from flashmoe_science.integrations import ops

        return ops.compiled_moe_route(router_logits, top_k, renormalize, scoring)
    _check_router_logits(router_logits)
    _check_top_k(top_k, router_logits.shape[1])
    _check_routing_options(renormalize, scoring)
    return route(router_logits, top_k, renormalize, scoring)


def fused_experts(x, w1, w2, topk_weights, topk_ids, *, backend="auto"):
    """SwiGLU experts for already-routed tokens; returns ``(T, d)`` in ``x.dtype``.

    ``x: (T, d)``; ``w1: (E, 2F, d)``, rows ``[0:F]`` the gate and ``[F:2F]`` the up projection; ``w2: (E, d, F)``;
    ``topk_weights: (T, k)`` float; ``topk_ids: (T, k)`` int32/int64, ids outside ``[0, E)`` mark dropped slots.
    ``backend``: ``"auto"`` (Triton on CUDA, else the PyTorch reference), ``"triton"`` or ``"reference"``.
    Differentiable with respect to x, w1, w2 and topk_weights.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        from flashmoe_science.integrations import ops

        return ops.compiled_fused_experts(x, w1, w2, topk_weights, topk_ids, backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return fused_experts(x, w1, w2, topk_weights, topk_ids, backend=backend)
    key = _experts_key(x, w1, w2, topk_weights, topk_ids, backend)
    prepared = _PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks, backend and tiles as then
        return prepared(x, w1, w2, topk_weights.float().contiguous(), topk_ids)

    num_tokens, _, _, _ = _check_experts(x, w1, w2)
    _check_topk(topk_weights, topk_ids, num_tokens, x)
    return _run_experts(x, w1, w2, topk_weights, topk_ids, _choose_backend(backend, x), key)


def _run_experts(x, w1, w2, topk_weights, topk_ids, backend: str, key: tuple | None,
                 wrap_prepared=lambda prepared: prepared):
    """The experts on checked inputs, with the backend already chosen. An inference call with a prepared-call
    ``key`` leaves its launches in ``_PREPARED`` for the next call of its signature (``wrap_prepared`` wraps a batched
    forward's PreparedForward for a fused_moe key: the routing runs first)."""
    if backend == "reference":
        return fused_experts_reference(x, w1, w2, topk_weights, topk_ids)
    if _records_grad(x, w1, w2, topk_weights):
        return _FusedExpertsTriton.apply(x, w1, w2, topk_weights, topk_ids)
    from flashmoe_science.moe import layer, triton_decode

    # Inference: skip autograd's bookkeeping, a measurable share of host time on few tokens.
    weights32 = topk_weights.float().contiguous()
    if triton_decode.decode_applies(x.shape[0], w1.shape[0]):
        out, launch = triton_decode.decode_forward(x, w1, w2, weights32, topk_ids, topk_ids.shape[1])
        _remember(key, x, lambda: triton_decode.PreparedDecode(launch))
        return out
    out, saved = layer.moe_forward(x, w1, w2, weights32, topk_ids)
    _remember(key, x, lambda: wrap_prepared(layer.prepare_forward(x, w1, w2, weights32, topk_ids, saved.tiles)))
    return out


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fused_moe(x, w1, w2, router_logits, top_k, *, renormalize=True, scoring="softmax", backend="auto"):
    """A whole MoE FFN layer: route ``router_logits`` ``(T, E)`` to ``top_k`` experts, run them, combine.

    Equivalent to ``fused_experts(x, w1, w2, *moe_route(router_logits, top_k, renormalize, scoring))``; gradients
    reach the router logits through the routing weights.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        from flashmoe_science.integrations import ops

        return ops.compiled_fused_moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return fused_moe(x, w1, w2, router_logits, top_k, renormalize=renormalize, scoring=scoring,
                             backend=backend)
    key = _moe_key(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    prepared = _PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks, backend and tiles as then
        return prepared(x, w1, w2, router_logits)

    num_tokens, _, num_experts, _ = _check_experts(x, w1, w2)
    _check_router_logits(router_logits, num_tokens, num_experts)
    _check_same_device("router_logits", router_logits, x)
    _check_top_k(top_k, num_experts)
    _check_routing_options(renormalize, scoring)
    chosen = _choose_backend(backend, x)  # before the routing work: a bad backend fails first
    if chosen == "triton" and router_logits.dtype in _TRITON_DTYPES and not _records_grad(x, w1, w2, router_logits):
        from flashmoe_science.moe import triton_decode

        if triton_decode.decode_applies(num_tokens, num_experts):  # routing inside the one decode launch
            out, launch = triton_decode.decode_forward(x, w1, w2, router_logits, None, top_k, route=True,
                                                       renormalize=renormalize, sigmoid=scoring == "sigmoid")
            _remember(key, x, lambda: triton_decode.PreparedDecode(launch))
            return out
    topk_weights, topk_ids = route(router_logits, top_k, renormalize, scoring)  # well-formed by construction
    return _run_experts(x, w1, w2, topk_weights, topk_ids, chosen, key,
                        wrap_prepared=lambda forward: _RoutedForward(forward, top_k, renormalize, scoring))


# ------------------------------------------------------------------------------------------ prepared calls
# Inference calls whose signature ran before skip the checks, the tiles and Triton's argument binding of the
# forward's launches (launch-bound on few tokens: docs/perf-notes.md). Bounded: each token count is a new
# signature (prepared_cache.CACHE_MAX).
_PREPARED: dict[tuple, object] = {}


def _remember(key: tuple | None, x, make_prepared) -> None:
    """Keep ``make_prepared()`` under ``key`` for the next call of its signature (compiled kernels only: not under
    the interpreter)."""
    if key is None or not x.is_cuda or x.shape[0] == 0:
        return
    remember(_PREPARED, key, make_prepared())


class _RoutedForward:
    """A fused_moe key's prepared call on the batched path: the routing, then the PreparedForward."""

    __slots__ = ("forward", "top_k", "renormalize", "scoring")

    def __init__(self, forward, top_k: int, renormalize: bool, scoring: str):
        self.forward, self.top_k, self.renormalize, self.scoring = forward, top_k, renormalize, scoring

    def __call__(self, x, w1, w2, router_logits):
        # the routing's outputs (dtypes, (T, k) shapes, fresh allocations) follow from the logits' signature
        topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize, self.scoring)
        return self.forward(x, w1, w2, topk_weights.float().contiguous(), topk_ids)


def _signatures(*tensors) -> tuple | None:
    """Each tensor's shape, strides, dtype, device and 16-byte alignment (all that the checks, the tiles and the
    kernels' specialisation read from it), or None where one is not a tensor or autograd records the call."""
    grad_enabled = torch.is_grad_enabled()
    key = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (grad_enabled and t.requires_grad):
            return None
        key.append(tensor_signature(t))
    return tuple(key)


def _experts_key(x, w1, w2, topk_weights, topk_ids, backend) -> tuple | None:
    """A ``fused_experts`` call's prepared-call key, or None where it must take the full path (autograd, or a
    backend that is no str)."""
    if backend.__class__ is not str:
        return None
    signatures = _signatures(x, w1, w2, topk_weights, topk_ids)
    return None if signatures is None else ("experts", backend, *signatures)


def _moe_key(x, w1, w2, router_logits, top_k, renormalize, scoring, backend) -> tuple | None:
    """A ``fused_moe`` call's prepared-call key, or None where it must take the full path: autograd, or arguments
    of types whose equality would hide a failing check (True == 1)."""
    if (top_k.__class__ is not int or renormalize.__class__ is not bool or scoring.__class__ is not str
            or backend.__class__ is not str):
        return None
    signatures = _signatures(x, w1, w2, router_logits)
    return None if signatures is None else ("moe", top_k, renormalize, scoring, backend, *signatures)
