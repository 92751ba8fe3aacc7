"""FlashAttention's varlen test (its tests/test_flash_attn.py, test_flash_attn_varlen_output) through the
flash_attn-shaped call `integrations.flash_attn_interface.flash_attn_varlen_func`, shared by the CPU subset
(test_flash_attn_varlen.py, the reference backend) and the GPU grid (test_flash_attn_varlen_gpu.py).

A case is a padded batch as a tokenizer gives it: q (B, Lq, Hq, D), k/v (B, Lk, Hkv, D) and one padding mask for the
queries and one for the keys, each row real up to its length and padding after (``PADDING`` modes: "full" rows,
"random" lengths in [L - 20, L], "third" lengths in [L / 3, L], "zero": "third" with one row of no tokens). The mask
unpads the batch to packed tokens and cu_seqlens, the call runs on them (``return_attn_probs=True`` for the LSE) and
its output is padded back (zeros at padding rows). Out, LSE and dq, dk, dv of the padded tensors are checked against
the float64 oracle of feature_oracle.py run on the same packed sequences, within 2 x the same formula's error in the
tested dtype + slack (`check_forward_and_grads`, the rule of every attention test here).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from feature_oracle import assert_within_rule, check_forward_and_grads, varlen_feature_attention
from helpers import LSE_SLACK
from flashmoe_science.integrations.flash_attn_interface import flash_attn_varlen_func

PADDING = ("full", "random", "third", "zero")
HEADS = 6
# variant -> the call's options: causal, a window drawn as flash_attn draws it, softcap, ALiBi, GQA/MQA, determinism
VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "local": dict(local=True),
    "causal-local-gqa": dict(causal=True, local=True, heads_kv=2),
    "softcap-causal-gqa": dict(causal=True, softcap=15.0, heads_kv=2),
    "alibi": dict(alibi=True),
    "alibi-causal-mqa": dict(causal=True, alibi=True, heads_kv=1),
    "deterministic-causal-mqa": dict(causal=True, deterministic=True, heads_kv=1),
}


def padding_lengths(mode: str, length: int, batch: int, generator: torch.Generator) -> list[int]:
    if mode == "full":
        return [length] * batch
    low = max(1, length - 20) if mode == "random" else max(1, length // 3)
    lengths = torch.randint(low, length + 1, (batch,), generator=generator).tolist()
    if mode == "zero":
        lengths[1] = 0
    return lengths


def _padding_and_window(padding: str, seqlen_q: int, seqlen_k: int, batch: int, options: dict, generator, device):
    """A case's row lengths (queries, keys) and masks by `padding_lengths`, and its window as flash_attn draws it
    (both sides in [0, seqlen_k) for a local variant, else (-1, -1))."""
    lengths_q = padding_lengths(padding, seqlen_q, batch, generator)
    lengths_k = padding_lengths(padding, seqlen_k, batch, generator)
    mask_q = torch.arange(seqlen_q, device=device) < torch.tensor(lengths_q, device=device)[:, None]
    mask_k = torch.arange(seqlen_k, device=device) < torch.tensor(lengths_k, device=device)[:, None]
    window = (torch.randint(0, seqlen_k, (2,), generator=generator) if options.get("local")
              else torch.tensor([-1, -1]))
    return lengths_q, lengths_k, mask_q, mask_k, window


def _unpad(padded: torch.Tensor, mask: torch.Tensor):
    """The real rows of (B, L, ...) in batch order, their flat indices, and int32 cu_seqlens."""
    indices = mask.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = F.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)
    return padded.flatten(0, 1).index_select(0, indices), indices, cu_seqlens


def _pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    out = packed.new_zeros(batch * length, *packed.shape[1:]).index_copy(0, indices, packed)
    return out.view(batch, length, *packed.shape[1:])


def run_varlen_grid_case(seqlen_q: int, seqlen_k: int, d: int, variant: str, padding: str, dtype, device,
                         batch: int = 4):
    options = VARIANTS[variant]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seqlen_q} {seqlen_k} {d} {variant} {padding}".encode()))

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    heads_kv = options.get("heads_kv", HEADS)
    softcap = options.get("softcap", 0.0)
    q = randn(batch, seqlen_q, HEADS, d) * (softcap / 4 if softcap else 1.0)  # scores across the cap's range
    k, v = randn(batch, seqlen_k, heads_kv, d), randn(batch, seqlen_k, heads_kv, d)
    lengths_q, lengths_k, mask_q, mask_k, window = _padding_and_window(padding, seqlen_q, seqlen_k, batch, options,
                                                                       generator, device)
    slopes = (torch.rand(batch, HEADS, generator=generator) * 0.3).to(device) if options.get("alibi") else None
    causal = options.get("causal", False)

    def ours(q, k, v):
        q_packed, indices_q, cu_q = _unpad(q, mask_q)
        (k_packed, _, cu_k), (v_packed, _, _) = _unpad(k, mask_k), _unpad(v, mask_k)
        out, lse = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                          causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                          deterministic=options.get("deterministic", False), return_attn_probs=True)
        return _pad(out, indices_q, batch, seqlen_q), lse

    def oracle(q, k, v, compute_dtype):
        q_packed, indices_q, cu_q = _unpad(q, mask_q)
        (k_packed, _, cu_k), (v_packed, _, _) = _unpad(k, mask_k), _unpad(v, mask_k)
        out, lse = varlen_feature_attention(q_packed, k_packed, v_packed, cu_q.tolist(), cu_k.tolist(),
                                            causal=causal, window=tuple(window.tolist()), softcap=softcap or None,
                                            alibi=slopes, dtype=compute_dtype)
        return _pad(out, indices_q, batch, seqlen_q), lse

    check_forward_and_grads(ours, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


def run_paged_varlen_case(seqlen_q: int, seqlen_k: int, d: int, block_size: int, variant: str, padding: str, dtype,
                          device, batch: int = 4):
    """FlashAttention's paged varlen test (its tests/test_flash_attn.py, test_flash_attn_varlen_causal with
    paged_kv_block_size): the keys and values live in a paged cache of 3x the pages the batch needs, sequence b's
    pages in random order in row b of the block table, and the varlen call reads sequence b's first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] positions through it. Forward only, as there: out and LSE against the
    float64 oracle on the same keys gathered into packed rows."""
    options = VARIANTS[variant]
    generator = torch.Generator().manual_seed(zlib.crc32(f"paged {seqlen_q} {seqlen_k} {d} {block_size} {variant}"
                                                         f" {padding}".encode()))

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    heads_kv = options.get("heads_kv", HEADS)
    blocks_per_row = -(-seqlen_k // block_size)
    num_blocks = 3 * batch * blocks_per_row
    k_pages, v_pages = randn(num_blocks, block_size, heads_kv, d), randn(num_blocks, block_size, heads_kv, d)
    table = torch.randperm(num_blocks, generator=generator)[:batch * blocks_per_row].view(batch, blocks_per_row)
    table = table.to(device=device, dtype=torch.int32)
    k, v = (pages[table.long()].flatten(1, 2)[:, :seqlen_k] for pages in (k_pages, v_pages))
    q = randn(batch, seqlen_q, HEADS, d)
    lengths_q, lengths_k, mask_q, mask_k, window = _padding_and_window(padding, seqlen_q, seqlen_k, batch, options,
                                                                       generator, device)
    causal = options.get("causal", False)
    q_packed, indices_q, cu_q = _unpad(q, mask_q)
    cu_k = F.pad(mask_k.sum(1).cumsum(0), (1, 0)).to(torch.int32)
    out, lse = flash_attn_varlen_func(q_packed, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                      causal=causal, window_size=window, return_attn_probs=True, block_table=table)
    (k_packed, _, _), (v_packed, _, _) = _unpad(k, mask_k), _unpad(v, mask_k)

    def oracle(compute_dtype):
        return varlen_feature_attention(*(t.to(compute_dtype) for t in (q_packed, k_packed, v_packed)), cu_q.tolist(),
                                        cu_k.tolist(), causal=causal, window=tuple(window.tolist()),
                                        dtype=compute_dtype)

    (ref, ref_lse), (same, same_lse) = oracle(torch.float64), oracle(dtype)
    assert_within_rule("out", _pad(out, indices_q, batch, seqlen_q).cpu(), _pad(ref, indices_q, batch, seqlen_q).cpu(),
                       _pad(same, indices_q, batch, seqlen_q).cpu(), dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    assert_within_rule("lse", lse[finite].cpu(), ref_lse[finite].cpu(), same_lse.float()[finite].cpu(), dtype,
                       LSE_SLACK, relative=True)
