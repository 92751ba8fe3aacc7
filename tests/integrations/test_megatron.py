"""Megatron-core with our modules (flashmoe_science.integrations.megatron) against Megatron's local spec.

The GPT-MoE models run on gloo CPU ranks in float64 (``examples/megatron/megatron_cpu.py`` makes Megatron-core's
CUDA-only buffers CPU ones), each test in its own spawned processes (Megatron's parallel state is global): one rank,
and two ranks with expert parallelism (the ``allgather`` dispatcher moves the tokens) and then with expert tensor
parallelism (each rank half of every expert's hidden dim; the dispatcher sums the partial outputs). The same weights (the local
experts' copied into ours) and batches give the same logits and gradients. The core attention alone is checked in
this process against a float64 SDPA with Megatron's masks (its causal and sliding-window definitions), including
packed sequences and GQA; what it cannot take is refused when built. The Triton kernels behind both modules run on
Megatron's layouts under the interpreter (interpreter_megatron_cases.py, a child process).
"""

import functools
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("megatron")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from flashmoe_science.integrations.megatron import FlashCoreAttention, FlashExperts  # noqa: E402
from interpreter_driver import interpreter_suite, run_marked_suite  # noqa: E402

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples" / "megatron"


def _config(**changes):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                  moe_router_load_balancing_type="none", use_cpu_initialization=True, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", attention_dropout=0.0,
                  hidden_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, params_dtype=torch.float64)
    fields.update(changes)
    return TransformerConfig(**fields)


# ------------------------------------------------------------------------------------------- core attention alone
def _megatron_mask(sq, sk, window):
    """Megatron's allowed pairs (True): causal, or its ``get_sliding_window_causal_mask`` for a window."""
    if window is None:
        return torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    left, right = window
    return torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq - left).tril(sk - sq + right)


