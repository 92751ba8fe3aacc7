"""transformers' continuous batching on the GPU through `hf.FLASH_IMPLEMENTATION`: on CUDA it takes the
block-table decode path (`flash_attn_with_kvcache` -> `flash_attention_decode` on the paged cache) and the varlen
prefill. A tiny random Llama in float32 (so that greedy choices do not hinge on rounding) gives the same tokens as
transformers' own `paged|eager`, and the paged decode kernel is what ran.

Run on a GPU: `PYTHONPATH=src python -m pytest -q -m gpu tests/integrations/test_serving_gpu.py`."""

import pytest

pytest.importorskip("transformers")

from flashmoe_science.attention.record import recording  # noqa: E402
from flashmoe_science.integrations import hf  # noqa: E402
from test_serving import _tiny_llama, generate  # noqa: E402

pytestmark = pytest.mark.gpu


def test_generate_batch_runs_the_paged_decode_kernel_and_matches_paged_eager():
    model = _tiny_llama().to("cuda")
    prompts = [[1, 5, 9, 22, 7], [3, 4], list(range(1, 60)), [8] * 33]
    options = dict(num_blocks=16, max_batch_tokens=128, page_size=32)
    with recording() as ran:
        ours = generate(model, hf.register_flash(), prompts, max_new_tokens=12, **options)
    kernels = {kernel for _, _, kernel in ran}
    assert "triton_decode._decode_kernel" in kernels, kernels
    assert ours == generate(model, "paged|eager", prompts, max_new_tokens=12, **options)
