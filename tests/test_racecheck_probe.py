"""benchmarks/tools/racecheck_probe.py builds for sm_90 without a GPU, and its handoff kernel keeps the shape of the
attention kernels' record handoff (what makes it a fair reference for racecheck's reports on them): the producer's
shared-memory store sits between its wait on the slot's empty barrier and its arrival on the full one; the
consumer's load sits between its wait and a warpgroup barrier, then one thread arrives on the empty barrier."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("flashmoe_science.attention.hopper.fwd_sm90")
from flashmoe_science.gluon.build import compile_offline  # noqa: E402
from sm90_helpers import sass_or_skip  # noqa: E402

pytestmark = pytest.mark.sm90_build
PROBE = Path(__file__).resolve().parents[1] / "benchmarks/tools/racecheck_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("racecheck_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _opcodes(sass: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", sass)]


def test_the_probe_builds_and_its_handoff_has_the_attention_kernels_shape():
    probe = _probe()
    out = torch.empty(160, dtype=torch.int32, device="meta")
    compile_offline(probe.ws_only_kernel, [out], {}, arch=90, options=dict(num_warps=4))
    compiled = compile_offline(probe.handoff_kernel, [out, probe.ROUNDS, probe.SLOTS],
                               {"ROUNDS": probe.ROUNDS, "SLOTS": probe.SLOTS}, arch=90, options=dict(num_warps=4))
    ops = [op for op in _opcodes(sass_or_skip(compiled))
           if op.startswith(("STS", "LDS.64", "SYNCS.PHASECHK", "SYNCS.ARRIVE", "BAR.SYNC"))]
    text = " ".join(ops)
    assert re.search(r"SYNCS\.PHASECHK\S* STS\.64 SYNCS\.ARRIVE", text), text  # producer: wait, store, arrive
    assert re.search(r"SYNCS\.PHASECHK\S* LDS\.64 BAR\.SYNC\S* SYNCS\.ARRIVE", text), text  # consumer
