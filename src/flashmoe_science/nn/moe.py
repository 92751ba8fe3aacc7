"""``FusedMoE``: a router plus SwiGLU experts running through ``fused_moe``, and converters from the Hugging Face
Mixtral / Qwen3-MoE sparse-MoE blocks (transformers >= 5, whose experts already store ``gate_up_proj (E, 2F, d)``
and ``down_proj (E, d, F)``, our layout)."""

import math

import torch
from torch import nn

from flashmoe_science.moe.api import fused_moe
from flashmoe_science.moe.checks import check_routing_options, check_top_k
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

    Parameters: ``router.weight (E, d)``, ``w1 (E, 2F, d)`` (gate rows then up rows), ``w2 (E, d, F)``.
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
        )
        return out.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"renormalize={self.renormalize}, scoring={self.scoring!r}, backend={self.backend!r}"
        )

    @classmethod
    def from_hf(cls, block: nn.Module, *, backend: str = "auto") -> "FusedMoE":
        """A ``FusedMoE`` sharing the parameters of a Hugging Face ``MixtralSparseMoeBlock`` or
        ``Qwen3MoeSparseMoeBlock`` (transformers >= 5): no copy, so training either trains both.

        Mixtral's training-time router jitter noise is not reproduced (it is off in eval and by default).
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
        w = experts.gate_up_proj
        module = cls(
            d_model,
            two_d_ff // 2,
            num_experts,
            int(gate.top_k),
            renormalize=bool(getattr(gate, "norm_topk_prob", True)),  # Mixtral always renormalises
            backend=backend,
            device="meta",
            dtype=w.dtype,
        )
        module.router.weight = gate.weight
        module.w1 = experts.gate_up_proj
        module.w2 = experts.down_proj
        return module


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
