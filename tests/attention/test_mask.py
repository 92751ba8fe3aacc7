"""The shared mask rules (attention/mask.py): argument checks, the host view, and the kernels' view of tiles and
elementwise masks under the Triton interpreter (in a child process: TRITON_INTERPRET must be set before triton is
imported, see test_triton_interpreter.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashmoe_science.attention.mask import MaskSpec, make_mask, score_mods, visibility
from interpreter_driver import interpreter_suite, run_marked_suite


def brute_force(lq, lk, left, right):
    out = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        for j in range(lk):
            d = i + lk - lq
            out[i, j] = (left < 0 or j >= d - left) and (right < 0 or j <= d + right)
    return out


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 9), (9, 5), (16, 16), (0, 3), (3, 0)])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (2, -1), (-1, 3), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_visibility_matches_the_definition(lq, lk, window, causal):
    spec = make_mask(causal, window)
    right = 0 if causal else window[1]
    assert torch.equal(visibility(lq, lk, spec), brute_force(lq, lk, window[0], right))


def test_causal_is_window_left_unbounded_right_zero():
    assert make_mask(True) == MaskSpec(causal=True, window_left=-1, window_right=0)
    assert make_mask(True, (5, 7)).window_right == 0
    assert make_mask(False).is_plain and make_mask(True).is_plain
    assert not make_mask(False, (3, -1)).is_plain and not make_mask(False, softcap=1.0).is_plain


@pytest.mark.parametrize("bad,exc", [((-2, 0), ValueError), ((1,), TypeError), ((1.5, 2), TypeError),
                                     ("left", TypeError), ((True, 1), TypeError)])
def test_bad_windows_name_the_argument(bad, exc):
    with pytest.raises(exc, match="window"):
        make_mask(False, bad)


@pytest.mark.parametrize("bad,exc", [(-1.0, ValueError), (float("inf"), ValueError), ("2", TypeError)])
def test_bad_softcap_names_the_argument(bad, exc):
    with pytest.raises(exc, match="softcap"):
        make_mask(False, None, bad)


def test_score_mods_softcap_alibi_bias():
    s = torch.randn(2, 3, 4, 6, dtype=torch.float64) * 5
    slopes = torch.rand(2, 3, dtype=torch.float64)
    bias = torch.randn(1, 3, 4, 6, dtype=torch.float64)
    got = score_mods(s, make_mask(False, softcap=2.0), 4, 6, slopes, bias)
    i = torch.arange(4)[:, None] + 2
    j = torch.arange(6)[None, :]
    want = 2.0 * torch.tanh(s / 2.0) - slopes[:, :, None, None] * (i - j).abs() + bias
    torch.testing.assert_close(got, want)


@pytest.mark.slow
@interpreter_suite(Path(__file__).with_name("mask_interpreter_check.py"))
def test_kernel_view_matches_host_view_under_the_interpreter(request):
    run_marked_suite(request)
