"""The MoE forward's prepared launches on the CPU, up to the launch: what the compiled kernels would be handed.

A repeated inference call of one signature runs `layer.PreparedForward`: its launches (the sort's, one where
all pairs fit one chunk or else count, scan and scatter; then up and down) as PreparedLaunches with fresh buffers
per call. Stubs stand in for the JIT
kernels and their compiled kernels and record every launch; the prepared call must hand each compiled kernel
exactly what the JIT launch of the full path would.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("launchers are stubbed here; the interpreter runs the real kernels elsewhere", allow_module_level=True)

from flashmoe_science.moe import api, dispatch, execute, layer, triton_gemm  # noqa: E402
from flashmoe_science.moe.plan import plan_kernels  # noqa: E402
from flashmoe_science.moe.launch import Launch  # noqa: E402

KERNELS = [(dispatch, "_sort_one_chunk"), (dispatch, "_count_chunks"), (dispatch, "_scan_counts"),
           (dispatch, "_scatter_pairs"), (triton_gemm, "_up_swiglu_kernel"), (triton_gemm, "_down_combine_kernel")]


class _RecordingKernel:
    """A JIT kernel's stand-in: records `kernel[grid](*args, **meta)` launches and `warmup` (every parameter by
    name, as PreparedLaunch asks for it), which returns the compiled kernel's stand-in."""

    def __init__(self, arg_names, compiled):
        self.arg_names = arg_names
        self.launches, self.warmed = [], []
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch

    def warmup(self, *args, grid, **kwargs):
        assert args == ()
        self.warmed.append((grid, kwargs))
        return self.compiled


@pytest.fixture
def kernels(monkeypatch, fake_compiled_kernel):
    recording = []
    for module, name in KERNELS:
        kernel = _RecordingKernel(getattr(module, name).arg_names, fake_compiled_kernel())
        monkeypatch.setattr(module, name, kernel)
        recording.append(kernel)
    return recording


def _inputs(num_tokens, d_model, d_ff, num_experts, top_k, dtype, layout):
    x = torch.randn(num_tokens, d_model).to(dtype)
    if layout == "strided":  # column-major x, int32 ids taken from a wider tensor (a copy per call in flat_ids)
        x = x.T.contiguous().T
    w1 = torch.randn(num_experts, 2 * d_ff, d_model).to(dtype)
    w2 = torch.randn(num_experts, d_model, d_ff).to(dtype)
    weights32 = torch.rand(num_tokens, top_k)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    if layout == "strided":
        ids = torch.cat([ids, ids], dim=1).int()[:, :top_k]
    return x, w1, w2, weights32, ids


def _canonical(launches, inputs):
    """Each launch as (grid, arguments) with every tensor named by where it comes from: one of the call's inputs
    (a view of it counts as that input), or the n-th distinct buffer of the call (its shape, strides, dtype)."""
    buffers = {}
    out = []
    for grid, args in launches:
        canon = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                origin = next((name for name, t in inputs.items() if arg.data_ptr() == t.data_ptr()), None)
                if origin is None:
                    origin = buffers.setdefault(arg.data_ptr(), len(buffers))
                canon.append((origin, tuple(arg.shape), arg.stride(), arg.dtype))
            else:
                canon.append((type(arg), arg))  # True and 1 differ here
        out.append((tuple(grid), tuple(canon)))
    return out


def _jit_launches(kernels):
    """The full path's launches, arguments in each kernel's parameter order (constexprs included)."""
    launches = []
    for kernel in kernels:
        (grid, args, kwargs), = kernel.launches
        bound = dict(zip(kernel.arg_names, args))
        bound.update({name: value for name, value in kwargs.items() if name in kernel.arg_names})
        assert list(bound) == kernel.arg_names
        launches.append(((*grid, 1, 1)[:3], list(bound.values())))
    return launches


