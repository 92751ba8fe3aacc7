"""The Gluon sm_90 backward (hopper/bwd_sm90.py one pass for D <= 128; bwd_sm90_hdim256.py + bwd_dq_sm90.py for
D 129..256) with variable length, sliding windows, softcap and ALiBi, on a Hopper GPU, launched directly.

Run: `PYTHONPATH=src python -m pytest tests/attention/test_backward_sm90_features_gpu.py -q -m gpu`.

The backward reads only out and lse from a forward: here they come from a float32 PyTorch evaluation of the same
attention (so the test depends on no forward kernel). Each gradient is compared with a float64 oracle written out
by hand below (no library code), within 2 x PyTorch's own bf16 error plus slack (grad_helpers.GRAD_SLACK): PyTorch's
bf16 gradients are SDPA's with the window and ALiBi as a float mask, or the same explicit math in bf16 where SDPA has
no softcap. Gradients, delta and dq_accum are NaN-poisoned before the launch.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from grad_helpers import GRAD_SLACK, max_abs_err
from sm90_helpers import hopper_attention_module

pytestmark = pytest.mark.gpu

CUDA = "cuda"


# ------------------------------------------------------------------------------------------------ the oracle
def _window_visibility(lq, lk, causal, window, device):
    """(Lq, Lk): query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded; causal
    clips right to 0): the documented definition, written out."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    d = torch.arange(lq, device=device)[:, None] + (lk - lq) - torch.arange(lk, device=device)[None, :]  # i+diag-j
    seen = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= d >= -right
    if left >= 0:
        seen &= d <= left
    return seen, d.abs()


def _attention(q, k, v, seen, dist, scale, softcap, slopes, sdpa):
    """One sequence, (1, H, L, D) in the compute dtype; slopes (Hq,) or None. Dead rows give zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    alive = seen.any(dim=-1, keepdim=True)
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).expand(1, q.shape[1], *seen.shape)
    if slopes is not None:
        bias = bias - slopes.to(q.dtype)[None, :, None, None] * dist.to(q.dtype)
    bias = bias.masked_fill(~seen & alive, float("-inf"))  # dead rows: finite, then zeroed
    if sdpa and not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale) * alive
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores + bias, dim=-1) @ v * alive


def _grads(q, k, v, grad_out, seen, dist, scale, softcap, slopes, dtype, sdpa):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = _attention(*leaves, seen, dist, scale, softcap, slopes, sdpa)
    return torch.autograd.grad(out, leaves, grad_out.to(dtype))


def _forward_stats(q, k, v, seen, dist, scale, softcap, slopes):
    """out (q's dtype) and natural-log lse (float32) of one sequence, from float32 math: what the backward reads."""
    group = q.shape[1] // k.shape[1]
    k32, v32 = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.float() @ k32.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        scores = scores - slopes[None, :, None, None] * dist.float()
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for dead rows
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return (weights @ v32).to(q.dtype), lse


# ------------------------------------------------------------------------------------------------ the launch
def _packed(lengths, h, d, dtype):
    """Packed (total, H, D) rows of every sequence, and its kernel view (1, H, total, D)."""
    t = torch.randn(sum(lengths), h, d, device=CUDA).to(dtype)
    return t, t.transpose(0, 1).unsqueeze(0)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=CUDA)


