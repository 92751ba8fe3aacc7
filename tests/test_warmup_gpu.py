"""flashmoe_science.warmup on the GPU: two cases compiled in two spawned processes into an empty Triton cache, which
then holds their kernels."""

import os
import pathlib

import pytest

from flashmoe_science.warmup import WarmupCase, warmup

pytestmark = pytest.mark.gpu


def test_warmup_fills_an_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the spawned processes inherit it
    cases = [WarmupCase(head_dim=64, heads=4, kv_heads=2, seq_len=256, batch=2, layout=layout)
             for layout in ("dense", "varlen")]
    seen = []
    results = warmup(cases, processes=2, progress=lambda case, seconds: seen.append(case))
    assert [case for case, _ in results] == cases and sorted(map(repr, seen)) == sorted(map(repr, cases))
    assert all(seconds > 0 for _, seconds in results)
    binaries = [path for path in pathlib.Path(tmp_path).rglob("*.cubin")]
    assert len(binaries) >= 2, os.listdir(tmp_path)