@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, dtype, layout", [
    (1, 64, 48, 8, 2, torch.bfloat16, "contiguous"),  # decode: one token, 16-row tiles, split-K in down
    (16, 128, 96, 128, 8, torch.float16, "contiguous"),  # Qwen3-like routing: E=128, k=8
    (40, 96, 64, 6, 3, torch.float32, "strided"),  # 3xTF32, column-major x, int32 ids that need a copy
    (80, 64, 48, 8, 2, torch.bfloat16, "contiguous"),  # 160 pairs: two chunks, the sort's three launches
])
def test_prepared_forward_repeats_the_jit_launches_on_new_tensors(kernels, num_tokens, d_model, d_ff, num_experts,
                                                                  top_k, dtype, layout):
    shape = (num_tokens, d_model, d_ff, num_experts, top_k, dtype, layout)
    prepared = layer.prepare_forward(*_inputs(*shape))
    one_chunk = num_tokens * top_k <= 128
    assert [bool(k.warmed) for k in kernels[:4]] == [one_chunk, *[not one_chunk] * 3]
    kernels = [k for k in kernels if k.warmed]
    for kernel in kernels:  # one compiled kernel per launch, warmed up with every parameter and the JIT's options
        (grid, bound), = kernel.warmed
        assert sorted(name for name in bound if name in kernel.arg_names) == sorted(kernel.arg_names)
        assert set(bound) - set(kernel.arg_names) <= {"num_warps", "num_stages"}

    new = _inputs(*shape)
    names = dict(zip(("x", "w1", "w2", "weights32", "topk_ids"), new))
    out = prepared(*new)
    assert out.shape == (num_tokens, d_model) and out.dtype == dtype
    prepared_runs = []
    for kernel in kernels:
        (run,) = kernel.compiled.runs
        assert run[3:9] == (1234, "function", "metadata", None, None, None)
        prepared_runs.append((run[:3], run[9:]))

    x, w1, w2, _, ids = new
    layer.moe_forward(*new, plan_kernels(x, w1, w2, ids.shape[1], prepared.tiles))
    assert _canonical(prepared_runs, names) == _canonical(_jit_launches(kernels), names)
    for kernel in kernels:  # the JIT launch's options are the prepared launch's
        (_, _, kwargs), = kernel.launches
        (_, bound), = kernel.warmed
        assert {k: v for k, v in kwargs.items() if k not in kernel.arg_names} == {
            k: v for k, v in bound.items() if k not in kernel.arg_names}


def test_prepared_forward_refuses_a_misaligned_input(kernels):
    shape = (4, 64, 48, 8, 2, torch.bfloat16, "contiguous")
    prepared = layer.prepare_forward(*_inputs(*shape))
    x, w1, w2, weights32, ids = _inputs(*shape)
    misaligned = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    with pytest.raises(ValueError, match="alignment"):
        prepared(misaligned, w1, w2, weights32, ids)


def test_launch_prepare_freezes_no_tensor(kernels):
    kernel = kernels[1]  # _count_chunks: (ids, chunk_counts, num_pairs, num_experts, CHUNK, E_POW2)
    ids, counts = torch.zeros(8, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int32)
    prepared = Launch(kernel, (1,), (ids, counts, 8, 4), dict(CHUNK=16, E_POW2=4)).prepare()
    assert prepared.frozen == (8, 4, 16, 4)
    assert not any(isinstance(arg, torch.Tensor) for arg in prepared.template)  # the first call's tensors not kept
    with pytest.raises(ValueError, match="frozen"):
        Launch(kernel, (1,), (ids, 8, counts, 4), dict(CHUNK=16, E_POW2=4)).prepare()