def run_case(lengths_q, lengths_k, hq, hkv, d, *, causal=False, window=None, softcap=None, alibi=False,
             varlen=True, scale=None, dtype=torch.bfloat16, seed=0, deterministic=False):
    """Random inputs, the sm_90 backward on them (`deterministic`: its ordered dQ reduce-adds), every gradient
    checked per sequence. Returns (dq, dk, dv) and the inputs (for determinism checks)."""
    from flashmoe_science.attention.features import CallFeatures, Varlen
    from flashmoe_science.attention.mask import make_mask
    from flashmoe_science.attention.tiles import padded_head_dim

    bwd_sm90 = hopper_attention_module("bwd_sm90")
    torch.manual_seed(seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n = len(lengths_q)
    slopes = (torch.rand(n, hq, device=CUDA) * 0.3) if alibi else None
    if varlen:
        (_, q4), (_, k4), (_, v4), (_, g4) = (_packed(lengths_q, hq, d, dtype), _packed(lengths_k, hkv, d, dtype),
                                              _packed(lengths_k, hkv, d, dtype), _packed(lengths_q, hq, d, dtype))
        cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
        spans = [(int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])) for b in range(n)]

        def seq_views(t4, b, kv):
            first, end = spans[b][2:] if kv else spans[b][:2]
            return t4[:, :, first:end]
        varlen_info = Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k))
    else:
        assert len(set(lengths_q)) == 1 and len(set(lengths_k)) == 1
        lq, lk = lengths_q[0], lengths_k[0]
        q4, k4, v4, g4 = (torch.randn(n, h, length, d, device=CUDA).to(dtype)
                          for h, length in ((hq, lq), (hkv, lk), (hkv, lk), (hq, lq)))
        seq_views = lambda t4, b, kv: t4[b:b + 1]  # noqa: E731
        varlen_info = None
    out4 = torch.empty_like(q4)
    lse4 = torch.empty(q4.shape[:3], device=CUDA)
    masks = []
    for b in range(n):
        qb, kb, vb = seq_views(q4, b, False), seq_views(k4, b, True), seq_views(v4, b, True)
        seen, dist = _window_visibility(qb.shape[2], kb.shape[2], causal, window, CUDA)
        masks.append((seen, dist))
        if kb.shape[2] == 0:  # no keys: zeros out, lse -inf
            ob, lb = torch.zeros_like(qb), torch.full(qb.shape[:3], float("-inf"), device=CUDA)
        else:
            ob, lb = _forward_stats(qb, kb, vb, seen, dist, scale, softcap, None if slopes is None else slopes[b])
        seq_views(out4, b, False).copy_(ob)
        seq_views(lse4, b, False).copy_(lb)
    features = CallFeatures(mask=make_mask(causal, window, softcap), alibi_slopes=slopes, varlen=varlen_info)
    dq4, dk4, dv4 = (torch.full_like(t, float("nan")) for t in (q4, k4, v4))
    delta = torch.full_like(lse4, float("nan"))
    dq_accum = torch.full((*q4.shape[:3], padded_head_dim(d)), float("nan"), device=CUDA)
    bwd_sm90.attention_backward_sm90(q4, k4, v4, out4, lse4, g4, delta, dq4, dk4, dv4, features, scale, dq_accum,
                                     deterministic=deterministic)
    torch.cuda.synchronize()

    _check_sequences((dq4, dk4, dv4), (q4, k4, v4, g4), seq_views, masks, slopes, scale, softcap, dtype)
    return (dq4, dk4, dv4), features


def _check_sequences(grads, inputs, seq_views, masks, slopes, scale, softcap, dtype):
    """Each sequence's dq, dk, dv (views of the kernels' 4-D gradients) vs the float64 oracle, within 2 x torch's
    own bf16 error plus slack."""
    q4, k4, v4, g4 = inputs
    for b, (seen, dist) in enumerate(masks):
        qb, kb, vb, gb = (seq_views(q4, b, False), seq_views(k4, b, True), seq_views(v4, b, True),
                          seq_views(g4, b, False))
        ours = (seq_views(grads[0], b, False), seq_views(grads[1], b, True), seq_views(grads[2], b, True))
        if qb.shape[2] == 0 or kb.shape[2] == 0:  # nothing attends: zero gradients
            assert all(torch.equal(o, torch.zeros_like(o)) for o in ours), f"sequence {b}: nonzero gradients"
            continue
        sb = None if slopes is None else slopes[b]
        ref = _grads(qb, kb, vb, gb, seen, dist, scale, softcap, sb, torch.float64, False)
        base = _grads(qb, kb, vb, gb, seen, dist, scale, softcap, sb, dtype, True)
        for name, o, r, t in zip(("dq", "dk", "dv"), ours, ref, base):
            assert torch.isfinite(o).all(), f"sequence {b}: {name} not finite"
            err, torch_err = max_abs_err(o, r), max_abs_err(t, r)
            bound = 2 * torch_err + GRAD_SLACK[dtype] * max(1.0, r.abs().max().item() if r.numel() else 0.0)
            assert err <= bound, (f"sequence {b} (Lq={qb.shape[2]}, Lk={kb.shape[2]}): {name} error {err:.3e} > "
                                  f"{bound:.3e} (2 x torch's {torch_err:.3e} + slack)")


# ------------------------------------------------------------------------------------------------ the cases
RAGGED = [0, 1, 17, 64, 129, 300, 1000, 0, 555]  # empty, one row, odd, a tile, > 4 tiles of 128 keys


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_ragged(d, causal):
    run_case(RAGGED, RAGGED, 4, 2, d, causal=causal)


