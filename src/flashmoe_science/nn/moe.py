"""``FusedMoE``: a router plus SwiGLU experts running through ``fused_moe``, and converters from the Hugging Face
Mixtral / Qwen3-MoE sparse-MoE blocks (transformers >= 5, whose experts already store ``gate_up_proj (E, 2F, d)``
and ``down_proj (E, d, F)``, our layout), including their FP8 form (transformers' ``FP8Experts``: e4m3
``gate_up_proj`` / ``down_proj`` with 128x128 ``*_scale_inv`` block scales, as DeepSeek-V3 / Qwen3-FP8
checkpoints load)."""

import math

import torch
from torch import nn

from flashmoe_science.moe.api import fused_moe
from flashmoe_science.moe.checks import check_routing_options, check_top_k
from flashmoe_science.moe.fp8 import BLOCK, quantize_fp8_weights
from flashmoe_science.moe.plan import check_backend

# Hugging Face sparse-MoE block classes we convert, by class name (no import of transformers needed)
HF_MOE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock")


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_layer_args(d_model, d_ff, num_experts, top_k, renormalize, scoring, backend) -> None:
    """The checks of an MoE layer's constructor arguments (FusedMoE, distributed.ExpertParallelMoE)."""
    for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts), ("top_k", top_k)):
        _check_positive_int(name, value)
    check_top_k(top_k, num_experts)
    check_routing_options(renormalize, scoring)
    check_backend(backend)


def tokens_of(hidden_states, d_model: int) -> torch.Tensor:
    """``(..., d_model)`` hidden states as ``(tokens, d_model)`` rows, checked."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() < 1 or hidden_states.shape[-1] != d_model:
        raise ValueError(f"hidden_states must end in d_model={d_model}, got shape {tuple(hidden_states.shape)}")
    return hidden_states.reshape(-1, d_model)


def init_experts(w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Each expert's w1 `(E, 2F, d)` and w2 `(E, d, F)` initialised in place like an nn.Linear of its own fan-in."""
    for w in (w1, w2):
        bound = 1 / math.sqrt(w.shape[-1])
        nn.init.uniform_(w, -bound, bound)


