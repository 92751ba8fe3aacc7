"""The GPU launchers' host code on the CPU, up to the launch: descriptors, boxes, grids and compile-time constants.

CI has no GPU, so without this the host side of the default Hopper path (TMA descriptors over the caller's strides,
register caps, tile constants) would first run on a GPU. A stub stands in for the compiled kernel and records the
launch it was given.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("launchers are stubbed here; the interpreter runs the real kernels elsewhere", allow_module_level=True)

from flashmoe_science.attention import layout  # noqa: E402
from flashmoe_science.attention.triton import fwd as triton_fwd  # noqa: E402
from flashmoe_science.attention.hopper.tiles import (  # noqa: E402
    SM90_THREE_CONSUMER_CAUSAL_LEN,
    SM90_PERSISTENT_LONG_CAUSAL_LEN,
    SM90_PERSISTENT_MAX_CAUSAL_LEN,
    SM90_PERSISTENT_MIN_ROUNDS,
    SM90_ITEM_SETUP_KEYS,
    SM90_SHORT_CAUSAL_LEN,
    sm90_band_schedule,
    sm90_bias_tiles,
    sm90_cross_item,
    sm90_cross_item_safe,
    sm90_forward_tiles,
    sm90_persistent,
    sm90_plan_length,
    sm90_q_buffers,
    sm90_smem_bytes,
)
from flashmoe_science.attention.mask import make_mask  # noqa: E402
from sm90_helpers import hopper_forward_plan  # noqa: E402
from flashmoe_science.attention.tiles import AttentionTiles, backward_tiles, padded_head_dim  # noqa: E402
from flashmoe_science.device import DeviceTraits  # noqa: E402

H200 = DeviceTraits((9, 0), 132, 232448)


class _RecordingKernel:
    arg_names = triton_fwd._attention_forward_kernel.arg_names

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


def _blhd(b, h, length, d, dtype=torch.bfloat16):
    # (B, L, H, D) storage seen as (B, H, L, D): the no-copy transposed layout
    return torch.randn(b, length, h, d).to(dtype).transpose(1, 2)


def test_triton_launcher_builds_tma_descriptors_over_the_callers_strides(monkeypatch):
    kernel = _RecordingKernel()
    monkeypatch.setattr(triton_fwd, "_attention_forward_kernel", kernel)
    q, k, v = _blhd(2, 4, 100, 80), _blhd(2, 2, 90, 80), _blhd(2, 2, 90, 80)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    assert layout.tma_compatible(q, k, v, out)
    triton_fwd.attention_forward(q, k, v, out, lse, True, 0.1, AttentionTiles(64, 128, 4, 2, use_tma=True))

    (grid, args, kwargs), = kernel.launches
    assert grid == (2, 8)  # cdiv(100, 64) query tiles x B*Hq
    q_desc, k_desc = kwargs["Q"], kwargs["K"]
    assert q_desc.base is q and q_desc.shape == [2, 4, 100, 80] and q_desc.strides == list(q.stride())
    assert q_desc.block_shape == [1, 1, 64, 128] and k_desc.block_shape == [1, 1, 128, 128]
    assert kwargs["HEAD_DIM"] == 80 and kwargs["BLOCK_D"] == 128 and kwargs["USE_TMA"] and kwargs["MASK_RIGHT"]
    assert kwargs["window_right"] == 0 and not kwargs["MASK_LEFT"] and not kwargs["VARLEN"]
    assert kwargs["group_size"] == 2 and kwargs["qk_scale"] == pytest.approx(0.1 * 1.4426950408889634)
    assert kwargs["DOT_PRECISION"] == "tf32" and (kwargs["num_warps"], kwargs["num_stages"]) == (4, 2)


def test_tma_box_gives_size_one_dims_an_aligned_stride():
    # one head, one batch: their strides are never stepped over, but TMA still wants them 16-byte aligned
    t = torch.randn(1, 1, 33, 24)[:, :, :, :].as_strided((1, 1, 33, 24), (7, 5, 24, 1))
    box = layout.tma_box(t, 16, 32)
    assert box["strides"] == [33 * 24, 33 * 24, 24, 1] and box["block_shape"] == [1, 1, 16, 32]


def test_tma_compatible_rejects_misaligned_strides_and_bases():
    base = torch.randn(4, 4, 64, 64, dtype=torch.bfloat16)
    assert layout.tma_compatible(base)
    assert not layout.tma_compatible(base[..., 1:])  # base address off by 2 bytes
    assert not layout.tma_compatible(torch.randn(2, 2, 8, 12, dtype=torch.bfloat16)[..., :8])  # 24-byte rows
    assert not layout.tma_compatible(base.transpose(-1, -2))  # last stride not 1


def test_fp32_launch_asks_for_3xtf32(monkeypatch):
    kernel = _RecordingKernel()
    monkeypatch.setattr(triton_fwd, "_attention_forward_kernel", kernel)
    q = torch.randn(1, 2, 40, 32)
    triton_fwd.attention_forward(q, q, q, torch.empty_like(q), torch.empty(1, 2, 40), False, 0.2,
                                 AttentionTiles(64, 64, 4, 2))
    assert kernel.launches[0][2]["DOT_PRECISION"] == "tf32x3"


def test_sm90_cross_item_refuses_a_deadlocking_ring(monkeypatch):
    """Overlapping work items with causal masking needs three ring stages, and always two Q buffers: the output is
    staged in the current item's Q buffer while the next item's Q·Kᵀ runs (see fwd_sm90._attention_consumer)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90

    kernel = _RecordingKernel()
    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90_kernel", kernel)
    q = _blhd(2, 8, 300, 64)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    two, three = AttentionTiles(128, 64, 8, 2, use_tma=True), AttentionTiles(128, 64, 8, 3, use_tma=True)
    with pytest.raises(ValueError, match="cross_item"):
        fwd_sm90.attention_forward_sm90(q, q, q, out, lse, True, 0.125, two, num_ctas=132, q_buffers=2,
                                        cross_item=True)
    with pytest.raises(ValueError, match="two Q buffers"):
        fwd_sm90.attention_forward_sm90(q, q, q, out, lse, False, 0.125, two, num_ctas=132, cross_item=True)
    fwd_sm90.attention_forward_sm90(q, q, q, out, lse, True, 0.125, three, num_ctas=132, q_buffers=2,
                                    cross_item=True)
    fwd_sm90.attention_forward_sm90(q, q, q, out, lse, False, 0.125, two, num_ctas=132, q_buffers=2,
                                    cross_item=True)
    assert [launch[2]["CROSS_ITEM"] for launch in kernel.launches] == [True, True]


