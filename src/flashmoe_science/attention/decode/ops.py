"""Attention against a KV cache as ``torch.library`` custom ops, for ``torch.compile`` (``custom_ops`` describes the
scheme): ``attention_decode`` (forward only), and ``attention_decode_append`` where new keys are written into the
caches in place. ``decode.api`` calls them while compiling."""

from __future__ import annotations

from flashmoe_science.attention.decode.call import decode_call
from flashmoe_science.custom_ops import NAMESPACE, custom_op, lse_dtype, window_of


# ------------------------------------------------------------------------------------------------------- decode
# Two registrations of one function: with k_new/v_new the caches are written in place (declared mutated), without
# them they are only read (a declared mutation would make the compiler copy the whole cache on every call).
def _decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
            rotary_interleaved, causal, softmax_scale, window, softcap, alibi_slopes, num_splits, backend,
            check_values, cache_batch_idx, cache_leftpad, k_scale, v_scale):
    out, lse = decode_call(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale, causal=causal, softmax_scale=softmax_scale,
        window=window_of(window), softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True,
        num_splits="auto" if num_splits == 0 else num_splits, backend=backend, check_values=check_values)
    return out.contiguous(), lse.to(lse_dtype(q)).contiguous()


def _decode_fake(q, *args):
    batch, length_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, length_q), dtype=lse_dtype(q))


attention_decode = custom_op(f"{NAMESPACE}::attention_decode", _decode, mutates_args=(),
                       schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                              "Tensor? k_new, Tensor? v_new, Tensor? rotary_cos, Tensor? rotary_sin, "
                              "bool rotary_interleaved, bool causal, float? softmax_scale, SymInt[]? window, "
                              "float? softcap, Tensor? alibi_slopes, int num_splits, str backend, bool? check_values, "
                              "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? k_scale, Tensor? v_scale) "
                              "-> (Tensor, Tensor)")
attention_decode_append = custom_op(
    f"{NAMESPACE}::attention_decode_append", _decode, mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? block_table, "
           "Tensor? k_new, Tensor? v_new, Tensor? rotary_cos, Tensor? rotary_sin, bool rotary_interleaved, "
           "bool causal, float? softmax_scale, SymInt[]? window, float? softcap, Tensor? alibi_slopes, int num_splits, "
           "str backend, bool? check_values, Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? k_scale, "
           "Tensor? v_scale) -> (Tensor, Tensor)")
attention_decode.register_fake(_decode_fake)
attention_decode_append.register_fake(_decode_fake)
