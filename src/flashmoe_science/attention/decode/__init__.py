"""Attention against a KV cache, split as the dense path is: ``api`` (the front door), ``call`` (checked problem ->
plan -> execute), ``problem`` and ``checks`` (the checked call), ``plan`` (the ordered families and the walk),
``tiles`` (the cache kernel's heuristics), ``reference`` (PyTorch), the families ``dense_backend``,
``triton_backend``, ``reference_backend``, and ``launch`` (what the cache kernels' launches share).

``flash_attention_decode`` attends any number of new query tokens (one for decode, a few for speculative
decoding, thousands for a chunked prefill) to a KV cache, contiguous ``(B_cache, Lmax, Hkv, D)`` or paged
``(num_blocks, block_size, Hkv, D)`` with a block table, each sequence with its own length. Conventions follow
``flash_attn_with_kvcache``:

* ``cache_seqlens[b]`` keys are in the cache before the call. With ``k_new``/``v_new`` (``(B, L_new, Hkv, D)``) the
  new keys are first written at positions ``cache_seqlens[b] + t`` (in place), so the sequence has
  ``Lk = cache_seqlens[b] + L_new`` keys; without them ``Lk = cache_seqlens[b]``.
* ``cache_batch_idx[b]`` (contiguous caches): the cache row of sequence b (default b). ``cache_leftpad[b]``
  (contiguous caches): the sequence's keys start at that position; positions before it are padding, so the
  sequence has ``Lk = cache_seqlens[b] + L_new - cache_leftpad[b]`` keys and key j sits at ``j - cache_leftpad[b]``
  for the mask and ALiBi (rotary angles stay those of the cache positions).
* The ``Lq`` query tokens are the last ``Lq`` positions of the sequence: query i sits at ``Lk - Lq + i`` and the
  mask rules of `attention.mask` apply with ``diagonal = Lk - Lq`` (causal: query i sees keys ``<= Lk - Lq + i``).
* Rotary (``rotary_cos``/``rotary_sin`` of shape ``(seqlen_ro, rotary_dim / 2)``, with k_new only): k_new's token t
  is rotated at position ``cache_seqlens[b] + t``; q's token i at ``cache_seqlens[b] + i`` when the mask is causal
  or windowed, else at ``cache_seqlens[b]``. The caller's q is not modified.
* FP8 caches: ``float8_e4m3fn`` k_cache/v_cache with float32 ``k_scale``/``v_scale`` per KV head (``(Hkv,)``, or
  one value for all heads; a cache value times its scale is the key or value, vLLM's and FlashInfer's
  convention). New keys and values are appended as e4m3 of value / scale, saturated at +-448.

The cache kernel (`triton/decode.py`) serves every query count: its row tiles pack (token, query head of a KV head)
pairs, one tile for a decode step's group, many for a prefill chunk, whose tiles are the dense forward's
(`attention.tiles.forward_tiles`). The packed-query form (`cache_varlen_call`) is the paged path of
`flash_attention_varlen`. A prefill chunk on a contiguous cache, beyond a decode step's tile and with nothing but what the dense forward
computes (`dense_chunk_refusal`), runs the dense packed forward on views of the cache instead (`DenseChunk`: the
Gluon sm_90 kernels on Hopper); ``plan_decode`` says which and why.

Values (lengths, block-table entries, cache rows, the rotary table's length) are checked on the host in eager calls:
one device-to-host copy of a few flags, as flash_attn pays for paged caches. The check is skipped while a CUDA graph
is being captured (``torch.cuda.is_current_stream_capturing()``) and when ``check_values=False``; then the kernels
trust nothing: a sequence whose values are out of range gets NaN outputs, never another sequence's keys, and no
read or write leaves the cache.
"""

from flashmoe_science.attention.decode.api import flash_attention_decode

__all__ = ["flash_attention_decode"]