def _recording_warmup_kernel(arg_names, compiled_class):
    compiled = compiled_class()

    class Kernel(_RecordingKernel):
        def warmup(self, *args, grid, **kwargs):
            assert args == ()  # every parameter by name
            self.warmed = (grid, kwargs)
            return compiled

    kernel = Kernel()
    kernel.arg_names = arg_names
    return kernel, compiled


def _assert_prepared_launch_matches(kernel, compiled, prepared, new_tensors, descriptor_names, options):
    """The prepared launch hands the compiled kernel the new tensors (or descriptors over them, with the prepared
    boxes), then every other parameter of the prepared call in the kernel's parameter order."""
    grid, bound = kernel.warmed
    for name, value in options.items():
        assert bound.pop(name) == value
    names = kernel.arg_names
    assert sorted(bound) == sorted(names)  # every parameter, once
    prepared(*new_tensors)
    (run,) = compiled.runs
    assert run[:9] == ((*grid, 1, 1)[:3] + (1234, "function", "metadata", None, None, None))
    launched = run[9:]
    for name, arg, t in zip(names, launched, new_tensors):
        if name in descriptor_names:
            old = bound[name]
            assert arg.base is t and arg.block_shape == old.block_shape and arg.strides == old.strides
            assert getattr(arg, "layout", None) is getattr(old, "layout", None)
        else:
            assert arg is t
    assert launched[len(new_tensors):] == tuple(bound[name] for name in names[len(new_tensors):])


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_prepared_launch_repeats_the_jit_launch_on_new_tensors(monkeypatch, fake_compiled_kernel, causal):
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.gluon.sm90 import launch_options

    kernel, compiled = _recording_warmup_kernel(fwd_sm90.attention_forward_sm90_kernel.arg_names,
                                                fake_compiled_kernel)
    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90_kernel", kernel)
    q, k, v = _blhd(2, 8, 300, 64), _blhd(2, 2, 257, 64), _blhd(2, 2, 257, 64)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    tiles = sm90_forward_tiles(64, causal, 300)
    prepared = fwd_sm90.prepare_forward(q, k, v, out, lse, causal, 0.125, tiles, 132, 2, not causal)
    q2, k2, v2 = _blhd(2, 8, 300, 64), _blhd(2, 2, 257, 64), _blhd(2, 2, 257, 64)
    new = (q2, k2, v2, torch.empty_like(q2), torch.empty(2, 8, 300))
    # D=64: three consumer warpgroups with 128-key tiles (non-causal), two with short causal rows' 64-key tiles
    assert fwd_sm90.num_consumers(tiles) == (2 if causal else 3)
    _assert_prepared_launch_matches(kernel, compiled, prepared, new, {"q_desc", "k_desc", "v_desc", "o_desc"},
                                    launch_options(fwd_sm90.num_consumers(tiles)))

    misaligned = torch.empty(q2.numel() + 1, dtype=q2.dtype)[1:].view(q2.shape)
    with pytest.raises(ValueError, match="alignment"):
        prepared(q2, k2, v2, misaligned, new[4])


@pytest.mark.parametrize("use_tma", [False, True])
def test_triton_prepared_launch_repeats_the_jit_launch_on_new_tensors(monkeypatch, fake_compiled_kernel, use_tma):
    kernel, compiled = _recording_warmup_kernel(triton_fwd._attention_forward_kernel.arg_names, fake_compiled_kernel)
    monkeypatch.setattr(triton_fwd, "_attention_forward_kernel", kernel)
    q, k, v = _blhd(2, 4, 100, 80), _blhd(2, 2, 90, 80), _blhd(2, 2, 90, 80)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    tiles = AttentionTiles(64, 32, 4, 3, use_tma=use_tma)
    prepared = triton_fwd.prepare_forward(q, k, v, out, lse, True, 0.1, tiles)
    assert kernel.warmed[0] == (2, 8) and kernel.warmed[1]["USE_TMA"] is use_tma
    q2, k2, v2 = _blhd(2, 4, 100, 80), _blhd(2, 2, 90, 80), _blhd(2, 2, 90, 80)
    new = (q2, k2, v2, torch.empty_like(q2), torch.empty(2, 4, 100))
    _assert_prepared_launch_matches(kernel, compiled, prepared, new, {"Q", "K", "V", "O"} if use_tma else set(),
                                    {"num_warps": 4, "num_stages": 3})


def test_sm90_backward_stages_row_statistics_where_tma_can_read_them():
    """lse and Δ go through shared memory at head dims padding to 128 on dense batches whose per-head rows start
    16-byte aligned and on packed batches (through padded copies); D=64, other masks, other dense lengths and a
    misaligned lse read them from global memory."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import bwd_sm90
    from flashmoe_science.attention.hopper.tiles import sm90_backward_staged_stats

    assert sm90_backward_staged_stats(128, 4096, False) and sm90_backward_staged_stats(96, 300, False)
    assert not sm90_backward_staged_stats(64, 4096, False)
    assert not sm90_backward_staged_stats(128, 1001, False)
    assert sm90_backward_staged_stats(128, 4096, True) and sm90_backward_staged_stats(128, 1001, True)
    assert not sm90_backward_staged_stats(64, 1001, True) and not sm90_backward_staged_stats(128, 1001, True, False)
    assert not sm90_backward_staged_stats(128, 4096, True, causal=True)  # packed causal: measured slower
    assert sm90_backward_staged_stats(128, 4096, False, causal=True)

    def staged(length, lse_offset=0):
        q, k, v = _blhd(1, 2, length, 128), _blhd(1, 2, 200, 128), _blhd(1, 2, 200, 128)
        lse = torch.empty(2 * length + lse_offset)[lse_offset:].view(1, 2, length)
        grad = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        dq_accum = torch.empty(2, length, 128)
        launch = bwd_sm90._one_pass_launches(q, k, v, torch.empty_like(q), lse, torch.empty_like(q),
                                             torch.empty_like(lse), *grad, dq_accum, False, 0.1, None)
        return launch["dkdv_dq"][2]["STAGED_STATS"]

    assert staged(256) and not staged(255) and not staged(256, lse_offset=1)


@pytest.mark.parametrize("head_dim, consumers, rotation", [(32, 3, True), (64, 3, True), (64, 2, True),
                                                            (128, 2, False), (256, 2, False)])
def test_sm90_forward_issues_in_rotation_at_head_dims_to_64(head_dim, consumers, rotation):
    """The sm_90 forward's consumers take turns to issue their products (and rescale O after P·V) at head dims
    padding to <= 64, on two consumers or three; wider heads and e4m3 inputs leave the order to the hardware."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.attention.hopper.tiles import sm90_forward_pingpong

    q = torch.empty(1, 2, 256, head_dim, dtype=torch.bfloat16, device="meta")
    tiles = AttentionTiles(64 * consumers, 128 if head_dim <= 128 else 64, 4 * consumers, 2, use_tma=True)
    _, _, constexprs = fwd_sm90._launch_args(q, q, q, torch.empty_like(q), torch.empty(1, 2, 256, device="meta"),
                                             False, 0.1, tiles, 132, 1, False)
    assert constexprs["PINGPONG"] is rotation and constexprs["NUM_CONSUMERS"] == consumers
    assert not sm90_forward_pingpong(head_dim, fp8=True)