# packed sequences starting at every row residue mod 4: a rank-1 TMA box of lse or Δ at such a row would fault
MISALIGNED = [1, 17, 0, 130, 3, 555, 64, 2]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_staged_statistics_at_misaligned_starts(causal, deterministic, monkeypatch):
    """Packed D=128 batches with a full mask stage lse and Δ through their padded copies (the preprocess that
    writes them spied on), under a causal mask they read the forward's lse: right per sequence against float64;
    the deterministic mode bit-identical."""
    from flashmoe_science.attention import bwd_prep

    calls = []
    real = bwd_prep.padded_stats_launch
    monkeypatch.setattr(bwd_prep, "padded_stats_launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first, _ = run_case(MISALIGNED, MISALIGNED, 4, 2, 128, causal=causal, deterministic=deterministic)
    assert bool(calls) == (not causal), "staged statistics on packed batches: full masks only"
    if deterministic:
        second, _ = run_case(MISALIGNED, MISALIGNED, 4, 2, 128, causal=causal, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_unequal_q_and_k_lengths(d):
    run_case([5, 300, 0, 64, 700], [40, 129, 33, 0, 1000], 4, 1, d, causal=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window,causal", [((100, 0), False), ((64, 64), False), ((0, 200), False), ((255, -1), True),
                                           ((-1, 37), False), ((0, 0), False)])
def test_windows_dense(d, window, causal):
    run_case([1100] * 2, [1100] * 2, 4, 2, d, causal=causal, window=window, varlen=False)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_window_cross_lengths(d):
    run_case([300], [1000], 4, 2, d, window=(150, 20), varlen=False)
    run_case([1000], [300], 4, 2, d, window=(150, 20), varlen=False)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_and_alibi(d, causal):
    run_case([700] * 2, [700] * 2, 4, 2, d, causal=causal, softcap=5.0, varlen=False)
    run_case([700] * 2, [700] * 2, 4, 2, d, causal=causal, alibi=True, varlen=False)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_alibi_ragged_cross_and_window(d):
    """ALiBi without a softcap rides in the score product's start: causal ragged batches, Lq != Lk both ways, and a
    window reaching right of the diagonal (the bias's other sign)."""
    run_case(RAGGED, RAGGED, 8, 2, d, causal=True, alibi=True)
    run_case([300], [1000], 4, 2, d, causal=True, alibi=True, varlen=False)
    run_case([1000], [300], 4, 2, d, window=(150, 20), alibi=True, varlen=False)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_everything_at_once_ragged(d):
    run_case(RAGGED, RAGGED, 8, 2, d, causal=True, window=(200, -1), softcap=20.0, alibi=True)


@pytest.mark.parametrize("d", [80, 96, 192])
def test_padded_head_dims(d):
    run_case([333, 17, 0, 600], [333, 17, 0, 600], 4, 2, d, window=(90, 90), alibi=True)


def test_random_ragged_batches():
    rng = random.Random(7)
    for trial in range(6):
        n = rng.randint(1, 6)
        lengths = [rng.choice([0, 1, rng.randint(2, 200), rng.randint(200, 1500)]) for _ in range(n)]
        d = rng.choice([64, 128, 256])
        window = rng.choice([None, (rng.randint(0, 300), rng.randint(0, 300)), (rng.randint(0, 300), -1)])
        run_case(lengths, lengths, 4, rng.choice([1, 2, 4]), d, causal=rng.random() < 0.5, window=window,
                 softcap=rng.choice([None, 10.0]), alibi=rng.random() < 0.5, seed=trial)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "dense"])
def test_two_kernel_path_is_bit_identical_run_to_run(varlen):
    """D 129..256 (the dK/dV and dQ kernels, no atomics): deterministic for varlen and windowed calls."""
    lengths = [700, 1, 333, 0, 1200] if varlen else [900] * 2
    first, _ = run_case(lengths, lengths, 4, 2, 256, causal=True, window=(300, -1), softcap=8.0, varlen=varlen)
    second, _ = run_case(lengths, lengths, 4, 2, 256, causal=True, window=(300, -1), softcap=8.0, varlen=varlen)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 128])
def test_one_pass_dk_dv_are_bit_identical_run_to_run(d):
    lengths = [700, 1, 333, 0, 1200]
    first, _ = run_case(lengths, lengths, 4, 2, d, window=(300, 100), alibi=True)
    second, _ = run_case(lengths, lengths, 4, 2, d, window=(300, 100), alibi=True)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])


