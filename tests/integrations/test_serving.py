"""Serving paths on the CPU: the flash_attn-shaped module (`integrations.flash_attn_interface`) against this
library's own calls and float64 oracles, and transformers' continuous batching (`generate_batch`) on
`hf.FLASH_IMPLEMENTATION` against transformers' own paged implementation (same greedy tokens) on a tiny random
Llama. On the CPU continuous batching takes its varlen path (the block-table decode path needs CUDA:
test_serving_gpu.py); the block-table call transformers makes there is run here through its own function."""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention.decode_helpers import assert_decode_close, make_case  # noqa: E402
from flashmoe_science import flash_attention_science  # noqa: E402
from flashmoe_science.attention.record import recording  # noqa: E402
from flashmoe_science.integrations import flash_attn_interface as fa  # noqa: E402
from flashmoe_science.integrations import hf  # noqa: E402


def test_flash_attn_func_is_the_dense_call_token_major():
    q, k, v = torch.randn(2, 9, 4, 32), torch.randn(2, 13, 2, 32), torch.randn(2, 13, 2, 32)
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0)
    want = flash_attention_science(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                   window=(5, -1), softcap=3.0).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_flash_attn_with_kvcache_flash_attn_defaults():
    """rotary_interleaved defaults to True (flash_attn's default), num_splits=0 picks the heuristic, and
    return_softmax_lse returns (out, lse); the result matches the float64 oracle."""
    case = make_case([3, 17], lq=2, hq=4, hkv=2, d=32, block_size=16, capacity=32, num_new=2, rotary=True)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(case.q, k_cache, v_cache, case.k_new, case.v_new, case.rotary_cos,
                                          case.rotary_sin, case.cache_seqlens, block_table=case.block_table,
                                          causal=True, return_softmax_lse=True)
    assert_decode_close(case, out, lse, k_cache, v_cache, rotary_interleaved=True)


