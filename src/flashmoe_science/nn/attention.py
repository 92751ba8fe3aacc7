"""``Attention``: multi-head / grouped-query self-attention with rotary position embeddings on
``flash_attention_science``, and ``TransformerBlock``: pre-norm attention plus a SwiGLU MLP or a ``FusedMoE``.

Shapes follow ``nn.MultiheadAttention(batch_first=True)``: ``(B, L, d_model)`` in and out. The q, k, v projections
are one Linear whose output, viewed ``(B, L, heads, head_dim)`` and transposed to ``(B, heads, L, head_dim)``,
reaches the kernels without a copy; the kernels' output comes back in the same ``(B, L, heads, head_dim)`` memory
order, so the output projection reads it without a copy too.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from flashmoe_science.attention.api import BACKENDS, flash_attention_science
from flashmoe_science.moe.plan import BACKENDS as MOE_BACKENDS
from flashmoe_science.nn.moe import FusedMoE, _check_positive_int


@functools.lru_cache(maxsize=None)
def attention_keywords() -> frozenset[str]:
    """The keyword arguments ``flash_attention_science`` accepts in this version (``window``, ``softcap`` arrive
    with the variable-length work): layers check their options against it when built, not at the first call."""
    return frozenset(inspect.signature(flash_attention_science).parameters)


def require_attention_feature(keyword: str, what: str) -> None:
    """A ValueError naming `what` where ``flash_attention_science`` has no `keyword` argument."""
    if keyword not in attention_keywords():
        raise ValueError(f"{what} is not supported by this version of flash_attention_science "
                         f"(it has no {keyword!r} argument)")


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin of the rotary angles ``positions[..., None] * theta ** (-2i / head_dim)``, ``(..., head_dim / 2)``
    (computed in float32; one outer product, no loop over positions)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions.to(torch.float32)[..., None] * torch.pow(theta, -exponents)
    return angles.cos().to(dtype), angles.sin().to(dtype)


_ROTARY_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel computes in float32


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x (B, L, H, D)`` in the "rotate half" convention (Llama, GPT-NeoX, Hugging Face): the
    pair (x[i], x[i + D/2]) is rotated by angle i. ``cos``/``sin``: ``(L, D/2)`` or ``(B, L, D/2)``.

    Eager on CUDA: one Triton launch each way (nn/triton_rotary.py); elsewhere, and under torch.compile (which fuses
    it), these PyTorch ops."""
    if (x.is_cuda and x.dtype in _ROTARY_KERNEL_DTYPES and x.stride(-1) == 1
            and not torch.compiler.is_compiling()):
        from flashmoe_science.nn.triton_rotary import RotaryTriton

        return RotaryTriton.apply(x, cos.contiguous(), sin.contiguous())
    return apply_rotary_torch(x, cos, sin)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in PyTorch ops (any device; what torch.compile traces)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Attention(nn.Module):
    """Self-attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads (GQA/MQA when fewer), rotary
    position embeddings (``rope_theta``; None: none), optional RMSNorm of q and k per head (``qk_norm``, as Qwen3),
    a sliding ``window`` of keys to the left (None: all), logit ``softcap`` (None: none). ``causal`` (default) for a
    decoder. ``backend`` as ``flash_attention_science``'s.

    ``forward(x, positions=None)``: x ``(B, L, d_model)``; positions ``(L,)`` or ``(B, L)`` integer positions for
    the rotary embedding (default ``arange(L)``).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None, *,
                 rope_theta: float | None = 10000.0, qk_norm: bool = False, window: int | None = None,
                 softcap: float | None = None, bias: bool = False, causal: bool = True, norm_eps: float = 1e-6,
                 backend: str = "auto", device=None, dtype=None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            _check_positive_int(name, value)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads}) when head_dim is None")
            head_dim = d_model // n_heads
        _check_positive_int("head_dim", head_dim)
        if head_dim % 2 and rope_theta is not None:
            raise ValueError(f"the rotary embedding needs an even head_dim, got {head_dim}")
        if rope_theta is not None and not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0 or None, got {rope_theta}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.attention_options = {"causal": causal, "backend": backend}
        if window is not None:
            _check_positive_int("window", window)
            require_attention_feature("window", "a sliding window")
            self.attention_options["window"] = (window, 0 if causal else window)
        if softcap is not None:
            if not softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {softcap}")
            require_attention_feature("softcap", "logit soft-capping")
            self.attention_options["softcap"] = float(softcap)
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.rope_theta, self.window, self.softcap = rope_theta, window, softcap
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias, **factory)
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=bias, **factory)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps, **factory) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps, **factory) if qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (batch, length, d_model={self.d_model}), got shape {tuple(x.shape)}")
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            if positions is None:
                positions = torch.arange(length, device=x.device)
            cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, L, D) views
        return self.out(out.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding of ``x (B, L, H, D)`` (a subclass may swap it, e.g. for a baseline)."""
        return apply_rotary(x, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention itself on ``(B, H, L, D)`` views (a subclass may swap it, e.g. for a baseline)."""
        return flash_attention_science(q, k, v, **self.attention_options)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, rope_theta={self.rope_theta}, qk_norm={self.q_norm is not None}, "
                f"window={self.window}, softcap={self.softcap}, causal={self.attention_options['causal']}")


class SwiGLU(nn.Module):
    """The dense feed-forward of Llama-style models: ``down(silu(x W_gate) * x W_up)``, with gate and up as one
    Linear (``gate_up``: gate rows then up rows, the layout of ``FusedMoE.w1`` per expert)."""

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = False, device=None, dtype=None):
        super().__init__()
        _check_positive_int("d_model", d_model)
        _check_positive_int("d_ff", d_ff)
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """A pre-norm decoder block: ``x + attention(norm(x))``, then ``+ ffn(norm(x))`` where the ffn is a ``FusedMoE``
    of ``num_experts`` SwiGLU experts (top ``top_k``) or, with ``num_experts=None``, a dense ``SwiGLU``. Norms are
    ``nn.RMSNorm``. Attention options (``n_kv_heads``, ``head_dim``, ``rope_theta``, ``qk_norm``, ``window``,
    ``softcap``, ``bias``, ``causal``) as ``Attention``'s; ``backend`` goes to both the attention and the MoE.
    ``attention_class`` / ``moe_class``: subclasses of ``Attention`` / ``FusedMoE`` to build instead (same
    parameters, another computation: e.g. a PyTorch baseline)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, num_experts: int | None = None, top_k: int = 2,
                 norm_eps: float = 1e-6, backend: str = "auto", attention_class: type = Attention,
                 moe_class: type = FusedMoE, device=None, dtype=None, **attention_options):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.attention_norm = nn.RMSNorm(d_model, eps=norm_eps, **factory)
        self.attention = attention_class(d_model, n_heads, norm_eps=norm_eps, backend=backend, **attention_options,
                                   **factory)
        self.ffn_norm = nn.RMSNorm(d_model, eps=norm_eps, **factory)
        if num_experts is None:
            self.ffn = SwiGLU(d_model, d_ff, bias=attention_options.get("bias", False), **factory)
        else:
            # the MoE layer's walk has no architecture family of its own to ask for: an attention one means "auto"
            moe_backend = backend if backend in MOE_BACKENDS else "auto"
            self.ffn = moe_class(d_model, d_ff, num_experts, top_k, backend=moe_backend, **factory)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.ffn(self.ffn_norm(x))
