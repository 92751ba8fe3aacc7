"""TorchTitan's Llama 3 and Qwen3-MoE models at a chosen size, built the way its own model registries build theirs.

TorchTitan's registries (``torchtitan.models.llama3.model_registry``, ``...qwen3.model_registry``) offer fixed
flavours (debugmodel, 1B, 8B, 30B-A3B, ...); these two functions assemble the same configs from the same layer
builders and initialisers at any size, for the jobs in ``flashmoe_jobs.py`` and the parity test.
"""

from __future__ import annotations

from dataclasses import replace

from torchtitan.models import llama3, qwen3
from torchtitan.models.common import Embedding, Linear, RMSNorm
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
from torchtitan.protocols.model_spec import ModelSpec


def llama3_spec(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int, vocab_size: int,
                max_seq_len: int, attn_backend: str = "varlen") -> ModelSpec:
    """A Llama 3 (dense SwiGLU, GQA, RoPE) ``ModelSpec``; ``attn_backend`` as TorchTitan's ("varlen", "flex")."""
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden_dim,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=500000, scaling="llama"),
            attn_backend=attn_backend))
    return replace(llama3.model_registry("debugmodel", attn_backend=attn_backend), flavor="custom", model=config)


def qwen3_moe_spec(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, moe_hidden_dim: int,
                   num_experts: int, top_k: int, vocab_size: int, max_seq_len: int,
                   attn_backend: str = "varlen") -> ModelSpec:
    """A Qwen3-MoE (QK-norm attention, softmax top-k routed SwiGLU experts) ``ModelSpec``."""
    config = qwen3.Qwen3Model.Config(
        vocab_size=vocab_size, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            moe_hidden_dim=moe_hidden_dim, num_experts=num_experts, top_k=top_k, attn_backend=attn_backend,
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=1000000.0)))
    return replace(qwen3.model_registry("debugmodel_moe", attn_backend=attn_backend), flavor="custom",
                   model=config)