def test_return_attn_probs_returns_the_lse_as_flash_attn_3():
    q, k, v = torch.randn(2, 9, 4, 32), torch.randn(2, 13, 2, 32), torch.randn(2, 13, 2, 32)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, window_size=torch.tensor([6, 2]), return_attn_probs=True)
    want, want_lse = flash_attention_science(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                             window=(6, 2), return_lse=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("change,message", [(dict(dropout_p=0.1), "dropout_p"),
                                            (dict(window_size=(3, 1.5)), "window_size"),
                                            (dict(window_size=(3,)), "window_size"),
                                            (dict(learnable_sink=torch.zeros(4)), "learnable_sink")])
def test_what_flash_attn_has_and_we_do_not_is_refused(change, message):
    q = torch.randn(1, 3, 4, 32)
    with pytest.raises((ValueError, TypeError), match=message):
        fa.flash_attn_func(q, q, q, **change)


def _block_table_call_5_24(case, k_cache, v_cache, cu_q, cu_k, max_k):
    """transformers 5.24: `_flash_attention_forward` with the kwargs its paged cache passes in the decode path."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    batch, _, heads, dim = case.q.shape
    hkv = case.k_new.shape[2]
    out = _flash_attention_forward(case.q.view(1, batch, heads, dim), case.k_new.view(1, batch, hkv, dim),
                                   case.v_new.view(1, batch, hkv, dim), None, query_length=batch, is_causal=True,
                                   cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=1, max_length_k=max_k,
                                   block_table=case.block_table, k_cache=k_cache, v_cache=v_cache,
                                   attn_implementation=hf.FLASH_IMPLEMENTATION)
    return out.view(batch, 1, heads, dim)


def _block_table_call_5_17(case, k_cache, v_cache, cu_q, cu_k, max_k):
    """transformers 5.17: continuous batching's registered paged function (`integrations.flash_paged`) on one
    layer of a paged cache holding this case's pool; the block table's argument name comes from transformers'
    inspection of our function's signature."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    batch, _, heads, dim = case.q.shape
    pool, block_size, hkv, _ = k_cache.shape
    cache = types.SimpleNamespace(layer_index_to_group_indices={0: (0, 0)}, key_cache=[k_cache.view(-1, hkv, dim)],
                                  value_cache=[v_cache.view(-1, hkv, dim)], block_size=block_size,
                                  num_key_value_heads=hkv, head_dim=dim, _block_table_key=None)
    cache.get_block_table_key = types.MethodType(PagedAttentionCache.get_block_table_key, cache)
    module = types.SimpleNamespace(layer_idx=0, scaling=dim ** -0.5,
                                   config=types.SimpleNamespace(_attn_implementation=hf.PAGED_FLASH_IMPLEMENTATION))
    out, _ = hf.paged_flash_attention(module, case.q.permute(1, 2, 0, 3), case.k_new.permute(1, 2, 0, 3),
                                      case.v_new.permute(1, 2, 0, 3), None, cache=cache, cu_seq_lens_q=cu_q,
                                      cu_seq_lens_k=cu_k, max_seqlen_q=1, max_seqlen_k=max_k,
                                      block_table=case.block_table.unsqueeze(0))
    return out.view(batch, 1, heads, dim)


def test_transformers_block_table_call_through_its_own_function():
    """transformers' decode-path call (one query token per sequence, the block table, cu_seq_lens_k counting the
    new token), through the function this transformers version makes it from: appends each token at its sequence's
    end and attends the whole cache."""
    import transformers.integrations.flash_paged as flash_paged

    hf.register_flash()
    case = make_case([5, 0, 30], lq=1, hq=4, hkv=2, d=16, dtype=torch.float32, block_size=16, capacity=48,
                     num_new=1)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    lengths = case.cache_seqlens + 1
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    cu_q = torch.arange(4, dtype=torch.int32)
    # 5.17's paged function makes the call itself (`_paged_decode_forward`); 5.24's forwards to the flash path
    call = _block_table_call_5_17 if hasattr(flash_paged, "_paged_decode_forward") else _block_table_call_5_24
    out = call(case, k_cache, v_cache, cu_q, cu_k, int(lengths.max()))
    assert_decode_close(case, out, None, k_cache, v_cache)


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()


def generate(model, implementation, prompts, device="cpu", max_new_tokens=6, page_size=16, **cb_options):
    """Greedy tokens per request from transformers' continuous batching with this attention implementation."""
    model.set_attn_implementation(implementation)
    generation = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    outputs = model.generate_batch(inputs=prompts, generation_config=generation, warmup=False,
                                   continuous_batching_config=hf.continuous_batching_config(page_size, **cb_options))
    return {rid: list(o.generated_tokens) for rid, o in outputs.items()}


def test_generate_batch_matches_transformers_paged_attention():
    model = _tiny_llama()
    prompts = [[1, 5, 9, 22, 7], [3, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 11, 40, 2, 19, 20, 21, 22]]
    options = dict(num_blocks=8, max_batch_tokens=64, page_size=16)
    with recording() as ran:
        ours = generate(model, hf.register_flash(), prompts, **options)
    assert any(kernel.startswith("reference.") for _, _, kernel in ran), ran[:3]  # our varlen call ran
    assert ours == generate(model, "paged|eager", prompts, **options)


def test_transformers_padded_batches():
    """What continuous batching hands over when it pads a batch for a CUDA graph: varlen rows after the last
    sequence (the real rows as the unpadded call; the padding rows' outputs are unspecified, the CPU reference's
    zeros), and decode padding sequences (cache_seqlens -1, block-table rows of -1: NaN rows, nothing written; the
    real rows as the unpadded call)."""
    q, k, v = torch.randn(9, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7, 7], dtype=torch.int32), torch.tensor([0, 5, 10, 10], dtype=torch.int32)
    out = hf._padded_batch_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    want = fa.flash_attn_varlen_func(q[:7], k[:10], v[:10], cu_q, cu_k, 4, 5, causal=True)
    assert out.shape == q.shape and torch.equal(out[:7], want)
    with pytest.raises(ValueError, match="cu_seqlens_q's last entry"):  # checked by default: padding is refused
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    case = make_case([5, 20, 0], lq=1, hq=4, hkv=2, d=16, block_size=16, capacity=32, num_new=1)
    case.cache_seqlens[2] = -1
    case.block_table[2] = -1
    k_cache = case.k_cache.clone()
    out = hf._padded_batch_with_kvcache(case.q, k_cache, case.v_cache.clone(), case.k_new, case.v_new,
                                        cache_seqlens=case.cache_seqlens, block_table=case.block_table)
    assert torch.isnan(out[2]).all()
    real = make_case([5, 20], lq=1, hq=4, hkv=2, d=16, block_size=16, capacity=32, num_new=1)
    real.q, real.k_cache, real.v_cache, real.k_new, real.v_new = (case.q[:2], case.k_cache, case.v_cache,
                                                                   case.k_new[:2], case.v_new[:2])
    real.block_table = case.block_table[:2]
    assert_decode_close(real, out[:2])
    touched = (k_cache != case.k_cache).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(touched) <= {int(case.block_table[0, 0]), int(case.block_table[1, 1])}


@pytest.mark.parametrize("padded", [False, True])
def test_forward_on_the_flash_implementation_matches_sdpa(padded):
    """transformers' own flash path outside continuous batching (flash_attn_func; with a padding mask, its unpad
    and flash_attn_varlen_func): the logits of the real tokens equal sdpa's."""
    model = _tiny_llama()
    ids = torch.randint(1, 128, (2, 11))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding
    want = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation(hf.register_flash())
    got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def test_serving_bench_runs_both_implementations_on_one_configuration():
    """The generate_batch benchmark's own code on a tiny model: both implementations finish every request with the
    same greedy tokens, under the same continuous-batching options, and each phase is reported."""
    from flashmoe_science.bench.decode import run_serving_bench

    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024)
    phases = []
    records = run_serving_bench(num_prompts=3, new_tokens=3, device="cpu", model_config=config, dtype=torch.float32,
                                log=lambda *entry: phases.append(entry[:2]))
    assert [r["implementation"] for r in records] == [hf.FLASH_IMPLEMENTATION, "sdpa"]
    assert all(r["requests_done"] == 3 and r["same_greedy_as_first"] == 3 for r in records), records
    assert records[0]["options"]["num_blocks"] == records[1]["options"]["num_blocks"]
    assert ("sdpa", "timed pass") in phases and (hf.FLASH_IMPLEMENTATION, "warm-up pass") in phases


