"""attn_implementation="fmoe_science" (hf.ATTN_IMPLEMENTATION) in transformers: small random-initialised Llama, Qwen3-MoE and Mixtral
models against the same models on `sdpa` (logits and every parameter's gradient), with and without a padded batch;
registration twice; unsupported config features named at construction. On the CPU the front doors run the PyTorch
reference in float32; test_hf_gpu.py runs the kernels in bf16."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashmoe_science.integrations import hf  # noqa: E402
from flashmoe_science.nn import FusedMoE  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def small_config(name: str):
    if name == "llama":
        return transformers.LlamaConfig(**COMMON, head_dim=16)
    if name == "mistral_window":  # a window shorter than the batch's sequences
        return transformers.MistralConfig(**COMMON, head_dim=16, sliding_window=4)
    if name == "gemma2_softcap":  # soft-capped logits, sliding and full layers
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True)
    return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)


def model_pair(name: str, dtype=torch.float32, device="cpu"):
    """(the sdpa model (eager for soft-capping, which sdpa refuses), a copy on flashmoe_science with its MoE blocks
    swapped, that copy's parameters by name)."""
    config = small_config(name)
    baseline = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=baseline, dtype=dtype,
                                                         experts_implementation="eager").to(device)  # any dtype
    return (sdpa, *converted_copy(sdpa))


def converted_copy(model):
    """(a copy of `model` on flashmoe_science with its MoE blocks swapped, the copy's parameters by their names in
    `model`: FusedMoE shares these Parameters, so their grads are the converted model's)."""
    ours = copy.deepcopy(model)
    params = dict(ours.named_parameters())
    hf.apply(ours)
    return ours, params


def batch(padding: str | None, device="cpu"):
    ids = torch.randint(0, COMMON["vocab_size"], (3, 11), device=device)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[0, 7:], mask[2, 4:] = 0, 0
    elif padding == "left":
        mask[0, :5], mask[1, :2] = 0, 0
    return ids, mask


def logits_and_grads(model, params, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    (logits[real].float().square().mean()).backward()  # a loss over the real tokens only
    return logits[real].detach(), {name: p.grad for name, p in params.items()}


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "mixtral", "mistral_window", "gemma2_softcap"])
def test_matches_sdpa(name, padding):
    sdpa, ours, params = model_pair(name)
    if name in ("qwen3_moe", "mixtral"):
        assert sum(isinstance(m, FusedMoE) for m in ours.modules()) == COMMON["num_hidden_layers"]
    ids, mask = batch(padding)
    want_logits, want_grads = logits_and_grads(sdpa, dict(sdpa.named_parameters()), ids, mask)
    got_logits, got_grads = logits_and_grads(ours, params, ids, mask)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=2e-5)
    for param_name, want in want_grads.items():
        got = got_grads[param_name]
        assert got is not None, param_name
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4, msg=lambda m: f"{param_name}: {m}")


def test_register_twice_and_from_config():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping[hf.ATTN_IMPLEMENTATION] is hf.flashmoe_science_attention
    model = hf.from_config(small_config("mixtral"))
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert isinstance(model.model.layers[0].mlp, FusedMoE)
    model(input_ids=torch.randint(0, COMMON["vocab_size"], (1, 5)))


def test_generate_with_cache():
    sdpa, ours, _ = model_pair("llama")
    ids, mask = batch("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


@pytest.mark.parametrize("head_dim", [1, 8, 12, 15, 256])
def test_config_head_dims_follow_the_kernels(head_dim):
    """The rule is the kernels' (attention.checks MIN_HEAD_DIM..MAX_HEAD_DIM), not a stricter one of its own."""
    config = small_config("llama")
    config.head_dim = head_dim
    hf.check_config(config)


@pytest.mark.parametrize("feature, overrides, message", [
    ("dropout", dict(attention_dropout=0.1), "attention dropout"),
    ("head_dim", dict(head_dim=320), r"head dim 320 \(config.head_dim\) .* \[1, 256\]"),
    ("alibi", dict(alibi=True), "ALiBi"),
])
def test_unsupported_config_raises_at_construction(feature, overrides, message):
    config = small_config("llama")
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        hf.from_config(config)


def test_attention_sinks_raise_at_construction():
    config = transformers.GptOssConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="attention sinks"):
        hf.from_config(config)


@pytest.mark.parametrize("padding", [None, "right"])
def test_model_compiles_without_graph_breaks(padding):
    sdpa, ours, _ = model_pair("qwen3_moe")  # our attention and FusedMoE in every layer
    ids, mask = batch(padding)
    mask = mask if padding else None
    explained = torch._dynamo.explain(lambda i, m: ours(input_ids=i, attention_mask=m).logits)(ids, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(lambda i, m: ours(input_ids=i, attention_mask=m).logits, backend="aot_eager",
                             fullgraph=True)
    real = mask.bool() if padding else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(compiled(ids, mask)[real], sdpa(input_ids=ids, attention_mask=mask).logits[real],
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_packed_sequences_attend_within_themselves(how):
    # two documents in one row: each gives the logits it gives alone (sdpa, on the documents one by one)
    sdpa, ours, _ = model_pair("llama")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 11))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    extra = {}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    got = ours(input_ids=ids, position_ids=position_ids, **extra).logits
    want = torch.cat((sdpa(input_ids=ids[:, :4]).logits, sdpa(input_ids=ids[:, 4:]).logits), dim=1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_cu_seq_lens_count_the_rows_one_after_the_other():
    # transformers' flash-attention path flattens the batch's rows for cu_seq_lens: a sequence may cross rows
    heads, kv_heads, length, dim = 4, 2, 11, 16
    q = torch.randn(2, heads, length, dim, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, length, dim, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 4, 15, 22], dtype=torch.int32)

    class Causal:
        is_causal = True

    got, _ = hf.flashmoe_science_attention(Causal(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    rows = [t.transpose(1, 2).flatten(0, 1).transpose(0, 1) for t in (q, k, v)]  # (H, 2L, D)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[:, a:b] for t in rows), is_causal=True, enable_gqa=True) for a, b in zip(cu[:-1], cu[1:])], dim=1)
    torch.testing.assert_close(got, want.transpose(0, 1).view(2, length, heads, dim))