def _reference(q, k, v, mask, bias=None):
    """float64 attention of ``[s, b, heads, d]`` tensors, GQA by repeating key/value groups, as Megatron does."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


def _qkv(s, b, heads=4, groups=2, d=16):
    return [torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True) for h in (heads, groups, groups)]


def _grads(out, tensors, grad):
    return torch.autograd.grad(out, tensors, grad)


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_core_attention_causal_gqa_and_window(window):
    config = _config(window_size=window)
    attention = FlashCoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(19, 3)
    out = attention(q, k, v, attention_mask=None)
    expected = _reference(q, k, v, _megatron_mask(19, 19, window))
    assert out.shape == (19, 3, 64)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for ours, theirs in zip(_grads(out, (q, k, v), grad), _grads(expected, (q, k, v), grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_core_attention_window_skip_freq_and_bias():
    config = _config(window_size=(3, 2), window_attn_skip_freq=2)
    windowed = FlashCoreAttention(config, 1, AttnMaskType.no_mask, "self")
    full = FlashCoreAttention(config, 2, AttnMaskType.no_mask, "self")
    assert windowed.window == (3, 2) and full.window is None
    q, k, v = _qkv(11, 2)
    bias = torch.randn(2, 4, 11, 11, dtype=torch.float64)
    torch.testing.assert_close(windowed(q, k, v, None, attention_bias=bias),
                               _reference(q, k, v, _megatron_mask(11, 11, (3, 2)), bias), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full(q, k, v, None), _reference(q, k, v, None), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("padded", [False, True])
def test_core_attention_packed_sequences(padded):
    """``thd`` batches: each sequence attends causally within itself; with padded cu_seqlens (padding at each
    sequence's end) the real tokens' outputs are those of the unpadded sequences."""
    attention = FlashCoreAttention(_config(), 1, AttnMaskType.padding_causal, "self")
    lengths = [5, 1, 9]
    stored = [7, 4, 9] if padded else lengths
    q, k, v = (t.detach()[:, 0] for t in _qkv(sum(stored), 1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_stored = torch.tensor([0, *torch.tensor(stored).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths),
                             cu_seqlens_q_padded=cu_stored if padded else None,
                             cu_seqlens_kv_padded=cu_stored if padded else None)
    out = attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, packed_seq_params=params)
    assert out.shape == (sum(stored), 64)
    for start, length in zip(cu_stored[:-1].tolist(), lengths):
        rows = slice(start, start + length)
        expected = _reference(*(t[rows].unsqueeze(1) for t in (q, k, v)), _megatron_mask(length, length, None))
        torch.testing.assert_close(out[rows], expected[:, 0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", [False, True])
def test_core_attention_follows_deterministic_mode(mode, monkeypatch):
    """``config.deterministic_mode`` reaches the kernels as ``deterministic``, dense and packed."""
    from flashmoe_science.integrations.megatron import attention as module

    seen = []
    for name in ("flash_attention_science", "flash_attention_varlen"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, original=original, **kwargs: (
            seen.append(kwargs["deterministic"]), original(*args, **kwargs))[1])
    attention = FlashCoreAttention(_config(deterministic_mode=mode), 1, AttnMaskType.causal, "self")
    attention(*_qkv(6, 2), None)
    q, k, v = (t.detach()[:, :1] for t in _qkv(6, 1))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    attention(q, k, v, None, packed_seq_params=params)
    assert seen == [mode, mode]


@pytest.mark.parametrize("changes, message", [
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(softmax_type="off-by-one"), "softmax_type"),
    (dict(qk_clip=True), "qk_clip"),
    (dict(window_size=(4, 2)), "right side 0"),
])
def test_core_attention_refusals(changes, message):
    with pytest.raises(ValueError, match=message):
        FlashCoreAttention(_config(**changes), 1, AttnMaskType.causal, "self")


def test_core_attention_refuses_arbitrary_masks_and_dense_padding():
    with pytest.raises(ValueError, match="attn_mask_type"):
        FlashCoreAttention(_config(), 1, AttnMaskType.arbitrary, "self")
    attention = FlashCoreAttention(_config(), 1, AttnMaskType.padding, "self")
    with pytest.raises(ValueError, match="packed_seq_params"):
        attention(*_qkv(4, 1), None)


@pytest.mark.parametrize("changes, message", [
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(gated_linear_unit=False), "gated_linear_unit"),
    (dict(activation_func=F.gelu), "activation_func"),
])
def test_experts_refusals(changes, message):
    with pytest.raises(ValueError, match=message):  # refused before any process group is read
        FlashExperts(2, _config(**changes))


def test_spec_swaps_what_is_named():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from flashmoe_science.integrations.megatron import with_flash_modules

    def modules(spec):
        core = spec.submodules.self_attention.submodules.core_attention
        experts = spec.submodules.mlp.keywords["submodules"].experts
        return (getattr(core, "module", core), getattr(experts, "module", getattr(experts, "func", experts)))

    local = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    assert modules(with_flash_modules(local)) == (FlashCoreAttention, FlashExperts)
    assert modules(with_flash_modules(local, attention=None))[0] is DotProductAttention
    assert modules(with_flash_modules(local, experts=None))[1] is not FlashExperts
    assert modules(local)[0] is DotProductAttention  # the given spec is not changed
    dense = with_flash_modules(get_gpt_layer_local_spec(normalization="RMSNorm"))
    assert dense.submodules.self_attention.submodules.core_attention.module is FlashCoreAttention
    with pytest.raises(TypeError, match="experts"):
        with_flash_modules(local, experts=1)


def test_experts_refuse_zero_copy_buffers():
    one_rank = SimpleNamespace(size=lambda: 1)
    experts = FlashExperts(2, _config(), pg_collection=SimpleNamespace(ep=one_rank, expt_tp=one_rank, tp=one_rank))
    x = torch.randn(3, 64, dtype=torch.float64)
    out, bias = experts(x, torch.tensor([2, 1]), torch.ones(3, dtype=torch.float64))
    assert out.shape == (3, 64) and bias is None
    with pytest.raises(ValueError, match="output_buffer"):
        experts(x, torch.tensor([2, 1]), torch.ones(3), output_buffer=torch.empty(3, 64))


@interpreter_suite(HERE / "interpreter_megatron_cases.py", timeout=600)
def test_triton_paths_under_interpreter(request):
    pytest.importorskip("triton")
    run_marked_suite(request)


# ------------------------------------------------------------------------------ GPT-MoE models on gloo CPU ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compare_gpt_moe(rank: int, expert_parallel: int, expert_tensor_parallel: int) -> None:
    """The local-spec and flash-spec GPT-MoE of one parallel layout: same logits and gradients."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from flashmoe_science.integrations.megatron import get_gpt_layer_flash_spec

    config = _config(expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=expert_tensor_parallel)
    torch.manual_seed(0)
    build = functools.partial(GPTModel, config=config, vocab_size=97, max_sequence_length=24,
                              position_embedding_type="learned_absolute")
    local = build(transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"))
    flash = build(transformer_layer_spec=get_gpt_layer_flash_spec(num_experts=4))
    flash.load_state_dict(local.state_dict(), strict=False)
    for theirs, ours in zip(local.decoder.layers, flash.decoder.layers):
        ours.mlp.experts.copy_from(theirs.mlp.experts)
    torch.manual_seed(1 + rank)
    tokens = torch.randint(0, 97, (2, 24))
    positions = torch.arange(24).expand(2, 24)
    causal = torch.ones(1, 1, 24, 24, dtype=torch.bool).triu(1)  # True: masked, as Megatron's masks
    expected = local(tokens, positions, causal)
    logits = flash(tokens, positions, None)  # the layer's mask type decides (as in Megatron's TE attention)
    torch.testing.assert_close(logits, expected, rtol=1e-9, atol=1e-9)
    grad = torch.randn_like(logits)
    expected.backward(grad)
    logits.backward(grad)
    ours = dict(flash.named_parameters())
    for name, param in local.named_parameters():
        if ".local_experts." not in name:
            torch.testing.assert_close(ours[name].grad, param.grad, rtol=1e-9, atol=1e-9, msg=name)
    for theirs, layer in zip(local.decoder.layers, flash.decoder.layers):
        experts = theirs.mlp.experts.local_experts
        torch.testing.assert_close(layer.mlp.experts.weight1.grad,
                                   torch.stack([e.linear_fc1.weight.grad for e in experts]), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(layer.mlp.experts.weight2.grad,
                                   torch.stack([e.linear_fc2.weight.grad for e in experts]), rtol=1e-9, atol=1e-9)


def _gpt_parity_worker(rank: int, world: int, port: int, layouts) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, str(EXAMPLES))
    import megatron_cpu
    from megatron.core import parallel_state

    try:
        for expert_parallel, expert_tensor_parallel in layouts:
            megatron_cpu.init(expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel)
            _compare_gpt_moe(rank, expert_parallel, expert_tensor_parallel)
            parallel_state.destroy_model_parallel()
    finally:
        megatron_cpu.destroy()


# (expert parallel, expert tensor parallel) layouts, data parallel over the remaining ranks; two ranks run both of
# theirs in one pair of processes (spawning costs more than a layout)
@pytest.mark.parametrize("world, layouts", [(1, [(1, 1)]), (2, [(2, 1), (1, 2)])], ids=["1-rank", "2-ranks-ep2-etp2"])
def test_gpt_moe_matches_local_spec(world, layouts):
    torch.multiprocessing.spawn(_gpt_parity_worker, args=(world, _free_port(), layouts), nprocs=world)