class HostReads:
    """Records every read of a tensor's values on the host (`tolist`, `item`, conversions to Python numbers and
    bools: a synchronisation on a GPU) outside the CPU reference kernels, which compute on the host by nature."""

    READS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self, monkeypatch):
        from flashmoe_science.attention import reference
        from flashmoe_science.attention.decode import reference_backend as decode

        self.reads, self.inside_kernel = [], 0
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._guard(name, getattr(torch.Tensor, name)))
        for module, kernel in ((reference, "attention_reference"), (decode, "decode_reference")):
            monkeypatch.setattr(module, kernel, self._kernel(getattr(module, kernel)))

    def _guard(self, name, original):
        def read(t, *args, **kwargs):
            if not self.inside_kernel:
                self.reads.append(name)
            return original(t, *args, **kwargs)
        return read

    def _kernel(self, original):
        def run(*args, **kwargs):
            self.inside_kernel += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.inside_kernel -= 1
        return run


def test_continuous_batching_calls_read_nothing_on_the_host(monkeypatch):
    """A padded prefill step and a padded decode step as continuous batching makes them, through the functions
    `hf.register_flash` gives transformers: no value of any tensor is read on the host before the kernels (a
    synchronisation per layer and step on a GPU)."""
    hf.register_flash()
    q, k, v = torch.randn(9, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7, 7], dtype=torch.int32), torch.tensor([0, 5, 10, 10], dtype=torch.int32)
    case = make_case([5, 20, 0], lq=1, hq=4, hkv=2, d=16, block_size=16, capacity=32, num_new=1)
    case.cache_seqlens[2] = -1
    case.block_table[2] = -1
    reads = HostReads(monkeypatch)
    out = hf._padded_batch_varlen(q, k, v, cu_q, cu_k, 4, 5, softmax_scale=0.25, causal=True)
    decoded = hf._padded_batch_with_kvcache(case.q, case.k_cache.clone(), case.v_cache.clone(), case.k_new,
                                            case.v_new, cache_seqlens=case.cache_seqlens,
                                            block_table=case.block_table, softmax_scale=0.25, causal=True)
    assert reads.reads == []
    monkeypatch.undo()
    assert out.shape == q.shape and decoded.shape == case.q.shape


def _paged_varlen_case():
    """Two sequences of 2 and 3 queries against 10 and 30 cached keys in a paged cache of 16-key blocks."""
    case = make_case([10, 30], lq=1, hq=4, hkv=2, d=16, block_size=16, capacity=32)
    q = torch.randn(5, 4, 16)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 10, 40], dtype=torch.int32)
    return case, q, cu_q, cu_k


def test_paged_varlen_runs_its_forward_on_inputs_that_require_grad():
    """As flash_attn: the forward of a paged call whose q/k/v require grad runs (same values as without grad) and
    joins the graph; only a backward through it is refused, with a RuntimeError that says why."""
    case, q, cu_q, cu_k = _paged_varlen_case()
    want = fa.flash_attn_varlen_func(q, case.k_cache, case.v_cache, cu_q, cu_k, 3, 30, causal=True,
                                     block_table=case.block_table)
    q, k, v = (t.clone().requires_grad_() for t in (q, case.k_cache, case.v_cache))
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 30, causal=True, block_table=case.block_table)
    assert out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()


def test_bound_errors_are_runtime_errors_as_flash_attn_raises():
    """flash_attn's checks are TORCH_CHECKs (RuntimeError); ours are ValueErrors: the interface raises both."""
    case, q, cu_q, cu_k = _paged_varlen_case()
    past_capacity = torch.tensor([0, 10, 45], dtype=torch.int32)  # 35 keys in a row of two 16-key blocks
    with pytest.raises(RuntimeError, match="capacity") as raised:
        fa.flash_attn_varlen_func(q, case.k_cache, case.v_cache, cu_q, past_capacity, 3, 35, causal=True,
                                  block_table=case.block_table)
    assert isinstance(raised.value, ValueError)
    decode = make_case([5, 32], lq=1, hq=4, hkv=2, d=16, block_size=16, capacity=32)
    with pytest.raises(RuntimeError, match="capacity"):
        fa.flash_attn_with_kvcache(decode.q, decode.k_cache.clone(), decode.v_cache.clone(), torch.randn(2, 1, 2, 16),
                                   torch.randn(2, 1, 2, 16), cache_seqlens=decode.cache_seqlens,
                                   block_table=decode.block_table)