class FusedMoE(nn.Module):
    """Mixture-of-Experts FFN: ``router`` (Linear d -> E, no bias) then top-k SwiGLU experts, weighted sum.

    Parameters: ``router.weight (E, d)``, ``w1 (E, 2F, d)`` (gate rows then up rows), ``w2 (E, d, F)``; FP8
    experts (``quantize_fp8()``, or ``from_hf`` of an FP8 block) hold e4m3 ``w1``/``w2`` and their 128x128 block
    scales ``w1_scale``/``w2_scale`` (None otherwise) and run the forward only.
    Input ``(..., d_model)``; output has the input's shape and dtype.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        scoring: str = "softmax",
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_layer_args(d_model, d_ff, num_experts, top_k, renormalize, scoring, backend)
        factory = dict(device=device, dtype=dtype)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.renormalize, self.scoring, self.backend = renormalize, scoring, backend
        self.router = nn.Linear(d_model, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * d_ff, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **factory))
        self.register_parameter("w1_scale", None)
        self.register_parameter("w2_scale", None)
        self.reset_parameters()

    def reset_parameters(self):
        init_experts(self.w1, self.w2)
        self.router.reset_parameters()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = tokens_of(hidden_states, self.d_model)
        out = fused_moe(
            x,
            self.w1,
            self.w2,
            self.router(x),
            self.top_k,
            renormalize=self.renormalize,
            scoring=self.scoring,
            backend=self.backend,
            w1_scale=self.w1_scale,
            w2_scale=self.w2_scale,
        )
        return out.reshape(hidden_states.shape)

    @property
    def is_fp8(self) -> bool:
        return self.w1_scale is not None

    @torch.no_grad()
    def quantize_fp8(self) -> "FusedMoE":
        """Quantises the experts in place to e4m3 with 128x128 block scales (``moe.fp8.quantize_fp8_weights``):
        half the weight bytes; the layer then runs the forward only. Returns self."""
        if self.is_fp8:
            raise ValueError("the experts are already FP8")
        for name in ("w1", "w2"):
            q, scale = quantize_fp8_weights(getattr(self, name))
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        return self

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"renormalize={self.renormalize}, scoring={self.scoring!r}, backend={self.backend!r}"
            + (", experts=fp8-e4m3 (128x128 blocks)" if self.is_fp8 else "")
        )

    @classmethod
    def from_hf(cls, block: nn.Module, *, backend: str = "auto") -> "FusedMoE":
        """A ``FusedMoE`` sharing the parameters of a Hugging Face ``MixtralSparseMoeBlock`` or
        ``Qwen3MoeSparseMoeBlock`` (transformers >= 5): no copy, so training either trains both.

        Mixtral's training-time router jitter noise is not reproduced (it is off in eval and by default).

        FP8 blocks (transformers' ``FP8Experts``, as a ``FineGrainedFP8Config`` checkpoint loads: e4m3
        ``gate_up_proj``/``down_proj`` with ``gate_up_proj_scale_inv``/``down_proj_scale_inv``) share those four
        tensors the same way, as ``w1``, ``w2``, ``w1_scale``, ``w2_scale`` (128x128 blocks and dynamic activation
        scales only); the router keeps its dtype, which is the layer's compute dtype. Forward only.
        """
        name = type(block).__name__
        if name not in HF_MOE_BLOCKS:
            raise TypeError(f"block must be one of {HF_MOE_BLOCKS}, got {name}")
        gate, experts = block.gate, block.experts
        if not hasattr(experts, "gate_up_proj"):
            raise ValueError(f"block {name} has no experts.gate_up_proj: transformers >= 5 is needed")
        act_name = type(experts.act_fn).__name__.lower()
        if "silu" not in act_name and "swish" not in act_name:
            raise ValueError(f"block {name} uses activation {type(experts.act_fn).__name__}; FusedMoE needs SiLU")
        num_experts, two_d_ff, d_model = experts.gate_up_proj.shape
        fp8 = hasattr(experts, "gate_up_proj_scale_inv")
        if fp8:
            _check_fp8_block(name, experts)
        module = cls(
            d_model,
            two_d_ff // 2,
            num_experts,
            int(gate.top_k),
            renormalize=bool(getattr(gate, "norm_topk_prob", True)),  # Mixtral always renormalises
            backend=backend,
            device="meta",
            dtype=gate.weight.dtype if fp8 else experts.gate_up_proj.dtype,
        )
        module.router.weight = gate.weight
        module.w1 = experts.gate_up_proj
        module.w2 = experts.down_proj
        if fp8:
            module.w1_scale = experts.gate_up_proj_scale_inv
            module.w2_scale = experts.down_proj_scale_inv
        return module


def _check_fp8_block(name: str, experts: nn.Module) -> None:
    """The FP8 experts of a Hugging Face block in the format the FP8 kernels read."""
    block_size = getattr(experts, "block_size", None)
    if block_size is None or tuple(block_size) != (BLOCK, BLOCK):
        raise ValueError(f"block {name} has FP8 experts with block_size {block_size}; FusedMoE reads "
                         f"{BLOCK}x{BLOCK} weight blocks")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"block {name} has FP8 experts with activation_scheme={scheme!r}; FusedMoE quantises "
                         "activations dynamically (per token, per 128-feature group)")
    for tensor_name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
        if getattr(experts, tensor_name).dtype != torch.float32:
            raise ValueError(f"block {name}: experts.{tensor_name} is {getattr(experts, tensor_name).dtype}; "
                             "FusedMoE reads float32 block scales")


def replace_hf_moe_blocks(model: nn.Module, *, backend: str = "auto") -> int:
    """Swaps every Mixtral / Qwen3-MoE sparse-MoE block inside ``model`` for a ``FusedMoE`` sharing its parameters.

    Returns the number of blocks replaced.
    """
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if type(child).__name__ in HF_MOE_BLOCKS
    ]
    for parent, child_name, child in targets:
        setattr(parent, child_name, FusedMoE.from_hf(child, backend=backend))
    return len(targets)
