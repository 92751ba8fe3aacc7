"""transformers' continuous batching on the GPU through `hf.FLASH_IMPLEMENTATION`: on CUDA it takes the
block-table decode path (`flash_attn_with_kvcache` -> `flash_attention_decode` on the paged cache) and the varlen
prefill. A tiny random Llama in float32 (so that greedy choices do not hinge on rounding) gives the same tokens as
transformers' own `paged|eager`, and the paged decode kernel is what ran; with the e4m3 cache
(`hf_e4m3_cache`), the tokens of a float64 oracle on the same e4m3-rounded keys and values.

Run on a GPU: `PYTHONPATH=src python -m pytest -q -m gpu tests/integrations/test_serving_gpu.py`."""

import pytest

pytest.importorskip("transformers")

from flashmoe_science.attention.record import recording  # noqa: E402
from flashmoe_science.integrations import hf  # noqa: E402
from flashmoe_science.integrations import hf_e4m3_cache as e4m3  # noqa: E402
from integrations.e4m3_oracle import oracle  # noqa: E402
from test_hf_e4m3_cache import continuous_batching  # noqa: E402
from test_serving import _tiny_llama, generate  # noqa: E402

pytestmark = pytest.mark.gpu


def test_generate_batch_runs_the_paged_decode_kernel_and_matches_paged_eager():
    model = _tiny_llama().to("cuda")
    prompts = [[1, 5, 9, 22, 7], [3, 4], list(range(1, 60)), [8] * 33]
    options = dict(num_blocks=16, max_batch_tokens=128, page_size=32)
    with recording() as ran:
        ours = generate(model, hf.register_flash(), prompts, max_new_tokens=12, **options)
    kernels = {kernel for _, _, kernel in ran}
    assert "triton.decode._decode_kernel" in kernels, kernels
    assert ours == generate(model, "paged|eager", prompts, max_new_tokens=12, **options)


def test_the_e4m3_cache_runs_the_paged_decode_kernel_on_its_pages_and_gives_the_oracle_tokens():
    """The block-table decode kernel on the e4m3 pages with their per-KV-head scales (and CUDA graphs): the
    greedy tokens of float64 attention over the same rounded keys and values. (Not the peaky model of the CPU
    test: float32 dots on the GPU may round through TF32, and a peaky model turns that into other tokens.)"""
    model = _tiny_llama().to("cuda")
    model.set_attn_implementation(hf.register_flash())
    scales = e4m3.calibrate_scales(model)
    prompts = [[1, 5, 9, 22, 7], [3, 4], list(range(1, 60))]
    with recording() as ran:
        tokens = continuous_batching(model, prompts, 12, scales, decode_path=True)
    assert "triton.decode._decode_kernel" in {kernel for _, _, kernel in ran}
    assert tokens == oracle(model, prompts, 12, scales)
