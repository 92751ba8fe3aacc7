"""The Gluon sm_90 forward on e4m3 operands without a GPU: its plan (tiles, schedule; declined where TMA cannot read
the inputs), its launch checks, and its sm_90 builds at the planned tiles: P·V with P in registers,
P's registers untouched until the wait that retires the product, the softmax between the products' issue and that
wait (not serialised), spills within the tuned build's. Numerics run on the GPU (test_fp8.py)."""

from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch

fwd_sm90 = pytest.importorskip("flashmoe_science.attention.hopper.fwd_sm90")
from flashmoe_science.attention.fp8 import FP8, Fp8Problem  # noqa: E402
from flashmoe_science.attention.hopper import backend  # noqa: E402
from flashmoe_science.attention.hopper.tiles import (sm90_fp8_forward_tiles, sm90_fp8_q_buffers,  # noqa: E402
                                                     sm90_fp8_smem_bytes)
from flashmoe_science.device import DeviceTraits  # noqa: E402
from flashmoe_science.gluon.build import spill_budget, spill_count  # noqa: E402
from sm90_helpers import HOPPER_TRAITS, sass_or_skip  # noqa: E402

SMEM_PER_BLOCK = HOPPER_TRAITS[1]


def _meta_inputs(b, hq, hkv, lq, lk, d, k_major_v=True):
    q = torch.empty(b, hq, lq, d, dtype=FP8, device="meta")
    k = torch.empty(b, hkv, lk, d, dtype=FP8, device="meta")
    if k_major_v:  # quantize_fp8's layout: Vᵀ rows padded to 16 bytes
        v = torch.empty(b, hkv, d, -(-lk // 16) * 16, dtype=FP8, device="meta")[..., :lk].transpose(-1, -2)
    else:
        v = torch.empty(b, hkv, lk, d, dtype=FP8, device="meta")
    descale = torch.empty(b, hkv, device="meta")
    return q, k, v, (descale, descale, descale)


def _plan(q, k, v, descales, causal):
    problem = Fp8Problem(q, k, v, descales, causal, 0.1, "auto")
    traits = DeviceTraits((9, 0), *HOPPER_TRAITS)
    with mock.patch.object(backend, "device_traits", lambda device: traits), \
            mock.patch.object(backend, "unavailable_reason", lambda: None):
        return backend.fp8_forward_plan(problem), traits


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_plan_runs_the_gluon_kernel_on_k_major_inputs(d):
    """Quantised inputs (K-major V) plan the Gluon forward at its tiles, with two Q buffers where a persistent CTA
    has the room; the description names it."""
    q, k, v, descales = _meta_inputs(2, 16, 4, 8192, 8192, d)
    for causal in (False, True):
        plan, traits = _plan(q, k, v, descales, causal)
        assert isinstance(plan, backend.HopperFp8Forward)
        assert plan.tiles == sm90_fp8_forward_tiles(d) and plan.persistent
        assert plan.q_buffers == sm90_fp8_q_buffers(plan.tiles, d, True, traits) == 2
        assert sm90_fp8_smem_bytes(plan.tiles, d, plan.q_buffers) <= SMEM_PER_BLOCK
        assert "Gluon sm_90 kernel on e4m3 operands" in plan.describe()
    q, k, v, descales = _meta_inputs(1, 16, 16, 16384, 16384, 128)
    plan, _ = _plan(q, k, v, descales, True)  # long causal rows: one CTA per query tile, as in bf16
    assert not plan.persistent and plan.q_buffers == 1


def test_fp8_gluon_kernel_declines_where_tma_cannot_read_v():
    """A row-major e4m3 V of 300 keys: its transpose has no unit last stride, so the Gluon family declines, saying
    why, and the FP8 walk goes on to the Triton e4m3 kernel (it transposes V once)."""
    q, k, v, descales = _meta_inputs(2, 8, 2, 300, 300, 128, k_major_v=False)
    problem = Fp8Problem(q, k, v, descales, False, 0.1, "auto")
    with mock.patch.object(backend, "_on_hopper", lambda q: True), \
            mock.patch.object(backend, "gluon_refusal", lambda: None):
        assert "TMA" in backend.HOPPER_FP8.decline(problem)
        q, k, v, descales = _meta_inputs(2, 8, 2, 300, 300, 128)
        assert backend.HOPPER_FP8.decline(Fp8Problem(q, k, v, descales, False, 0.1, "auto")) is None


def test_fp8_launch_checks():
    """e4m3 inputs need their descales and a bf16 out, 16-bit inputs none; the e4m3 forward takes causal masks only."""
    from flashmoe_science.attention.mask import make_mask
    from flashmoe_science.attention.tiles import AttentionTiles

    q, k, v, descales = _meta_inputs(2, 4, 2, 256, 256, 128)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(q.shape[:3], device="meta")
    tiles = AttentionTiles(128, 128, 8, 3, use_tma=True)
    _, args, _ = fwd_sm90._launch_args(q, k, v, out, lse, True, 0.1, tiles, 132, 2, False, descales=descales)
    named = dict(zip(fwd_sm90.attention_forward_sm90_kernel.arg_names, args))
    assert named["QD"] is descales[0] and named["v_desc"].block_shape == [1, 1, 128, 128]
    with pytest.raises(ValueError, match="descales"):
        fwd_sm90._launch_args(q, k, v, out, lse, True, 0.1, tiles, 132, 2, False)
    with pytest.raises(ValueError, match="dtype"):
        fwd_sm90._launch_args(q, k, v, q, lse, True, 0.1, tiles, 132, 2, False, descales=descales)
    with pytest.raises(ValueError, match="causal mask only"):
        fwd_sm90._launch_args(q, k, v, out, lse, False, 0.1, tiles, 132, 2, False, make_mask(False, (64, 0)),
                              descales=descales)
    bf16 = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="descales"):
        fwd_sm90._launch_args(bf16, bf16, bf16, bf16, lse, False, 0.1, tiles, 132, 1, False, descales=descales)


def register_a_hazards(sass: str) -> tuple[int, list[str], int]:
    """(register-A QGMMAs, instructions that write one of their A registers between the product's issue and the
    next `WARPGROUP.DEPBAR.LE gsb0, 0x0`, P·V groups whose first wait is `gsb0, 0x1`). The wgmma wait cannot take
    8-bit operands in triton 3.6 (fwd_sm90._wait_pv), so nothing but ptxas keeps P's registers alive: this reads
    that off the SASS. A P·V group waited on with 0x1 leaves the product in flight while the softmax runs (a
    serialised pipeline would wait with 0x0 at once)."""
    lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0].strip()
             for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    products, writes, overlapped = 0, [], 0
    for i, text in enumerate(lines):
        found = re.match(r"QGMMA\S*\s+R\d+,\s*R(\d+),", text)
        if not found:
            continue
        products += 1
        a_regs = {f"R{int(found.group(1)) + n}" for n in range(4)}  # 16 bytes: 64 rows x 32 keys of e4m3 P
        first_wait = None
        for later in lines[i + 1:]:
            if later.startswith("WARPGROUP.DEPBAR.LE gsb0"):
                first_wait = first_wait or later
                if later.endswith("0x0"):
                    break
            op = re.sub(r"^@!?U?P\w+\s+", "", later)
            registers = re.findall(r"\bR\d+\b", op)
            if registers and registers[0] in a_regs and not op.startswith(("ST", "RED", "ATOM", "QGMMA")):
                writes.append(later)
        overlapped += "gsb0" in text and first_wait is not None and first_wait.endswith("0x1")
    return products, writes, overlapped