@pytest.mark.parametrize("head_dim, skip", [(64, False), (128, False), (160, True), (256, True)])
def test_sm90_forward_skips_unneeded_rescales_at_head_dims_padding_to_256(head_dim, skip):
    """The sm_90 forward's warps branch past O's rescale where no row's max moved, at head dims padding to 256 only;
    e4m3 inputs multiply every tile."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.attention.hopper.tiles import sm90_forward_skip_rescale

    q = torch.empty(1, 2, 256, head_dim, dtype=torch.bfloat16, device="meta")
    tiles = AttentionTiles(128, 128 if head_dim <= 128 else 64, 8, 2, use_tma=True)
    _, _, constexprs = fwd_sm90._launch_args(q, q, q, torch.empty_like(q), torch.empty(1, 2, 256, device="meta"),
                                             False, 0.1, tiles, 132, 1, False)
    assert constexprs["SKIP_RESCALE"] is skip
    assert not sm90_forward_skip_rescale(head_dim, fp8=True)


def _record_backward_launches(monkeypatch, compiled_class, preprocess: str) -> dict:
    """The sm_90 one pass's three kernels (the preprocess named `preprocess` in bwd_prep, the main kernel, the dQ
    conversion) replaced by recording kernels, in launch order: {name: (kernel, compiled)}."""
    from flashmoe_science.attention import bwd_prep
    from flashmoe_science.attention.hopper import bwd_sm90

    kernels = {}
    for module, name in ((bwd_prep, preprocess), (bwd_sm90, "attention_backward_sm90_kernel"),
                         (bwd_prep, "dq_convert_kernel")):
        kernels[name] = _recording_warmup_kernel(getattr(module, name).arg_names, compiled_class)
        monkeypatch.setattr(module, name, kernels[name][0])
    return kernels


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_sm90_prepared_backward_rebases_the_first_calls_descriptors(monkeypatch, fake_compiled_kernel, head_dim):
    """bwd_sm90.PreparedBackward's three launches on new tensors: each per-call tensor as given, each TMA descriptor
    the one a direct launch would build over the new tensor (same fields, new base), the frozen parameters as
    bound; none of the first call's tensors kept."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import bwd_sm90

    kernels = _record_backward_launches(monkeypatch, fake_compiled_kernel, "preprocess_kernel")

    def tensors():
        q, k, v = _blhd(2, 4, 300, head_dim), _blhd(2, 2, 257, head_dim), _blhd(2, 2, 257, head_dim)
        lse = torch.empty(2, 4, 300)
        return (q, k, v, torch.empty_like(q), lse, _blhd(2, 4, 300, head_dim), torch.empty_like(lse),
                torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))

    first = tensors()
    prepared = bwd_sm90.PreparedBackward(*first, True, 0.125)
    new = tensors()
    prepared(*new)
    q, k, v, out, lse, grad_out, delta, dq, dk, dv = new
    (pre,), (main,), (convert,) = (kernels[name][1].runs for name in kernels)
    dq_accum = pre[12]  # the preprocess zeroes the workspace the main kernel adds into
    assert dq_accum.shape == (2 * 4, 300, padded_head_dim(head_dim)) and dq_accum.dtype == torch.float32
    assert all(a is b for a, b in zip(pre[9:13], (out, grad_out, delta, dq_accum)))
    assert convert[9] is dq_accum and convert[10] is dq
    rows = bwd_sm90.sm90_backward_rows(head_dim, False, bwd_sm90.NUM_STAGES)
    staged = bwd_sm90.sm90_backward_staged_stats(head_dim, 300, False)  # lse and Δ as descriptors at D=128
    expected = bwd_sm90._one_pass_tensor_args(padded_head_dim(head_dim), rows, q, grad_out, k, v, dq_accum, lse,
                                              delta, dk, dv, staged)
    for got, want in zip(main[9:18], expected):
        if isinstance(want, torch.Tensor):
            assert got is want
        else:
            fields = {name: value for name, value in vars(want).items() if name != "base"}
            assert type(got) is type(want) and got.base.data_ptr() == want.base.data_ptr()
            assert got.base.shape == want.base.shape and got.base.stride() == want.base.stride()
            assert {name: value for name, value in vars(got).items() if name != "base"} == fields
    for launch, _ in prepared.launches:
        assert not any(isinstance(arg, torch.Tensor) for arg in launch.template)
        assert all(arg is None or not hasattr(arg, "base") for arg in launch.template)


def _packed_features(lengths, causal=True):
    from flashmoe_science.attention.features import CallFeatures, Varlen

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return CallFeatures(mask=make_mask(causal, None, None), varlen=Varlen(cu, cu, max(lengths), max(lengths)))


def _packed_tensors(total, head_dim):
    q, k, v = _blhd(1, 4, total, head_dim), _blhd(1, 2, total, head_dim), _blhd(1, 2, total, head_dim)
    lse = torch.empty(1, 4, total)
    return (q, k, v, torch.empty_like(q), lse, _blhd(1, 4, total, head_dim), torch.empty_like(lse),
            torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))


