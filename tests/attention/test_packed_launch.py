"""A repeated packed inference call on the sm_90 forward, on the CPU (the planner on Hopper's traits, the Gluon launch
and its preparation replaced: nothing is launched): the first call plans and launches, the second launches and
prepares, and from the third the call's PackedLaunch hands the prepared launch the call's own tensors, cumulative
lengths and work list without the step's run or its cache key."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science import flash_attention_varlen  # noqa: E402
from flashmoe_science.attention import call, seqlen  # noqa: E402
from flashmoe_science.attention.hopper import backend, fwd_sm90  # noqa: E402
from flashmoe_science.device import DeviceTraits  # noqa: E402
from flashmoe_science.gluon import availability  # noqa: E402


@pytest.fixture
def hopper_stubbed(monkeypatch):
    """Hopper's plan on CPU tensors; a log of the plain launches, the preparations and the prepared launches."""
    log = {"plain": 0, "prepare": 0, "prepared": [], "run": 0}
    monkeypatch.setattr(backend, "_on_hopper", lambda q: True)
    monkeypatch.setattr(backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    monkeypatch.setattr(availability, "_failure", None)
    monkeypatch.setattr(seqlen, "varlen_work_list",
                        lambda cu, block, slots: torch.zeros(1 + 4 * slots, dtype=torch.int32))
    monkeypatch.setattr(call, "PREPARED_PACKED", {})
    monkeypatch.setattr(backend, "PREPARED_FORWARD", {})

    def plain(*args, **kwargs):
        log["plain"] += 1

    def prepare(*args, **kwargs):
        log["prepare"] += 1
        return lambda *tensors: log["prepared"].append(tensors)

    run = backend.HopperForward.run

    def counted_run(self, *args, **kwargs):
        log["run"] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90", plain)
    monkeypatch.setattr(fwd_sm90, "prepare_forward", prepare)
    monkeypatch.setattr(backend.HopperForward, "run", counted_run)
    return log


def test_a_packed_call_launches_through_its_prepared_launch_from_the_third_call(hopper_stubbed):
    log = hopper_stubbed
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32)
    q = torch.randn(200, 8, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(200, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    for layer in range(4):
        flash_attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, check_values=False)
        if layer == 1:
            entry, = call.PREPARED_PACKED.values()
            assert entry.__class__ is call.PackedLaunch and entry.step.backend == "hopper"
    assert (log["plain"], log["prepare"], log["run"]) == (2, 1, 2)  # calls 3 and 4 skip the step's run
    first, second = log["prepared"]
    for tensors in (first, second):
        q4, k4, v4, out, lse, cu_q, cu_k, table = tensors
        assert (q4.shape, q4.data_ptr(), k4.data_ptr(), v4.data_ptr()) == ((1, 8, 200, 128), q.data_ptr(),
                                                                           k.data_ptr(), v.data_ptr())
        assert out.shape == q4.shape and lse.shape == (1, 8, 200) and cu_q is cu and cu_k is cu
    assert first[-1] is second[-1]  # the work list of this cu_seqlens tensor, computed once


def test_a_signature_the_step_cannot_prepare_runs_the_step(hopper_stubbed, monkeypatch):
    log = hopper_stubbed
    monkeypatch.setattr(backend.HopperForward, "prepare", lambda self, *args: None)
    cu = torch.tensor([0, 33, 90], dtype=torch.int32)
    q, k, v = (torch.randn(90, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(4):
        flash_attention_varlen(q, k, v, cu, cu, 57, 57, causal=True, check_values=False)
    entry, = call.PREPARED_PACKED.values()
    assert entry.__class__ is call.PackedLaunch and entry.prepared is None
    assert log["run"] == 4 and not log["prepared"]


def test_an_engine_buffer_reaches_the_prepared_launch(hopper_stubbed):
    """`packed_forward(out=)` (an engine's output): the step's second run and every prepared launch after it get the
    buffer as their out, so the call returns a view of it; the first call (planning) returns its own."""
    log = hopper_stubbed
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32)
    qkv = torch.randn(200, (8 + 2 + 2) * 128, dtype=torch.bfloat16)
    q = qkv[:, :8 * 128].view(200, 8, 128)
    k, v = (qkv[:, n * 128:(n + 2) * 128].view(200, 2, 128) for n in (8, 10))
    buffer = torch.empty(200, 8, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        outs = [call.packed_forward(q, k, v, cu, cu, 130, 130, causal=True, check_values=False, out=buffer)[0]
                for _ in range(4)]
    assert outs[0].data_ptr() != buffer.data_ptr() and outs[0].is_contiguous()
    assert all(out.data_ptr() == buffer.data_ptr() for out in outs[1:])
    assert [tensors[3].data_ptr() for tensors in log["prepared"]] == [buffer.data_ptr()] * 2
