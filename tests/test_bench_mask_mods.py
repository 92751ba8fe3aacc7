"""The mask-mods suite's masks (bench/mask_mods.py): each `@triton.jit` mod and the torch twin FlexAttention traces
are one mask, so the two backends are timed on the same work: our CPU reference with the mod against the float64
oracle with the twin's visibility, and the pairs the suite credits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flashmoe_science import flash_attention_science
from flashmoe_science.bench import mask_mods

sys.path.insert(0, str(Path(__file__).parent / "attention"))
from mod_cases import mod_oracle  # noqa: E402

LENGTH = 48


def _seen(flex_mask):
    q, kv = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    return torch.stack([torch.stack([flex_mask(b, h, q, kv) for h in range(mask_mods.HEADS)])
                        for b in range(mask_mods.BATCH)])


@pytest.mark.parametrize("index", range(len(mask_mods.mask_cases(8, "cpu"))))
def test_mod_and_flex_twin_are_one_mask(index):
    name, ours, flex_mask, pairs = mask_mods.mask_cases(LENGTH, "cpu")[index]
    seen = _seen(flex_mask)
    assert pairs == int(seen.sum()) and 0 < pairs < seen.numel(), name
    gen = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(mask_mods.BATCH, mask_mods.HEADS, LENGTH, 32, generator=gen) for _ in range(3))
    out = flash_attention_science(q, k, v, mask_mod=ours)
    expected, _ = mod_oracle(q, k, v, seen, None)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_the_suite_says_why_its_gpu_contenders_did_not_run_on_a_cpu():
    from flashmoe_science.bench import features

    cases = features.feature_cases(["mask-mods"], True, torch.device("cpu"), torch.float32)
    assert [case.name for case in cases] == [name for name, *_ in mask_mods.mask_cases(8, "cpu")]
    for case in cases:
        builtin = ["flashmoe-builtin"] if case.name in mask_mods.BUILTIN_KEYWORDS else []
        assert list(case.contenders) == ["flashmoe", *builtin]
        assert "needs CUDA tensors" in case.skipped["flashmoe-arch"] and "GPU only" in case.skipped["flex"]
    assert ("flashmoe-arch", "flex") in features.RATIOS["mask-mods"]


@pytest.mark.parametrize("name", list(mask_mods.BUILTIN_KEYWORDS))
def test_a_builtin_written_as_a_mod_is_the_builtin(name):
    cases = {case_name: ours for case_name, ours, *_ in mask_mods.mask_cases(mask_mods.WINDOW + 40, "cpu")}
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, mask_mods.WINDOW + 40, 16, generator=gen) for _ in range(3))
    torch.testing.assert_close(flash_attention_science(q, k, v, mask_mod=cases[name]),
                               flash_attention_science(q, k, v, **mask_mods.BUILTIN_KEYWORDS[name]))


def test_without_fa4_its_contender_says_so_and_the_suite_imports_no_cute_dsl(monkeypatch):
    """Without FlashAttention-4 every case leaves ``fa4`` out with a reason naming it; the suite's modules import
    neither cutlass nor flash_attn (the CuTe DSL twins live in bench/mask_mods_fa4.py, imported only where FA4 runs)."""
    import subprocess

    from flashmoe_science.bench import features

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn.cute` raises ImportError
    cases = features.feature_cases(["mask-mods"], True, torch.device("cpu"), torch.float32)
    for case in cases:
        assert "fa4" not in case.contenders and "FlashAttention-4" in case.skipped["fa4"], case.name
    assert {("flashmoe", "fa4"), ("flashmoe-arch", "fa4")} <= set(features.RATIOS["mask-mods"])
    probe = ("import sys, flashmoe_science.bench.mask_mods, flashmoe_science.bench.features; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'flash_attn')))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