@pytest.fixture
def host_work_lists(monkeypatch):
    """Work lists of the right shape on CPU tensors (their Triton kernels run on a GPU or under the interpreter;
    these tests check what the launches bind, not the lists' contents)."""
    from flashmoe_science.attention import seqlen

    monkeypatch.setattr(seqlen, "varlen_work_list",
                        lambda cu, block, slots: torch.zeros(1 + 4 * slots, dtype=torch.int32, device=cu.device))


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_packed_backward_stages_padded_statistics(deterministic, host_work_lists):
    """A packed D=128 call: the preprocess writes lse and Δ into padded copies (seqlen.padded_stat_rows rows per
    head), the main kernel reads them by TMA with that row count, and the deterministic counters share the layout;
    at D=64, with a window and under a causal mask the packed call keeps the forward's lse. A mismatched `padded`
    is refused."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention import bwd_prep
    from flashmoe_science.attention.features import CallFeatures
    from flashmoe_science.attention.hopper import bwd_sm90
    from flashmoe_science.attention.seqlen import padded_stat_rows

    lengths = (5, 0, 130, 1, 64)
    features = _packed_features(lengths, causal=False)
    tensors = _packed_tensors(sum(lengths), 128)
    q, k, v, out, lse, grad_out, delta, dq, dk, dv = tensors
    padded = bwd_sm90.padded_stats(q, lse, delta, features)
    rows = padded_stat_rows(200, 5)
    assert rows == 216 and all(t.shape == (1, 4, rows) and t.is_contiguous() for t in padded)
    semaphores = torch.empty(bwd_sm90._row_stats_shape(lse, padded), dtype=torch.int32) if deterministic else None
    dq_accum = torch.empty(1, 4, 200, 128)
    launches = bwd_sm90._one_pass_launches(*tensors, dq_accum, features, 0.1, None, semaphores=semaphores,
                                           padded=padded)
    kernel, grid, bound, _, heads = launches["preprocess"]
    assert kernel is bwd_prep.padded_stats_kernel and grid == (-(-rows // 64), 4)
    assert bound["LSE"] is lse and bound["LSE_PADDED"] is padded[0] and bound["DELTA_PADDED"] is padded[1]
    assert bound["CU_SEQLENS"] is features.varlen.cu_seqlens_q and bound["padded_rows"] == rows
    per_call = (out, grad_out, lse, *padded, dq_accum, features.varlen.cu_seqlens_q) + (
        (semaphores,) if deterministic else ())  # the leading parameters, by heads' names
    assert len(heads) == len(per_call) and all(bound[n] is t for n, t in zip(kernel.arg_names, per_call))
    assert bound["SEMAPHORES"] is semaphores and bound["ZERO_SEMAPHORES"] == deterministic
    main, _, main_bound, _, main_heads = launches["dkdv_dq"]
    assert main_bound["STAGED_STATS"] and main_bound["lse_rows"] == rows
    assert main_bound["LSE"].base is padded[0] and main_bound["Delta"].base is padded[1]
    assert main_heads[5:7] == bwd_sm90.PADDED_STATS
    if deterministic:
        assert main_bound["Semaphores"].shape == (1, 4, rows)
    with pytest.raises(ValueError, match="padded"):
        bwd_sm90._one_pass_launches(*tensors, dq_accum, features, 0.1, None, semaphores=semaphores)
    small = _packed_tensors(200, 64)
    window = CallFeatures(mask=make_mask(False, (30, 30), None), varlen=features.varlen)
    assert bwd_sm90.padded_stats(small[0], small[4], small[6], features) is None
    assert bwd_sm90.padded_stats(q, lse, delta, window) is None
    assert bwd_sm90.padded_stats(q, lse, delta, _packed_features(lengths, causal=True)) is None
    assert bwd_sm90.padded_stats(_blhd(2, 4, 256, 128), lse, delta, True) is None  # dense: lse as it is


def test_sm90_prepared_packed_backward_allocates_its_padded_statistics_per_call(monkeypatch, fake_compiled_kernel,
                                                                                host_work_lists):
    """PreparedBackward on a packed D=128 call: the preprocess and the main kernel get fresh padded statistics each
    call (the same two tensors), and the new call's cu_seqlens."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention import bwd_prep
    from flashmoe_science.attention.hopper import bwd_sm90

    kernels = _record_backward_launches(monkeypatch, fake_compiled_kernel, "padded_stats_kernel")
    lengths = (70, 3, 127)
    features = _packed_features(lengths, causal=False)
    prepared = bwd_sm90.PreparedBackward(*_packed_tensors(200, 128), features, 0.125, deterministic=True)
    new_features = _packed_features(lengths, causal=False)
    new = _packed_tensors(200, 128)
    prepared(*new, *bwd_sm90.varlen_tensors(new_features, 200))
    (pre,), (main,), _ = (kernels[name][1].runs for name in kernels)
    names = bwd_prep.padded_stats_kernel.arg_names
    pre = dict(zip(names, pre[9:]))
    assert pre["O"] is new[3] and pre["LSE"] is new[4] and pre["CU_SEQLENS"] is new_features.varlen.cu_seqlens_q
    lse_padded, delta_padded = pre["LSE_PADDED"], pre["DELTA_PADDED"]
    assert lse_padded.shape == delta_padded.shape == (1, 4, 212)  # padded_stat_rows(200, 3)
    main = dict(zip(bwd_sm90.attention_backward_sm90_kernel.arg_names, main[9:]))
    assert main["LSE"].base is lse_padded and main["Delta"].base is delta_padded
    assert main["Semaphores"] is pre["SEMAPHORES"] and main["Semaphores"].shape == (1, 4, 212)
    assert main["CuSeqlensQ"] is new_features.varlen.cu_seqlens_q


