"""The Megatron-core integration on one GPU (`pytest -m gpu tests/integrations/test_megatron_gpu.py`): a bf16 GPT-MoE
with our core attention and experts (Gluon/Triton kernels, the alltoall dispatcher) against Megatron's local spec
in bf16, both measured against the local spec in float64 from the same weights: our logits' and gradients' error is
at most twice the local spec's (plus a small floor); packed sequences against float64 per-sequence attention.
Head dim 64, as the example's model (the kernels built here are the ones its run reuses).
Every token goes to every expert (top-4 of 4): a top-k choice could flip between bf16 runs on near-tied router
logits, and one flipped token moves the error more than the kernels do (the CPU tests check uneven expert loads
exactly)."""

import functools
import os
import socket

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("megatron.core")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("megatron")
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from flashmoe_science.integrations.megatron import FlashCoreAttention, get_gpt_layer_flash_spec  # noqa: E402


@pytest.fixture(scope="module")
def megatron_gpu():
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(dtype):
    return TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=384,
        num_moe_experts=4, moe_ffn_hidden_size=384, moe_router_topk=4, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_router_dtype="fp64", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", attention_dropout=0.0,
        hidden_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype)


def _error(value, reference):
    return ((value.double() - reference).norm() / reference.norm()).item()


def test_gpt_moe_bf16_error_within_twice_the_local_specs(megatron_gpu):
    build = functools.partial(GPTModel, vocab_size=512, max_sequence_length=512, position_embedding_type="rope")
    local_spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    # every weight in the model's dtype (Megatron's norms are created float32), as Float16Module makes them
    reference = build(config=_config(torch.float64), transformer_layer_spec=local_spec).cuda().double()
    local = build(config=_config(torch.bfloat16), transformer_layer_spec=local_spec).cuda().bfloat16()
    flash = build(config=_config(torch.bfloat16),
                  transformer_layer_spec=get_gpt_layer_flash_spec(num_experts=4)).cuda().bfloat16()
    local.load_state_dict(reference.state_dict())
    flash.load_state_dict(reference.state_dict(), strict=False)
    for theirs, ours in zip(local.decoder.layers, flash.decoder.layers):
        ours.mlp.experts.copy_from(theirs.mlp.experts)
    tokens = torch.randint(0, 512, (2, 512), device="cuda")
    positions = torch.arange(512, device="cuda").expand(2, -1)
    outputs = {name: model(tokens, positions, None) for name, model in
               (("reference", reference), ("local", local), ("flash", flash))}
    grad = torch.randn_like(outputs["reference"])
    for output in outputs.values():
        output.backward(grad.to(output.dtype))
    expected = outputs["reference"]
    assert _error(outputs["flash"], expected) <= 2 * _error(outputs["local"], expected) + 1e-3
    for name in ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.1.mlp.router.weight"):
        ref = dict(reference.named_parameters())[name].grad
        ours, theirs = dict(flash.named_parameters())[name].grad, dict(local.named_parameters())[name].grad
        assert _error(ours, ref) <= 2 * _error(theirs, ref) + 1e-3, name


def test_packed_sequences_bf16(megatron_gpu):
    attention = FlashCoreAttention(_config(torch.bfloat16), 1, AttnMaskType.padding_causal, "self")
    lengths = [700, 3, 1200, 97]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 1, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    out = attention(q, k, v, None, packed_seq_params=params)
    for start, length in zip(cu[:-1].tolist(), lengths):
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows, 0].double().transpose(0, 1) for t in (q, k, v))
        expected = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        assert _error(out[rows].view(length, 4, 64).transpose(0, 1), expected) < 2e-2
