"""The Triton forward and backward kernels with every feature (window, softcap, ALiBi, bias, varlen, odd head dims)
compiled offline for sm_90 without a GPU: the compiler takes paths the interpreter never does (constexpr None
pointers, early returns, the gap loops). The launchers are stubbed to record their arguments, which are then
compiled as the JIT would specialise them. Numerics: test_features_interpreter.py and test_features_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("compiles for sm_90; the interpreter runs the kernels elsewhere", allow_module_level=True)

from flashmoe_science.attention import bwd_prep  # noqa: E402
from flashmoe_science.attention.triton import bwd as triton_bwd, fwd as triton_fwd  # noqa: E402
from flashmoe_science.attention.features import CallFeatures, Varlen  # noqa: E402
from flashmoe_science.attention.mask import make_mask  # noqa: E402
from flashmoe_science.attention.tiles import backward_tiles, forward_tiles  # noqa: E402
from flashmoe_science.device import DeviceTraits  # noqa: E402

H200 = DeviceTraits((9, 0), 132, 232448)


class _Recorder:
    def __init__(self, kernel):
        self.kernel, self.arg_names, self.calls = kernel, kernel.arg_names, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
            self.calls.append((dict(zip(self.arg_names, args), **kwargs), options))

        return launch


def _compile(kernel, bound: dict, options: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    consts, signature, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = bound[name]
        if name in constexpr_names or value is None:
            signature[name] = "constexpr"
            consts[(i,)] = value
        else:
            signature[name] = mangle_type(value)
            if isinstance(value, torch.Tensor) or (isinstance(value, int) and not isinstance(value, bool)
                                                  and value % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


import triton  # noqa: E402


def _features(name, q, k):
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    if name == "window_softcap_alibi":
        return CallFeatures(make_mask(True, (64, -1), 2.0), alibi_slopes=torch.rand(b, h))
    if name == "bias":
        return CallFeatures(make_mask(False, (100, 3)), attn_bias=torch.randn(1, h, lq, lk))
    cu = torch.tensor([0, lq], dtype=torch.int32)
    return CallFeatures(make_mask(True), varlen=Varlen(cu, torch.tensor([0, lk], dtype=torch.int32), lq, lk))


@pytest.mark.parametrize("name,head_dim", [("window_softcap_alibi", 128), ("bias", 59), ("varlen", 59)])
def test_kernels_compile_for_sm90(monkeypatch, name, head_dim):
    dtype = torch.bfloat16
    q = torch.randn(1, 4, 256, head_dim).to(dtype)
    k = v = torch.randn(1, 2, 256, head_dim).to(dtype)
    features = _features(name, q, k)
    fwd = _Recorder(triton_fwd._attention_forward_kernel)
    monkeypatch.setattr(triton_fwd, "_attention_forward_kernel", fwd)
    tiles = forward_tiles(head_dim, dtype, True, H200)
    # TMA where the plan would take it (dense, 16-byte rows): the descriptors' compile path too
    use_tma = features.varlen is None and head_dim % 8 == 0
    tiles = type(tiles)(tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages, use_tma=use_tma)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 256)
    triton_fwd.attention_forward(q, k, v, out, lse, features, 0.1, tiles)
    dkdv, dq = _Recorder(triton_bwd._bwd_dkdv_kernel), _Recorder(triton_bwd._bwd_dq_kernel)
    monkeypatch.setattr(triton_bwd, "_bwd_dkdv_kernel", dkdv)
    monkeypatch.setattr(triton_bwd, "_bwd_dq_kernel", dq)
    monkeypatch.setattr(bwd_prep, "preprocess_kernel", _Recorder(bwd_prep.preprocess_kernel))
    dbias = torch.zeros(features.attn_bias.shape) if features.attn_bias is not None else None
    triton_bwd.attention_backward(q, k, v, out, lse, out, lse, torch.empty_like(q), torch.empty_like(k),
                                  torch.empty_like(v), features, 0.1, backward_tiles(head_dim, dtype, True, H200),
                                  dbias=dbias, dbias_atomic=False)
    for recorder, kernel in ((fwd, fwd.kernel), (dkdv, dkdv.kernel), (dq, dq.kernel)):
        (bound, options), = recorder.calls
        if bound["SOFTCAP"]:  # what the launcher passes for 16-bit CUDA tensors (these are CPU ones): tanh.approx
            bound["SOFTCAP"] = 2
        compiled = _compile(kernel, bound, options)
        assert compiled.asm.get("cubin"), kernel.fn.__name__