# (head dim, causal, Q buffers) at the planned tiles -> LDL + STL of the triton 3.6 build
FP8_CASES = {
    (64, False, 2): 0,
    (64, True, 2): 8,
    (128, False, 2): 0,
    (128, True, 2): 160,
    (128, True, 1): 158,
    (256, False, 2): 0,
    (256, True, 1): 22,
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("case", list(FP8_CASES), ids=lambda c: "D{}-{}-q{}".format(c[0], "causal" if c[1] else "full",
                                                                                    c[2]))
def test_fp8_builds_with_p_in_registers(case):
    head_dim, causal, q_buffers = case
    tiles = sm90_fp8_forward_tiles(head_dim)
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, 132, q_buffers, dtype=FP8)
    sass = sass_or_skip(compiled)
    assert re.search(r"\bQGMMA\.64x%dx32\.F32\.E4M3\.E4M3 R\d+, gdesc" % tiles.block_n, sass)  # S: both from smem
    products, writes, overlapped = register_a_hazards(sass)
    assert products > 0, "P·V no longer takes P from registers"
    assert not writes, writes[:4]
    assert overlapped >= 2, "the P·V product is waited on before the softmax (serialised)"
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert spill_count(sass) <= spill_budget(FP8_CASES[case]), "spills grew"
    assert compiled.metadata.shared <= SMEM_PER_BLOCK
