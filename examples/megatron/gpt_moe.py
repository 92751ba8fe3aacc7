"""The example's GPT-MoE: sizes, its Megatron-core ``TransformerConfig``, and the model built with either layer spec.

``build_model("local")`` is Megatron-core's ``GPTModel`` on ``get_gpt_layer_local_spec`` (``DotProductAttention``,
``SequentialMLP`` experts); ``build_model("flashmoe")`` the same model on ``get_gpt_layer_flash_spec`` (our core
attention and experts), its weights copied from a local model drawn from the same seed, so both kernel sets start
from identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from flashmoe_science.integrations.megatron import get_gpt_layer_flash_spec

KERNELS = ("flashmoe", "local")


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    query_groups: int
    experts: int
    top_k: int
    expert_hidden: int
    vocab: int
    seq_len: int
    micro_batch: int

    def parameters(self) -> tuple[int, int]:
        """(all parameters, those one token uses: attention, its top_k experts, router, output layer), norms left
        out."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.query_groups)
        expert = 3 * self.hidden * self.expert_hidden
        router = self.hidden * self.experts
        embeddings = 2 * self.vocab * self.hidden  # input embedding and untied output layer
        total = self.layers * (attention + self.experts * expert + router) + embeddings
        active = self.layers * (attention + self.top_k * expert + router) + self.vocab * self.hidden
        return total, active

    def train_flops_per_token(self) -> float:
        """Forward and backward (3x the forward) matmul FLOPs per token: 2 per active weight, plus causal
        attention's two products (2·2·seq·hidden per layer, half of the pairs)."""
        _, active = self.parameters()
        return 3 * (2 * active + 2 * self.layers * self.seq_len * self.hidden)


SIZES = {
    # ~0.55B parameters (0.18B active), 2k sequences: 12 layers, d=1024, GQA 16/4 heads, 8 experts top-2
    "small": Size(layers=12, hidden=1024, heads=16, query_groups=4, experts=8, top_k=2, expert_hidden=1536,
                  vocab=32768, seq_len=2048, micro_batch=4),
    # the CPU smoke run's
    "tiny": Size(layers=2, hidden=64, heads=4, query_groups=2, experts=4, top_k=2, expert_hidden=48, vocab=128,
                 seq_len=32, micro_batch=2),
}


def transformer_config(size: Size, *, expert_parallel: int, expert_tensor_parallel: int,
                       bf16: bool, deterministic: bool = False) -> TransformerConfig:
    """Megatron-core's config for ``size``: SwiGLU experts without biases, RMSNorm, no dropout, the alltoall token
    dispatcher (allgather on the CPU, where alltoall needs CUDA streams), auxiliary load-balancing loss, and none of
    the fusions that need apex or TransformerEngine."""
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads,
        num_query_groups=size.query_groups, ffn_hidden_size=size.expert_hidden, num_moe_experts=size.experts,
        moe_ffn_hidden_size=size.expert_hidden, moe_router_topk=size.top_k,
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
        expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=expert_tensor_parallel,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32, use_cpu_initialization=not on_gpu,
        masked_softmax_fusion=False, bias_activation_fusion=on_gpu, persist_layer_norm=False,
        gradient_accumulation_fusion=False, deterministic_mode=deterministic)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _gpt(config: TransformerConfig, size: Size, spec) -> GPTModel:
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=size.vocab,
                    max_sequence_length=size.seq_len,
                    # RoPE moves its frequencies to the current CUDA device: learned positions on the CPU
                    position_embedding_type="rope" if torch.cuda.is_available() else "learned_absolute")


def draw_model(kernels: str, config: TransformerConfig, size: Size, seed: int) -> GPTModel:
    """The GPT-MoE with ``kernels`` ("flashmoe" or "local"), its weights drawn from ``seed`` by its own spec's
    initialisation."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    seed_all(seed)
    if kernels == "local":
        return _gpt(config, size, get_gpt_layer_local_spec(num_experts=size.experts, normalization="RMSNorm"))
    return _gpt(config, size, get_gpt_layer_flash_spec(num_experts=size.experts))


def build_model(kernels: str, config: TransformerConfig, size: Size, seed: int) -> GPTModel:
    """The GPT-MoE with ``kernels`` ("flashmoe" or "local"), weights drawn from ``seed`` by the local model."""
    local = draw_model("local", config, size, seed)
    if kernels == "local":
        return local
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    flash = _gpt(config, size, get_gpt_layer_flash_spec(num_experts=size.experts))
    keys = flash.load_state_dict(local.state_dict(), strict=False)
    if any(not key.endswith(("experts.weight1", "experts.weight2")) for key in keys.missing_keys):
        raise RuntimeError(f"the flashmoe model misses weights the local one has: {keys.missing_keys}")
    for theirs, ours in zip(local.decoder.layers, flash.decoder.layers):
        ours.mlp.experts.copy_from(theirs.mlp.experts)
    return flash