def test_prepared_key_keys_gradients_apart_and_leaves_ambiguous_arguments_to_the_full_path():
    from flashmoe_science.attention import call

    q = torch.randn(1, 2, 8, 16)
    key = call.prepared_key(q, q, q, False, None, False, "auto", False)
    assert key is not None and key == call.prepared_key(q.clone(), q, q, False, None, False, "auto", False)
    assert key != call.prepared_key(q, q, q, True, None, False, "auto", False)
    assert key != call.prepared_key(q.transpose(2, 3).contiguous().transpose(2, 3), q, q, False, None, False,
                                    "auto", False)  # strides
    assert call.prepared_key(q, q, q, 1, None, False, "auto", False) is None  # 1 == True: the check must run
    assert call.prepared_key(q, q, q, False, 1, False, "auto", False) is None
    assert call.prepared_key(q, q, q, False, None, False, ["auto"], False) is None
    grad = q.clone().requires_grad_()
    recorded = call.prepared_key(grad, q, q, False, None, False, "auto", False)
    assert recorded is not None and recorded != key and recorded[-1] is False  # its backward: not deterministic
    assert call.prepared_key(q, grad, q, False, None, False, "auto", True)[-1] is True
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:  # the backward's determinism, asked for globally, is part of a gradient-recording key only
        assert call.prepared_key(grad, q, q, False, None, False, "auto", False)[-1] is True
        assert call.prepared_key(q, q, q, False, None, False, "auto", False) == key
    finally:
        torch.use_deterministic_algorithms(previous)
    with torch.no_grad():
        assert call.prepared_key(grad, q, q, False, None, False, "auto", False) == key
    cu = torch.tensor([0, 8], dtype=torch.int32)  # packed calls: the cu_seqlens' signatures and the max lengths
    packed = call.packed_key(q, q, q, cu, cu, 8, 8, False, None, False, "auto", False)
    recording_packed = call.packed_key(grad, q, q, cu, cu, 8, 8, False, None, False, "auto", False)
    assert packed is not None and recording_packed is not None and packed != recording_packed
    assert packed == call.packed_key(q, q, q, cu.clone(), cu, 8, 8, False, None, False, "auto", False)  # not values
    assert packed != call.packed_key(q, q, q, cu, cu, 9, 8, False, None, False, "auto", False)
    assert call.packed_key(q, q, q, cu, cu, 8, True, False, None, False, "auto", False) is None  # True == 1


@pytest.mark.parametrize("head_dim,causal", [(80, True), (128, False), (192, True), (256, False)])
def test_sm90_launcher(monkeypatch, head_dim, causal):
    gluon = pytest.importorskip("triton.experimental.gluon")
    assert gluon
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.gluon.sm90 import REGISTER_CAP

    kernel = _RecordingKernel()
    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90_kernel", kernel)
    q, k, v = _blhd(2, 8, 300, head_dim), _blhd(2, 2, 257, head_dim), _blhd(2, 2, 257, head_dim)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 300)
    tiles = sm90_forward_tiles(head_dim, causal, 300)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, head_dim**-0.5, tiles, num_ctas=132)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, head_dim**-0.5, tiles, num_ctas=20)
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, head_dim**-0.5, tiles, q_buffers=2)

    (grid, args, kwargs), (grid_20, args_20, _), (grid_all, _, kwargs_all) = kernel.launches
    assert kwargs["Q_BUFFERS"] == 1 and kwargs_all["Q_BUFFERS"] == 2
    # cdiv(300, 128) query tiles x B*Hq = 48 work items over at most num_ctas CTAs; None: one CTA per item
    assert grid == (48,) and grid_20 == (20,) and grid_all == (48,)
    work = slice(10, 12)  # num_m_tiles, num_work (the mask, ALiBi and varlen arguments follow: None here)
    assert args[work] == args_20[work] == (3, 48)
    assert all(a is None for a in args[12:])
    q_desc, k_desc, v_desc, o_desc = args[:4]
    block_d = 128 if head_dim <= 128 else 256
    assert q_desc.block_shape == o_desc.block_shape == [1, 1, fwd_sm90.CONSUMER_ROWS, block_d]
    assert k_desc.block_shape == v_desc.block_shape == [1, 1, tiles.block_n, block_d]
    assert q_desc.layout.swizzle_byte_width == 128 and q_desc.strides == list(q.stride())
    # the output is staged in a Q buffer: same box layout; its box is clipped at out's own shape (Lq, head_dim)
    assert o_desc.layout == q_desc.layout and o_desc.base is out and o_desc.shape == list(out.shape)
    assert args[4] is lse and args[5:7] == (8, 4)  # heads, GQA group
    assert kwargs["maxnreg"] == REGISTER_CAP == 168 and kwargs["num_warps"] == 4
    assert (kwargs["BLOCK_D"], kwargs["CAUSAL"]) == (block_d, causal)
    # shared memory: 2 Q boxes + NUM_STAGES K and V boxes fit the H200's 227 KiB
    box = lambda rows: rows * block_d * 2  # noqa: E731
    assert 2 * box(64) + kwargs["NUM_STAGES"] * 2 * box(tiles.block_n) <= 232448 - 2048


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [512, 2048, 8192])
def test_sm90_q_buffers_only_where_persistent_and_they_fit(head_dim, causal, seqlen_q):
    tiles = sm90_forward_tiles(head_dim, causal, seqlen_q)
    persistent = sm90_persistent(causal, seqlen_q, 4096, 132)
    n = sm90_q_buffers(tiles, head_dim, persistent, H200)
    assert sm90_smem_bytes(tiles, head_dim, n) <= H200.smem_per_block
    # a second buffer whenever it fits a persistent CTA; never for one CTA per tile (a CTA runs one item)
    fits = sm90_smem_bytes(tiles, head_dim, 2) <= H200.smem_per_block
    assert n == (2 if persistent and fits else 1)
    assert sm90_q_buffers(tiles, head_dim, False, H200) == 1


def test_sm90_q_buffers_where_measured():
    # D=128: two buffers with the non-causal and the short causal rings; the 128-key 3-stage causal ring leaves no room
    assert sm90_q_buffers(sm90_forward_tiles(128, False, 512), 128, True, H200) == 2
    assert sm90_q_buffers(sm90_forward_tiles(128, True, 512), 128, True, H200) == 2
    assert sm90_q_buffers(sm90_forward_tiles(128, True, 2048), 128, True, H200) == 1
    assert sm90_q_buffers(sm90_forward_tiles(256, False, 2048), 256, True, H200) == 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [512, 4096])
