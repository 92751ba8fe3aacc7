"""User mask_mod / score_mod (attention/mods.py) in the compiled Triton kernels on a GPU, against the float64 torch
twins of mod_cases.py; the planner sends mods to the Triton kernels (the sm_90 forward of a mask_mod runs with
backend='hopper': test_mods_sm90_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from feature_oracle import check_forward_and_grads
from flashmoe_science import flash_attention_science, flash_attention_varlen
from flashmoe_science.attention.api import describe_dispatch
from flashmoe_science.attention.mods import MaskMod
from helpers import randn
from mod_cases import CASES, case, head_window, mod_oracle, packed_prefix_oracle, prefix_lm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_dense(name, dtype, deterministic):
    batch, hq, hkv, lq = 2, 8, 2, 1000
    lk = lq if name in ("document_window", "neighbours") else 777
    q, k, v = (randn(batch, h, n, 64, dtype=dtype).cuda() for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    mask_mod, score_mod, seen, twin = case(name, batch, hq, lq, lk, device="cuda")

    def run(q, k, v):
        return flash_attention_science(q, k, v, return_lse=True, mask_mod=mask_mod, score_mod=score_mod,
                                       deterministic=deterministic)

    def oracle(q, k, v, compute):
        return mod_oracle(q, k, v, seen, twin, dtype=compute)

    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


def test_varlen():
    lengths = [300, 0, 1, 517]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (randn(int(cu[-1]), h, 128, dtype=torch.bfloat16).cuda() for h in (8, 2, 2))
    prefix = torch.tensor([50, 0, 1, 200], dtype=torch.int32)
    mod = MaskMod(prefix_lm, prefix.cuda())

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu.cuda(), cu.cuda(), max(lengths), max(lengths), return_lse=True,
                                      mask_mod=mod)

    def oracle(q, k, v, compute):
        return packed_prefix_oracle(q, k, v, cu, lengths, prefix, 8, compute)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


def test_a_mod_of_partial_tiles_runs_the_triton_forward_and_says_why():
    """A mask_mod of mostly partial tiles runs the Triton forward under auto; on Hopper the reason says why the sm_90
    forward left it (hopper/backend.mod_forward_refusal), and the backward is the sm_90 one at D=128."""
    q = randn(1, 4, 256, 128, dtype=torch.bfloat16).cuda()
    mod = MaskMod(head_window, torch.full((4,), 32, dtype=torch.int32, device="cuda"))
    dispatch = describe_dispatch(q, q, q, mask_mod=mod)
    assert dispatch.backend == "triton"
    on_hopper = torch.cuda.get_device_capability() == (9, 0)
    assert dispatch.backward_backend == ("hopper" if on_hopper else "triton")
    if on_hopper:  # windows of 32 keys: every visited tile is partial
        assert "visited tiles are partial" in dispatch.reason


def test_plain_calls_do_not_change():
    """No mod: the same kernels and bit-identical outputs as before the mods existed (the mods are constexprs)."""
    q, k, v = (randn(2, 4, 333, 64, dtype=torch.bfloat16).cuda() for _ in range(3))
    for kwargs in (dict(), dict(causal=True), dict(window=(40, 0))):
        a = flash_attention_science(q, k, v, backend="triton", **kwargs)
        b = flash_attention_science(q, k, v, backend="triton", **kwargs)
        assert torch.equal(a, b)
        windows = torch.full((4,), 10 ** 6, dtype=torch.int32, device="cuda")
        if kwargs.get("causal"):  # a mask_mod that hides nothing beyond causal: the same softmax
            c = flash_attention_science(q, k, v, backend="triton", mask_mod=MaskMod(head_window, windows), **kwargs)
            torch.testing.assert_close(c, a, rtol=2e-2, atol=2e-2)


def test_hidden_tiles_are_never_read():
    q, k, v = (randn(1, 2, 1024, 64, dtype=torch.float16).cuda() for _ in range(3))
    mod = MaskMod(head_window, torch.tensor([63, 63], dtype=torch.int32, device="cuda"))
    poisoned = v.clone()
    poisoned[:, :, :256] = float("nan")
    out = flash_attention_science(q, k, poisoned, mask_mod=mod)
    ref = flash_attention_science(q, k, v, mask_mod=mod)
    assert torch.equal(out[:, :, 512:], ref[:, :, 512:])
