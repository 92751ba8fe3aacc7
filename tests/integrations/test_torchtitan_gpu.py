"""The TorchTitan integration on the GPU (`pytest -m gpu tests/integrations/test_torchtitan_gpu.py`): the per-document
metadata of a batch of the example jobs' shape in one device synchronisation, equal to TorchTitan's."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("torchtitan")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("torchtitan")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "torchtitan"))
import torch_compat  # noqa: E402

torch_compat.install()

from torchtitan.models.common.attention import create_varlen_metadata_for_document  # noqa: E402

import flashmoe_science  # noqa: E402
from flashmoe_science.integrations.torchtitan import document_metadata  # noqa: E402

PACKAGE = Path(flashmoe_science.__file__).resolve().parent


def test_document_metadata_syncs_once_and_equals_titans():
    generator = torch.Generator().manual_seed(0)
    rows = []
    for row in range(16):
        lengths = [2048] if row == 3 else torch.randint(1, 400, (40,), generator=generator).tolist()
        rows.append(torch.cat([torch.arange(n) for n in lengths])[:2048])
    positions = torch.stack(rows).cuda()
    document_metadata(positions)  # warm-up: allocator, kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            meta = document_metadata(positions)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)]
    # the warnings name the Python line that made the synchronising call. On an H100 (torch 2.11) one named
    # document_metadata's single .tolist() and the other a line of torch/cuda/__init__.py (1270), a module
    # document_metadata never calls into; only the synchronisations made from this package's lines are counted
    ours = [f"{Path(f).name}:{n}" for f, n in syncs if Path(f).resolve().is_relative_to(PACKAGE)]
    # the attribution varies: an H200 (torch 2.11) named only torch/cuda/__init__.py:1270, one synchronisation in
    # all. At most one from this package's lines and one elsewhere
    assert len(ours) <= 1 and len(syncs) - len(ours) <= 1, (
        f"document_metadata synchronised at {ours} (all synchronisations: {syncs})")
    expected = create_varlen_metadata_for_document(positions)
    assert torch.equal(meta.cu_seq_q, expected.cu_seq_q) and meta.max_q == expected.max_q


def _syncs_of_package(step) -> list[str]:
    """The lines of this package that synchronised the device while ``step()`` ran (torch's sync debug warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
            and Path(w.filename).resolve().is_relative_to(PACKAGE)]


def test_training_step_of_a_flash_llama_syncs_once():
    # TorchTitan's Llama 3 with flash_decoder on a packed batch: masks, 4 layers' forward and backward; the one
    # synchronisation is document_metadata's (the documents' count and longest length), none per layer
    from torchtitan.config import OverrideConfig, apply_overrides
    from titan_models import llama3_spec

    spec = llama3_spec(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=512, vocab_size=257,
                       max_seq_len=2048, attn_backend="flex")
    apply_overrides(OverrideConfig(imports=["flashmoe_science.integrations.torchtitan.flash_decoder"]), spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = spec.model.build()
        model.init_states()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (4, 2048), generator=generator).cuda()

    def step():
        lengths = torch.randint(1, 700, (60,), generator=generator).tolist()  # a new batch's documents
        positions = torch.cat([torch.arange(n) for n in lengths])[:4 * 2048].view(4, 2048).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
        out.float().square().mean().backward()
        torch.cuda.synchronize()

    step()  # compiles and plans
    syncs = _syncs_of_package(step)
    assert len(syncs) == 1 and syncs[0].startswith("documents.py"), syncs