@pytest.mark.parametrize("bias_bytes", [2, 4])
def test_sm90_bias_tiles_fit_the_shared_memory(head_dim, causal, seqlen_q, bias_bytes):
    """The bias ring beside K/V: the plan's tiles where they fit, else two stages, then 64-key tiles; None (the
    consumers load the bias) only where even those do not fit."""
    tiles = sm90_forward_tiles(head_dim, causal, seqlen_q)
    fitted = sm90_bias_tiles(tiles, head_dim, bias_bytes, H200)
    if fitted is None:
        smallest = AttentionTiles(tiles.block_m, 64, tiles.num_warps, 2, use_tma=True)
        assert sm90_smem_bytes(smallest, head_dim, 1, bias_bytes=bias_bytes) > H200.smem_per_block
        return
    assert sm90_smem_bytes(fitted, head_dim, 1, bias_bytes=bias_bytes) <= H200.smem_per_block
    assert fitted.block_n <= tiles.block_n and fitted.num_stages <= tiles.num_stages and fitted.num_stages >= 2
    if sm90_smem_bytes(tiles, head_dim, 1, bias_bytes=bias_bytes) <= H200.smem_per_block:
        assert fitted == tiles
    n = sm90_q_buffers(fitted, head_dim, True, H200, bias_bytes)
    assert sm90_smem_bytes(fitted, head_dim, n, bias_bytes=bias_bytes) <= H200.smem_per_block


def test_sm90_bias_tiles_where_they_change():
    # D=128 causal at 4k: the three-stage ring gives up a stage for a bf16 bias, 128-key tiles for a float32 one
    causal = sm90_forward_tiles(128, True, 4096)
    assert sm90_bias_tiles(causal, 128, 2, H200) == AttentionTiles(128, 128, 8, 2, use_tma=True)
    assert sm90_bias_tiles(causal, 128, 4, H200) == AttentionTiles(128, 64, 8, 2, use_tma=True)
    # D=256: a bf16 bias fits beside the 64-key ring, a float32 one does not
    wide = sm90_forward_tiles(256, False, 4096)
    assert sm90_bias_tiles(wide, 256, 2, H200) == wide and sm90_bias_tiles(wide, 256, 4, H200) is None


def test_bias_tma_view_steps_over_broadcast_dims():
    """A batch or head dim the bias broadcasts over (size 1, or stride 0 after expand) is a size-1 dim of the view
    with coordinate step 0; a bias broadcast over queries or keys, or with rows not 16-byte aligned, has none."""
    plane = torch.empty(1, 4, 300, 512, dtype=torch.bfloat16)
    view, step_b, step_h = layout.bias_tma_view(plane.expand(2, 4, 300, 512), 300, 512)
    assert view.shape == (1, 4, 300, 512) and view.data_ptr() == plane.data_ptr() and (step_b, step_h) == (0, 1)
    heads = torch.empty(2, 1, 300, 512, dtype=torch.bfloat16).expand(2, 4, 300, 512)
    assert layout.bias_tma_view(heads, 300, 512)[1:] == (1, 0)
    full = torch.empty(2, 4, 300, 512, dtype=torch.float32)
    assert layout.bias_tma_view(full, 300, 512)[1:] == (1, 1)
    assert layout.bias_tma_view(torch.empty(2, 4, 1, 512).expand(2, 4, 300, 512), 300, 512) is None  # queries
    assert layout.bias_tma_view(torch.empty(2, 4, 300, 1).expand(2, 4, 300, 512), 300, 512) is None  # keys
    assert layout.bias_tma_view(torch.empty(2, 4, 300, 517, dtype=torch.bfloat16), 300, 517) is None  # rows
    assert layout.bias_tma_view(full.transpose(2, 3).contiguous().transpose(2, 3), 300, 512) is None  # strides