# ------------------------------------------------------------------------------------------------ through the API
def _varlen_api_grads(lengths, hq, hkv, d, *, deterministic=False, seed=0, **mask):
    """flash_attention_varlen's gradients (autograd) and the inputs, packed."""
    from flashmoe_science.attention.varlen import flash_attention_varlen

    torch.manual_seed(seed)
    q, k, v, g = (torch.randn(sum(lengths), h, d, device=CUDA).to(torch.bfloat16) for h in (hq, hkv, hkv, hq))
    cu = _cu(lengths)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu, cu, max(lengths), max(lengths), deterministic=deterministic, **mask)
    return torch.autograd.grad(out, leaves, g), (q, k, v, g), cu


@pytest.mark.parametrize("d", [128, 256])
def test_varlen_api_backward_runs_the_sm90_kernels(d, monkeypatch):
    """flash_attention_varlen with a window, softcap and ALiBi: its backward is attention_backward_sm90's (spied
    on), and every sequence's gradients are right."""
    bwd_sm90 = hopper_attention_module("bwd_sm90")
    calls = []
    real = bwd_sm90.attention_backward_sm90
    monkeypatch.setattr(bwd_sm90, "attention_backward_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lengths = [0, 1, 300, 2100, 77]
    slopes = torch.rand(len(lengths), 4, device=CUDA) * 0.2
    mask = dict(causal=True, window=(500, -1), softcap=12.0, alibi_slopes=slopes)
    grads, (q, k, v, g), cu = _varlen_api_grads(lengths, 4, 2, d, **mask)
    assert calls, "the backward did not run the sm_90 kernels"
    as4 = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    spans = [(int(cu[b]), int(cu[b + 1])) for b in range(len(lengths))]
    seq_views = lambda t4, b, kv: t4[:, :, spans[b][0]:spans[b][1]]  # noqa: E731
    masks = [_window_visibility(n, n, True, (500, -1), CUDA) for n in lengths]
    _check_sequences([as4(t) for t in grads], [as4(t) for t in (q, k, v, g)], seq_views, masks, slopes,
                     1.0 / math.sqrt(d), 12.0, torch.bfloat16)


# the one pass's ordered dQ reduce-adds: a left window bound (later query tiles start at later key blocks), both
# bounds, packed sequences with empty and one-row ones, MQA/GQA, cross-attention lengths
DETERMINISTIC_CASES = {
    "window-left-causal": dict(lengths_q=[1000] * 2, lengths_k=[1000] * 2, hq=4, hkv=2, causal=True,
                               window=(300, -1), varlen=False),
    "window-both": dict(lengths_q=[777] * 2, lengths_k=[777] * 2, hq=4, hkv=4, window=(200, 150), varlen=False),
    "varlen-causal-mqa": dict(lengths_q=[0, 1, 300, 1100, 77], lengths_k=[0, 1, 300, 1100, 77], hq=4, hkv=1,
                              causal=True),
    "varlen-window-cross": dict(lengths_q=[129, 600, 1000], lengths_k=[700, 256, 1300], hq=4, hkv=2,
                                window=(260, 40)),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", list(DETERMINISTIC_CASES))
def test_deterministic_one_pass_masks_and_varlen(name, d):
    """deterministic=True on the one-pass kernel: right against float64 per sequence, and every gradient
    bit-identical over two runs on the same inputs."""
    first, _ = run_case(**DETERMINISTIC_CASES[name], d=d, deterministic=True)
    second, _ = run_case(**DETERMINISTIC_CASES[name], d=d, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [128, 256])
def test_deterministic_varlen_window_backward_is_bit_identical(d, monkeypatch):
    """deterministic=True through the API: D=256 on the Gluon dK/dV and dQ kernels, D=128 on the one pass with its
    dQ reduce-adds in key-block order (spied on); both bit-identical over two runs."""
    bwd_sm90 = hopper_attention_module("bwd_sm90")
    modes = []
    real = bwd_sm90.attention_backward_sm90
    monkeypatch.setattr(bwd_sm90, "attention_backward_sm90",
                        lambda *a, **kw: modes.append(kw.get("deterministic")) or real(*a, **kw))
    mask = dict(causal=True, window=(200, -1), softcap=10.0)
    first, _, _ = _varlen_api_grads([700, 1, 0, 1300], 4, 2, d, deterministic=True, **mask)
    second, _, _ = _varlen_api_grads([700, 1, 0, 1300], 4, 2, d, deterministic=True, **mask)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert modes == [True, True], "the backward did not run the sm_90 kernels in their deterministic mode"
