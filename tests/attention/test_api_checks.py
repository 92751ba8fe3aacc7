"""Input checks of the public attention call: every bad input is a ValueError or TypeError naming the argument;
empty inputs give empty or zero outputs; `describe_dispatch` explains its choice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashmoe_science import flash_attention_science
from flashmoe_science.attention.api import describe_dispatch
from helpers import DTYPES, dtype_id, make_qkv, randn


def _qkv(dtype=torch.float32, hq=4, hkv=2, lq=9, lk=11, d=32, batch=(2,)):
    return make_qkv((*batch, hq, lq, d), (*batch, hkv, lk, d), dtype)


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def interpreter(monkeypatch):
    # The API reads TRITON_INTERPRET at call time; these tests never reach a kernel launch.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# --------------------------------------------------------------------------------------------------------------
# Not tensors, wrong dtypes


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 1.0, [[1.0, 2.0]], np.ones((2, 4, 9, 32), dtype=np.float32)],
                         ids=["None", "float", "list", "ndarray"])
def test_non_tensor_input(which, bad):
    args = dict(zip("qkv", _qkv()))
    args[which] = bad
    with pytest.raises(TypeError, match=rf"^{which} must be a torch\.Tensor"):
        flash_attention_science(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_non_float_dtype(which, dtype):
    args = dict(zip("qkv", _qkv()))
    args[which] = (args[which] * 3).to(dtype)
    with pytest.raises(TypeError, match=rf"^{which} must be bfloat16, float16 or float32.*{dtype}"):
        flash_attention_science(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtypes", [
    (torch.float16, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.float32),
    (torch.float32, torch.float32, torch.float16),
    (torch.bfloat16, torch.float16, torch.bfloat16),
    (torch.float64, torch.float32, torch.float32),
], ids=lambda d: "-".join(dtype_id(x) for x in d))
def test_mixed_dtypes(dtypes):
    q, k, v = (t.to(dt) for t, dt in zip(_qkv(), dtypes))
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype"):
        flash_attention_science(q, k, v)


# --------------------------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("which,shape", [("q", (32,)), ("k", (32,)), ("v", (32,)), ("q", ())])
def test_fewer_than_two_dims(which, shape):
    args = dict(zip("qkv", make_qkv((9, 32), (11, 32))))
    args[which] = randn(*shape)
    with pytest.raises(ValueError, match=rf"^{which} must have at least 2 dims"):
        flash_attention_science(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("shapes", [
    ((2, 4, 9, 32), (4, 11, 32), (4, 11, 32)),
    ((4, 9, 32), (2, 4, 11, 32), (2, 4, 11, 32)),
    ((9, 32), (1, 11, 32), (1, 11, 32)),
    ((2, 4, 9, 32), (2, 4, 11, 32), (4, 11, 32)),
], ids=["q4-kv3", "q3-kv4", "q2-kv3", "v3"])
def test_different_number_of_dims(shapes):
    q, k, v = (randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=r"q, k and v must have the same number of dims"):
        flash_attention_science(q, k, v)


@pytest.mark.parametrize("q_batch,kv_batch", [((2,), (3,)), ((2, 3), (3, 2)), ((2, 3), (2, 1)), ((1,), (2,))],
                         ids=lambda x: str(x))
def test_mismatched_batch_dims(q_batch, kv_batch):
    q = randn(*q_batch, 4, 9, 32)
    k, v = randn(*kv_batch, 2, 11, 32), randn(*kv_batch, 2, 11, 32)
    with pytest.raises(ValueError, match=r"q and k must have the same batch dims"):
        flash_attention_science(q, k, v)


@pytest.mark.parametrize("dq,dk", [(32, 64), (64, 32), (16, 24)])
def test_qk_head_dim_mismatch(dq, dk):
    q, k, v = randn(2, 4, 9, dq), randn(2, 2, 11, dk), randn(2, 2, 11, dk)
    with pytest.raises(ValueError, match=r"k's head dim must equal q's"):
        flash_attention_science(q, k, v)


@pytest.mark.parametrize("v_shape", [(2, 2, 11, 64), (2, 2, 12, 32), (2, 1, 11, 32), (1, 2, 11, 32)],
                         ids=["D", "L", "H", "B"])
def test_kv_shape_mismatch(v_shape):
    q, k, v = randn(2, 4, 9, 32), randn(2, 2, 11, 32), randn(*v_shape)
    with pytest.raises(ValueError, match=r"^v must have k's shape"):
        flash_attention_science(q, k, v)


@pytest.mark.parametrize("hq,hkv", [(4, 3), (3, 2), (2, 4), (1, 2), (5, 0), (0, 0)], ids=lambda x: str(x))
def test_heads_not_a_multiple(hq, hkv):
    q, k, v = make_qkv((2, hq, 9, 32), (2, hkv, 11, 32))
    with pytest.raises(ValueError, match=r"q's head count .* must be a multiple of k's head count"):
        flash_attention_science(q, k, v)


@pytest.mark.parametrize("head_dim", [0, 257, 264, 512])
def test_unsupported_head_dims(head_dim):
    q, k, v = make_qkv((1, 2, 5, head_dim), (1, 2, 5, head_dim))
    with pytest.raises(ValueError, match=rf"head dim .* in \[1, 256\].*got {head_dim}"):
        flash_attention_science(q, k, v)
    with pytest.raises(ValueError, match=r"head dim"):
        describe_dispatch(q, k, v)


def test_every_supported_head_dim_is_accepted():
    for head_dim in range(1, 257):
        q, k, v = make_qkv((1, 1, 2, head_dim), (1, 1, 3, head_dim))
        assert describe_dispatch(q, k, v).backend == "reference"
        assert flash_attention_science(q, k, v).shape == q.shape


# --------------------------------------------------------------------------------------------------------------
# Devices, backends, scales


@pytest.mark.parametrize("which", ["k", "v", "q"])
def test_tensors_on_different_devices(which):
    args = dict(zip("qkv", _qkv()))
    other = "cuda" if torch.cuda.is_available() else "meta"
    args[which] = args[which].to(other) if other == "cuda" else torch.empty_like(args[which], device="meta")
    with pytest.raises(ValueError, match=r"q, k and v must be on one device"):
        flash_attention_science(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("backend", ["cuda", "Triton", "", "torch", None, 1])
def test_unknown_backend(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        flash_attention_science(q, k, v, backend=backend)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        describe_dispatch(q, k, v, backend=backend)


@pytest.mark.parametrize("scale", [0, 0.0, -1, -0.5, float("nan"), float("inf"), -float("inf")])
def test_bad_softmax_scale_value(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^softmax_scale must be finite and > 0"):
        flash_attention_science(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5), [0.5], 1j],
                         ids=["str", "bool", "tensor", "list", "complex"])
def test_bad_softmax_scale_type(scale):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number"):
        flash_attention_science(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [2, 0.25, np.float32(0.25), np.float64(0.25)], ids=["int", "float", "np32", "np64"])
def test_real_softmax_scales_accepted(scale):
    q, k, v = _qkv(torch.float64)
    out = flash_attention_science(q, k, v, softmax_scale=scale)
    expected = flash_attention_science(q, k, v, softmax_scale=float(scale))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_backend_on_cpu_needs_interpreter(no_interpreter, dtype):
    q, k, v = _qkv(dtype)
    with pytest.raises(ValueError, match=r"backend='triton'.*TRITON_INTERPRET=1"):
        flash_attention_science(q, k, v, backend="triton")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET"):
        describe_dispatch(q, k, v, backend="triton")


def test_triton_backend_on_cpu_needs_interpreter_env_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET"):
        flash_attention_science(q, k, v, backend="triton")


def test_triton_backend_rejects_float64(interpreter):
    q, k, v = _qkv(torch.float64)
    with pytest.raises(TypeError, match=r"backend='triton' supports bfloat16, float16 and float32"):
        flash_attention_science(q, k, v, backend="triton")


def _non_unit_last_stride(*shape):
    # every other element of a twice-as-wide buffer: stride 2 in the last dim
    t = randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    assert t.stride(-1) == 2
    return t


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_triton_non_unit_last_stride(interpreter, which):
    args = dict(zip("qkv", _qkv()))
    args[which] = _non_unit_last_stride(*args[which].shape)
    with pytest.raises(ValueError, match=rf"^{which} must have a contiguous last dim \(stride 1\)"):
        flash_attention_science(args["q"], args["k"], args["v"], backend="triton")
    # the reference accepts any strides
    out = flash_attention_science(args["q"], args["k"], args["v"], backend="reference")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("layout", ["2d", "3d", "5d", "5d-unmergeable"])
def test_triton_non_unit_last_stride_other_layouts(interpreter, layout):
    # The stride check must hold for every user layout, including 5-D inputs whose leading dims cannot merge
    # into one batch dim (the API then runs each leading index on its own).
    d, lq = 32, 9
    if layout == "2d":
        q = _non_unit_last_stride(lq, d)
    elif layout == "3d":
        q = _non_unit_last_stride(2, lq, d)
    elif layout == "5d":
        q = _non_unit_last_stride(2, 3, 2, lq, d)
    else:
        # (2, 3, 2, 9, 32) with leading dims swapped in memory AND the head dim strided
        q = randn(d, 3, 2, 2, lq).permute(2, 1, 3, 4, 0)
        assert q.stride(-1) != 1
        with pytest.raises(RuntimeError):
            q.view(-1, *q.shape[-3:])
    kv_shape = (*q.shape[:-2], 11, d)
    k, v = randn(*kv_shape), randn(*kv_shape)
    with pytest.raises(ValueError, match=r"^q must have a contiguous last dim \(stride 1\)"):
        flash_attention_science(q, k, v, backend="triton")


# --------------------------------------------------------------------------------------------------------------
# Empty inputs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_no_keys(backend, dtype, causal, interpreter):
    # Lk == 0: every query sees nothing -> zeros and lse -inf (the triton backend never launches a kernel)
    q, k, v = make_qkv((2, 4, 7, 32), (2, 2, 0, 32), dtype)
    out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype and torch.equal(out, torch.zeros_like(q))
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32 and torch.isneginf(lse).all()


@pytest.mark.parametrize("q_shape,kv_shape", [
    ((0, 32), (5, 32)),  # Lq = 0, 2-D
    ((4, 0, 32), (2, 5, 32)),  # Lq = 0, 3-D
    ((2, 4, 0, 32), (2, 2, 5, 32)),  # Lq = 0
    ((2, 4, 0, 32), (2, 2, 0, 32)),  # Lq = Lk = 0
    ((0, 4, 7, 32), (0, 2, 5, 32)),  # batch 0
    ((3, 0, 4, 7, 32), (3, 0, 2, 5, 32)),  # an empty leading dim of a 5-D input
    ((2, 0, 7, 32), (2, 2, 5, 32)),  # Hq = 0 (0 is a multiple of any Hkv): nothing to compute
    ((5, 32), (0, 32)),  # Lk = 0, 2-D
], ids=["lq0-2d", "lq0-3d", "lq0", "lq0-lk0", "b0", "5d-empty-lead", "hq0", "lk0-2d"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_empty_inputs(q_shape, kv_shape, backend, interpreter):
    q, k, v = make_qkv(q_shape, kv_shape, torch.float16)
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, torch.zeros_like(q))
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert torch.isneginf(lse).all()


def test_empty_inputs_are_differentiable():
    q, k, v = (t.requires_grad_() for t in make_qkv((2, 4, 7, 32), (2, 2, 0, 32), torch.float32))
    out = flash_attention_science(q, k, v, causal=True)
    (out * randn(*out.shape)).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape
    q, k, v = (t.requires_grad_() for t in make_qkv((2, 4, 0, 32), (2, 2, 5, 32), torch.float32))
    flash_attention_science(q, k, v).sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


def test_empty_bad_inputs_still_rejected():
    # empty tensors are checked like any other: no shortcut around the checks
    q, k, v = randn(2, 4, 0, 32), randn(2, 3, 0, 32), randn(2, 3, 0, 32)
    with pytest.raises(ValueError, match=r"head count"):
        flash_attention_science(q, k, v)
    q, k, v = randn(0, 4, 7, 264), randn(0, 2, 5, 264), randn(0, 2, 5, 264)
    with pytest.raises(ValueError, match=r"head dim"):
        flash_attention_science(q, k, v)


# --------------------------------------------------------------------------------------------------------------
# describe_dispatch


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_describe_dispatch_cpu_is_reference(dtype, causal, no_interpreter):
    q, k, v = _qkv(dtype)
    d = describe_dispatch(q, k, v, causal=causal)
    assert d.backend == "reference"
    assert "reference" in d.kernel
    assert isinstance(d.reason, str) and "cpu" in d.reason.lower()
    assert d.tiles is None


def test_describe_dispatch_reference_requested():
    q, k, v = _qkv()
    d = describe_dispatch(q, k, v, backend="reference")
    assert d.backend == "reference" and "requested" in d.reason


def test_describe_dispatch_triton_under_interpreter(interpreter):
    q, k, v = _qkv(torch.float16, d=40)
    d = describe_dispatch(q, k, v, causal=True, backend="triton")
    assert d.backend == "triton" and "interpreter" in d.reason.lower()
    assert isinstance(d.tiles, dict) and {"block_m", "block_n", "num_warps", "num_stages", "use_tma"} <= set(d.tiles)
    assert d.tiles["use_tma"] is False  # the interpreter uses the pointer path
    assert all(isinstance(d.tiles[key], int) and d.tiles[key] > 0 for key in ("block_m", "block_n"))
    assert math.log2(d.tiles["block_m"]).is_integer() and math.log2(d.tiles["block_n"]).is_integer()
    # auto still picks the reference for CPU tensors, interpreter or not
    assert describe_dispatch(q, k, v, causal=True).backend == "reference"


def test_describe_dispatch_checks_inputs():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"share one dtype"):
        describe_dispatch(q, k.half(), v)
    with pytest.raises(ValueError, match=r"head count"):
        describe_dispatch(q, randn(2, 3, 11, 32), randn(2, 3, 11, 32))


@pytest.mark.parametrize("flag", ["causal", "return_lse", "deterministic"])
@pytest.mark.parametrize("value", ["yes", None, 1])
def test_flags_must_be_bools(flag, value):
    q, k, v = make_qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float32)
    with pytest.raises(TypeError, match=f"^{flag} must be a bool"):
        flash_attention_science(q, k, v, **{flag: value})


def test_empty_inputs_lse_dtype_follows_the_reference():
    q = randn(1, 2, 5, 16, dtype=torch.float64)
    k = randn(1, 2, 0, 16, dtype=torch.float64)
    _, lse = flash_attention_science(q, k, k, return_lse=True)
    assert lse.dtype == torch.float64 and torch.isneginf(lse).all()
    _, lse32 = flash_attention_science(q.float(), k.float(), k.float(), return_lse=True)
    assert lse32.dtype == torch.float32