@pytest.mark.parametrize("seqlen_q", [512, 1024, 2048, 4096, 8192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
def test_sm90_cross_item_where_measured_and_safe(head_dim, causal, seqlen_q):
    """Overlapped work items: persistent plans with two Q buffers at D<=64 or with three ring stages, never a
    causal two-stage ring (a deadlock)."""
    tiles = sm90_forward_tiles(head_dim, causal, seqlen_q)
    persistent = sm90_persistent(causal, seqlen_q, 4096, 132)
    q_buffers = sm90_q_buffers(tiles, head_dim, persistent, H200)
    cross = sm90_cross_item(tiles, head_dim, causal, persistent, q_buffers)
    if cross:
        assert persistent and q_buffers == 2 and (not causal or tiles.num_stages >= 3)
    assert not sm90_cross_item(tiles, head_dim, causal, False, q_buffers)
    assert not sm90_cross_item(tiles, head_dim, causal, persistent, 1)
    # measured: D<=64 non-causal, and causal wherever persistent (here up to 8k: 4096 items); short causal rows
    # (64-key tiles, three stages) up to D=128
    expected = (head_dim <= 64 and (not causal or seqlen_q <= 8192)) or (
        head_dim <= 128 and causal and seqlen_q <= SM90_SHORT_CAUSAL_LEN)
    assert cross == expected


def test_sm90_rules_switch_at_the_measured_lengths():
    """`auto`'s sm_90 choice, its persistence and its key tile flip at the H200 sweeps' lengths (tiles.py)."""
    short, long_causal = SM90_SHORT_CAUSAL_LEN, SM90_PERSISTENT_MAX_CAUSAL_LEN
    # causal: persistent up to 4k whatever the item count, up to 8k with >= 12 query tiles per SM, never beyond
    few, many = SM90_PERSISTENT_MIN_ROUNDS * 132 - 1, SM90_PERSISTENT_MIN_ROUNDS * 132
    assert sm90_persistent(True, long_causal, 1, 132) and not sm90_persistent(True, long_causal + 1, few, 132)
    assert sm90_persistent(True, SM90_PERSISTENT_LONG_CAUSAL_LEN, many, 132)
    assert not sm90_persistent(True, SM90_PERSISTENT_LONG_CAUSAL_LEN + 1, 1 << 20, 132)
    assert sm90_persistent(False, 1 << 20, 1, 132)
    assert sm90_forward_tiles(128, True, short) == AttentionTiles(128, 64, 8, 3, use_tma=True)
    assert sm90_forward_tiles(256, True, short) == AttentionTiles(128, 64, 8, 2, use_tma=True)
    assert sm90_forward_tiles(128, True, short + 1) == AttentionTiles(128, 128, 8, 3, use_tma=True)
    assert sm90_forward_tiles(128, False, 512) == AttentionTiles(128, 128, 8, 2, use_tma=True)
    assert sm90_forward_tiles(256, True, 1 << 14).block_n == 64


def test_sm90_plan_length_is_a_bands_span():
    """The rules read Lq for dense, causal and one-sided windows, the span of a window bounded on both sides."""
    assert sm90_plan_length(32768, make_mask(False)) == sm90_plan_length(32768, make_mask(True)) == 32768
    assert sm90_plan_length(32768, make_mask(True, (4095, 0))) == 4096
    assert sm90_plan_length(32768, make_mask(False, (2047, 2048))) == 4096
    assert sm90_plan_length(32768, make_mask(False, (4095, -1))) == 32768  # left bound only: items see to Lk
    assert sm90_plan_length(32768, make_mask(False, (-1, 0))) == 32768
    assert sm90_plan_length(1000, make_mask(True, (4095, 0))) == 1000  # wider than the sequence: plain causal


def _band_items(seqlen, window_left, window_right, block_m, block_n):
    """Keys (whole key tiles) each query tile of one (batch, head) streams: from its first row's window start,
    rounded down to a key tile, to its last row's window end (the rule of mask.key_tile_range, per query tile)."""
    keys = []
    for start_m in range(0, seqlen, block_m):
        key_start = max(start_m - window_left, 0) // block_n * block_n
        key_end = min(min(start_m + block_m, seqlen) - 1 + window_right + 1, seqlen)
        keys.append(-(-(key_end - key_start) // block_n) * block_n)
    return keys


def _simulated_balance(items, sm_count):
    """(static, one CTA per tile) busy fractions of `items` (keys each, in work order): the persistent kernel's
    snaking rounds (work_items.work_index), each CTA's first item's setup unhidden; the hardware's in-order greedy
    dispatch, every item paying its setup (SM90_ITEM_SETUP_KEYS)."""
    import heapq

    setup = SM90_ITEM_SETUP_KEYS
    loads = [0.0] * sm_count
    for work, tiles in enumerate(items):
        rounds, position = divmod(work, sm_count)
        loads[position if rounds % 2 == 0 else sm_count - 1 - position] += tiles
    finish = [0.0] * sm_count
    for tiles in items:
        heapq.heappush(finish, heapq.heappop(finish) + tiles + setup)
    mean = sum(items) / sm_count
    return mean / (max(loads) + setup), mean / max(finish)


@pytest.mark.parametrize("heads,seqlen,window", [(16, 32768, (4095, 0)), (4, 131072, (4095, 0)),
                                                 (16, 131072, (4095, 0)), (16, 32768, (2047, 2048)),
                                                 (8, 16384, (1023, 0))])
def test_sm90_band_schedule_estimates_the_rounds(heads, seqlen, window):
    """The estimate against the work order played out item by item in plain Python: the static rounds exactly, one
    CTA per tile (the hardware's greedy dispatch, estimated as the mean plus half an item) within 2%, and the
    same choice wherever the simulated schedules differ by more than that."""
    mask = make_mask(window[1] == 0, window)
    tiles = sm90_forward_tiles(128, True, sm90_plan_length(seqlen, mask))
    band = sm90_band_schedule(tiles, mask, seqlen, seqlen, heads, 132)
    items = _band_items(seqlen, *window, tiles.block_m, tiles.block_n) * heads
    assert band.item_keys == max(items)
    static, per_tile = _simulated_balance(items, 132)
    assert band.static == pytest.approx(static, rel=1e-9) and band.per_tile == pytest.approx(per_tile, rel=0.02)
    if abs(static - per_tile) > 0.02:
        assert band.persistent == (static > per_tile)


def test_sm90_band_schedule_only_for_bands():
    tiles = sm90_forward_tiles(128, True, 4096)
    for mask in (make_mask(True), make_mask(False), make_mask(False, (4095, -1)), make_mask(True, (40000, 0))):
        assert sm90_band_schedule(tiles, mask, 32768, 32768, 16, 132) is None


BAND_PLANS = {  # (B, H, L, window) -> (key tile, stages, persistent, Q buffers, cross-item)
    (1, 16, 32768, (4095, 0)): (128, 3, False, 1, False),  # 32 rounds of full items vs a mean of 29.1
    (1, 4, 131072, (4095, 0)): (128, 3, True, 1, False),  # few clipped items: the rounds balance
    (1, 16, 32768, (511, 0)): (64, 3, True, 2, True),  # a short band plans as short causal rows
    (8, 16, 4096, None): (128, 3, True, 1, False),  # dense causal: as before
    (1, 16, 32768, None): (128, 3, False, 1, False),
}


@pytest.mark.parametrize("case", list(BAND_PLANS), ids=lambda c: f"B{c[0]}-H{c[1]}-L{c[2]}-w{c[3]}")
def test_sm90_band_plans(case):
    """What `auto` plans for bands on a 132-SM Hopper, and that describe_dispatch's text says why (the band's keys
    per query tile and the estimated balance)."""
    problem, plan, text = hopper_forward_plan(*case)
    block_n, stages, persistent, q_buffers, cross = BAND_PLANS[case]
    assert (plan.tiles.block_n, plan.tiles.num_stages) == (block_n, stages)
    assert (plan.persistent, plan.q_buffers, plan.cross_item) == (persistent, q_buffers, cross)
    if case[3] is None:
        assert "band" not in text
    else:
        band = sm90_band_schedule(plan.tiles, problem.features.mask, case[2], case[2], case[1], H200.sm_count)
        assert f"a band of {band.item_keys} keys per query tile" in text
        assert ("persistent" in text) == persistent and band.persistent == persistent


@pytest.mark.parametrize("seqlen_q", [512, 4096])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256])
def test_sm90_tiles_fit_hopper_shared_memory(head_dim, causal, seqlen_q):
    tiles = sm90_forward_tiles(head_dim, causal, seqlen_q)
    block_d = padded_head_dim(head_dim)
    # the Q tile (a 64-row box per consumer) + NUM_STAGES K and V tiles, bf16, within 227 KiB less the scratch
    smem = (tiles.block_m + tiles.num_stages * 2 * tiles.block_n) * block_d * 2
    consumers = 3 if block_d <= 64 and tiles.block_n == 128 and not causal else 2  # causal: from 16384 rows
    assert (tiles.block_m, tiles.num_warps) == (64 * consumers, 4 * consumers) and smem <= H200.smem_per_block - 2048


@pytest.mark.parametrize("seqlen_q", [512, 1024, 2048, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 72, 128, 256])
def test_sm90_three_consumers_at_small_head_dims(head_dim, causal, seqlen_q):
    """Head dims padding to <= 64 with 128-key tiles run 192-row work items on three consumer warpgroups at 160
    registers (a launch cap of 128 for the 16 warps Triton pads 13 to); short causal rows' 64-key tiles and wider
    heads keep two at 240 (cap 168). Overlapped items stay deadlock-free: a causal 192-row item's first consumer
    skips at most one 128-key tile, so three stages suffice as with two consumers."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.gluon.sm90 import consumer_registers, launch_options

    tiles = sm90_forward_tiles(head_dim, causal, seqlen_q)
    three = padded_head_dim(head_dim) <= 64 and not (causal and seqlen_q < SM90_THREE_CONSUMER_CAUSAL_LEN)
    consumers = fwd_sm90.num_consumers(tiles)
    assert consumers == (3 if three else 2) and tiles.block_m == 64 * consumers
    assert tiles.block_n == 128 or consumers == 2
    assert launch_options(consumers) == {"num_warps": 4, "maxnreg": 128 if three else 168}
    assert consumer_registers(consumers) == (160 if three else 240)
    # every thread fits the register file at launch and after setmaxnreg (the producer warp padded to 4)
    assert (consumers + 1) * 128 * launch_options(consumers)["maxnreg"] <= 65536
    assert consumers * 128 * consumer_registers(consumers) + 128 * 24 <= 65536
    if causal:
        assert sm90_cross_item_safe(True, tiles) == (tiles.num_stages >= 3)
    assert not sm90_cross_item_safe(True, AttentionTiles(192, 64, 12, 3, use_tma=True))  # skips two 64-key tiles
    assert sm90_cross_item_safe(True, AttentionTiles(192, 64, 12, 4, use_tma=True))
    with pytest.raises(ValueError, match="rows"):
        fwd_sm90.num_consumers(AttentionTiles(256, 128, 16, 2, use_tma=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_backward_runs_two_passes(head_dim, causal, dtype):
    # the fused atomic-dQ pass measured slower on the H200 at every head dim: no fused tiles, so `deterministic`
    # changes nothing there (api.py takes the fused pass only when tiles.fused is set)
    assert backward_tiles(head_dim, dtype, causal, H200).fused is None


@pytest.mark.parametrize("bias_bytes", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_tiles_leave_room_for_a_bias(head_dim, bias_bytes):
    """An attn_bias's streamed tiles count against the shared memory (a float32 bias at D=128 once asked the dq
    kernel for 262144 bytes on an H100, past its 232448)."""
    from flashmoe_science.attention.tiles import backward_smem_bytes, smem_budget

    tiles = backward_tiles(head_dim, torch.bfloat16, True, H200, bias_bytes)
    for kernel in ("dkdv", "dq"):
        assert backward_smem_bytes(getattr(tiles, kernel), head_dim, 2, kernel, bias_bytes) <= smem_budget(H200)


def test_sm90_launcher_rejects_other_tiles():
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90

    q = _blhd(1, 2, 64, 128)
    with pytest.raises(ValueError, match="128 or 192-row tiles"):
        fwd_sm90.attention_forward_sm90(q, q, q, torch.empty_like(q), torch.empty(1, 2, 64), False, 0.1,
                                        AttentionTiles(64, 64, 4, 2, use_tma=True))


def test_sm90_launcher_rejects_an_output_tma_cannot_store():
    """The output leaves through a TMA store, so out needs TMA's alignment (the API makes it like q)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashmoe_science.attention.hopper import fwd_sm90

    q = _blhd(1, 2, 64, 128)
    tiles = sm90_forward_tiles(128, False, 64)
    misaligned = torch.empty(1, 2, 64 * 128 + 1, dtype=q.dtype)[..., 1:].view(1, 2, 64, 128)
    for out in (misaligned, torch.empty(1, 2, 64, 128), torch.empty(1, 2, 32, 128, dtype=q.dtype)):
        with pytest.raises(ValueError, match="out must"):
            fwd_sm90.attention_forward_sm90(q, q, q, out, torch.empty(1, 2, 64), False, 0.1, tiles)


def test_triton_plan_drops_tma_for_strides_tma_cannot_take(monkeypatch):
    """The plan decides TMA once (the launcher trusts it): on Hopper traits, misaligned strides get pointers."""
    from flashmoe_science.attention.triton import backend as triton_backend
    from flashmoe_science.attention.plan import plan_attention
    from flashmoe_science.attention.problem import dense_problem

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets backend="triton" accept CPU tensors; nothing is launched
    monkeypatch.setattr(triton_backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    aligned = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    plan = plan_attention(dense_problem(aligned, aligned, aligned, backend="triton")[0])
    assert plan.backend == "triton" and plan.forward.tiles.use_tma
    misaligned = torch.randn(1, 2, 64, 65, dtype=torch.bfloat16)[..., 1:]  # base off by 2 bytes, rows of 130 bytes
    plan = plan_attention(dense_problem(misaligned, misaligned, misaligned, backend="triton")[0])
    assert plan.backend == "triton" and not plan.forward.tiles.use_tma


def test_64bit_rows_only_where_offsets_pass_2_31():
    from flashmoe_science.attention.layout import needs_64bit_rows

    def blhd(length, heads=32, d=128):  # a transposed (B, L, H, D) buffer, on the meta device: no memory
        return torch.empty(1, length, heads, d, device="meta").transpose(1, 2)

    assert not needs_64bit_rows(blhd(524288))  # last row starts at (524288 - 1) * 4096 + 128 < 2**31
    assert needs_64bit_rows(blhd(524289))
    assert not needs_64bit_rows(blhd(524289).contiguous())  # row stride D
    assert needs_64bit_rows(None, blhd(16), blhd(1 << 20)) and not needs_64bit_rows(None)


@pytest.mark.parametrize("seqlen,consumers", [(16384, 3), (512, 2)], ids=["long-causal", "short-causal"])
def test_sm90_plan_says_why_it_runs_three_consumers(seqlen, consumers):
    """describe_dispatch's text names the consumer count and, for three, the head-dim rule behind it."""
    _, plan, text = hopper_forward_plan(1, 16, seqlen, None, head_dim=64)
    assert plan.tiles.block_m == 64 * consumers
    assert f"{consumers} consumer warpgroups of 64 rows" in text
    assert ("192 query rows" in text) == (consumers == 3)
