"""The Triton forward and backward with user mods (attention/mods.py) under the Triton interpreter, against the
float64 torch twins of mod_cases.py (tolerance: 2 x PyTorch's same-dtype error + slack).

Runs in the TRITON_INTERPRET=1 child of test_mods.py's driver; skipped in a plain run. Tiny odd sizes (the
interpreter's tiles are 16 x 16: lengths 37 / 29 meet full, partial, empty and ragged tiles), GQA (4 query heads on
2 key/value heads), fp16 (fp32 once), dense and packed, the fused and the two-pass backward.
"""

from __future__ import annotations

import os

import pytest
import torch

from feature_oracle import check_forward_and_grads
from flashmoe_science import flash_attention_science, flash_attention_varlen
from flashmoe_science.attention.mods import MaskMod
from helpers import dtype_id, randn
from mod_cases import CASES, case, head_window, mod_oracle, packed_prefix_oracle, prefix_lm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="runs in the TRITON_INTERPRET=1 child process of test_mods.py")


@pytest.mark.parametrize("name", CASES)
def test_dense(name):
    dtype = torch.float32 if name == "neighbours" else torch.float16
    batch, hq, hkv, lq, lk = 2, 4, 2, 37, 29
    if name in ("document_window", "neighbours"):  # square: the positions index one table of atoms
        lk = lq
    q, k, v = randn(batch, hq, lq, 24, dtype=dtype), randn(batch, hkv, lk, 24, dtype=dtype), \
        randn(batch, hkv, lk, 24, dtype=dtype)
    mask_mod, score_mod, seen, twin = case(name, batch, hq, lq, lk)
    deterministic = name in ("prefix_lm", "softcap_mod")  # the two-pass backward; the others the fused one

    def run(q, k, v):
        return flash_attention_science(q, k, v, backend="triton", return_lse=True, mask_mod=mask_mod,
                                       score_mod=score_mod, deterministic=deterministic)

    def oracle(q, k, v, compute):
        return mod_oracle(q, k, v, seen, twin, dtype=compute)

    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", [torch.float16], ids=dtype_id)
def test_varlen(dtype):
    """A prefix-LM per packed sequence (b: the sequence) ANDed with a per-head window; lengths 0, 1, odd."""
    lengths = [19, 0, 1, 33]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = randn(int(cu[-1]), 4, 16, dtype=dtype), randn(int(cu[-1]), 2, 16, dtype=dtype), \
        randn(int(cu[-1]), 2, 16, dtype=dtype)
    prefix = torch.tensor([5, 0, 1, 20], dtype=torch.int32)

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), backend="triton",
                                      return_lse=True, mask_mod=MaskMod(prefix_lm, prefix), window=(11, -1))

    def oracle(q, k, v, compute):
        return packed_prefix_oracle(q, k, v, cu, lengths, prefix, 4, compute, window_left=11)

    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


def test_hidden_tiles_are_never_read():
    """Key tiles the block mask marks empty are skipped: NaN values there cannot reach the output."""
    q, k, v = (randn(1, 2, 64, 16) for _ in range(3))
    windows = torch.tensor([5, 5], dtype=torch.int32)
    poisoned = v.clone()
    poisoned[:, :, :16] = float("nan")  # keys 0..15: outside the window of rows 32..
    mod = MaskMod(head_window, windows)
    out = flash_attention_science(q, k, poisoned, mask_mod=mod, backend="triton")
    ref = flash_attention_science(q, k, v, mask_mod=mod, backend="triton")
    assert torch.equal(out[:, :, 32:], ref[:, :, 32:])