def test_prepared_keys_leave_autograd_and_ambiguous_arguments_to_the_full_path():
    x, w1, w2, weights, ids = _inputs(4, 32, 16, 8, 2, torch.float32, "contiguous")
    logits = torch.randn(4, 8)
    key = execute.moe_key(x, w1, w2, logits, 2, True, "softmax", "auto")
    assert key is not None and key == execute.moe_key(x.clone(), w1, w2, logits, 2, True, "softmax", "auto")
    assert key != execute.moe_key(x, w1, w2, logits, 3, True, "softmax", "auto")
    assert key != execute.moe_key(x.T.contiguous().T, w1, w2, logits, 2, True, "softmax", "auto")  # strides
    assert key != execute.moe_key(x, w1, w2, logits.double(), 2, True, "softmax", "auto")  # the routing's dtypes
    offset = torch.empty(x.numel() + 2)[2:].view(x.shape)  # 8 bytes off: Triton specialises on 16
    assert key != execute.moe_key(offset, w1, w2, logits, 2, True, "softmax", "auto")
    assert execute.moe_key(x, w1, w2, logits, True, True, "softmax", "auto") is None  # True == 1: the check must run
    assert execute.moe_key(x, w1, w2, logits, 2, 1, "softmax", "auto") is None
    assert execute.moe_key(x, w1, w2, logits, 2, True, "softmax", ["auto"]) is None
    assert execute.moe_key(x, w1, w2, logits.numpy(), 2, True, "softmax", "auto") is None
    grad_logits = logits.clone().requires_grad_()
    assert execute.moe_key(x, w1, w2, grad_logits, 2, True, "softmax", "auto") is None  # the router trains
    with torch.no_grad():
        assert execute.moe_key(x, w1, w2, grad_logits, 2, True, "softmax", "auto") is not None

    key = execute.experts_key(x, w1, w2, weights, ids, "auto")
    assert key is not None and key != execute.experts_key(x, w1, w2, weights, ids.int(), "auto")
    assert key != execute.experts_key(x, w1, w2, weights, ids, "triton")
    assert execute.experts_key(x, w1.clone().requires_grad_(), w2, weights, ids, "auto") is None
    assert execute.experts_key(x, w1, w2, weights, ids, None) is None


@pytest.mark.parametrize("entry", ["fused_moe", "fused_experts"])
def test_api_runs_a_remembered_signature_through_its_prepared_launches(kernels, monkeypatch, entry):
    """The API's side of it, on CPU tensors (remembering needs compiled kernels, so the cache is filled by hand
    here; tests/moe/test_moe_gpu.py covers the rest): an inference call skips autograd, and a call whose key is
    in `_PREPARED` runs its prepared launches, not the full path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets backend="triton" take CPU tensors; the kernels are stubs
    monkeypatch.setattr(execute.FusedExperts, "apply", None)  # inference never builds an autograd node
    monkeypatch.setattr(execute, "PREPARED", {})
    num_tokens, top_k, num_experts = 5, 2, 8
    # float16: under the interpreter bfloat16 CPU tensors are refused (device.check_interpreter_operands)
    x, w1, w2, _, _ = _inputs(num_tokens, 64, 48, num_experts, top_k, torch.float16, "contiguous")
    logits = torch.randn(num_tokens, num_experts)

    def call(x, logits):
        if entry == "fused_moe":
            return api.fused_moe(x, w1, w2, logits, top_k, backend="triton")
        return api.fused_experts(x, w1, w2, *api.moe_route(logits, top_k), backend="triton")

    with torch.no_grad():
        call(x, logits)
        assert [len(kernel.launches) for kernel in kernels] == [1, 0, 0, 0, 1, 1] and execute.PREPARED == {}
        weights, ids = api.moe_route(logits, top_k)
        key = (execute.moe_key(x, w1, w2, logits, top_k, True, "softmax", "triton") if entry == "fused_moe"
               else execute.experts_key(x, w1, w2, weights, ids, "triton"))
        prepared = layer.prepare_forward(x, w1, w2, weights, ids)
        execute.PREPARED[key] = (execute.RoutedForward(prepared, top_k, True, "softmax") if entry == "fused_moe"
                                 else prepared)
        monkeypatch.setattr(layer, "moe_forward", None)
        x2 = torch.randn_like(x)
        out = call(x2, torch.randn_like(logits))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert [len(kernel.compiled.runs) for kernel in kernels] == [1, 0, 0, 0, 1, 1]  # 10 pairs: one chunk
    up_args = kernels[4].compiled.runs[0][9:]
    assert up_args[0] is x2 and up_args[1] is w1
