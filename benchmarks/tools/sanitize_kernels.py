"""One launch of each attention kernel family at small odd shapes, forward and backward, for compute-sanitizer:

    compute-sanitizer --tool memcheck --target-processes all python3 benchmarks/tools/sanitize_kernels.py [CASE ...]

(racecheck and synccheck check the sm_90 kernels' shared memory and barriers). PYTORCH_NO_CUDA_MEMORY_CACHING=1
makes every tensor its own allocation, so a read past one is reported. Prints "ok CASE" per case; the sanitizer's
summary says whether any launch misbehaved."""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from flashmoe_science import flash_attention_decode, flash_attention_science, flash_attention_varlen
from flashmoe_science.attention.mods import ScoreMod
from flashmoe_science.bench import mask_mods


def _packed(lengths, heads, kv_heads, head_dim, backward):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    k, v = (torch.randn(total, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
            for _ in range(2))
    out = flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    if backward:
        out.sum().backward()


def _mods(head_dim, backend):
    """Every mask of the mask-mods suite at 333 rows (its batch and heads: the mods' tables are shaped so)."""
    for _, mod, _, _ in mask_mods.mask_cases(333, "cuda"):
        q, k, v = (torch.randn(mask_mods.BATCH, mask_mods.HEADS, 333, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        flash_attention_science(q, k, v, mask_mod=mod, backend=backend).sum().backward()


@triton.jit
def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * (1.0 - 2.0 / (tl.exp(score * (2.0 / 30.0)) + 1.0))  # 30 tanh(score / 30)


@triton.jit
def _softcap_grad(score, b, h, q_idx, kv_idx):
    t = 1.0 - 2.0 / (tl.exp(score * (2.0 / 30.0)) + 1.0)
    return 1.0 - t * t


def _score_mods():
    """The sm_90 forward and backward with a score_mod at 333 rows, causal alone and beside each mask of the
    mask-mods suite."""
    q, k, v = (torch.randn(mask_mods.BATCH, mask_mods.HEADS, 333, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    mod = ScoreMod(_softcap, grad=_softcap_grad)
    flash_attention_science(q, k, v, causal=True, score_mod=mod, backend="hopper").sum().backward()
    for _, mask, _, _ in mask_mods.mask_cases(333, "cuda"):
        flash_attention_science(q, k, v, mask_mod=mask, score_mod=mod, backend="hopper").sum().backward()


def _decode(page):
    batch, heads, kv_heads, head_dim = 5, 8, 2, 128
    lengths = torch.tensor([1, 17, 300, 1023, 64], dtype=torch.int32, device="cuda")
    pages_per_seq = -(-1024 // page)
    cache = [torch.randn(batch * pages_per_seq, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
             for _ in range(2)]
    table = torch.randperm(batch * pages_per_seq, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    flash_attention_decode(q, *cache, lengths, block_table=table)


CASES = {
    "packed-d64": lambda: _packed([700, 1, 2048, 333], 8, 8, 64, False),
    "packed-gqa-d128": lambda: _packed([1500, 257, 2048, 999, 5], 16, 4, 128, False),
    "packed-d128-bwd": lambda: _packed([700, 1, 1029, 333], 8, 2, 128, True),
    "mods-hopper": lambda: _mods(128, "hopper"),
    "mods-triton": lambda: _mods(64, "triton"),
    "score-mods-hopper": _score_mods,
    "decode-pages16": lambda: _decode(16),
    "decode-pages64": lambda: _decode(64),
}


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        CASES[name]()
        torch.cuda.synchronize()
        print("ok", name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
