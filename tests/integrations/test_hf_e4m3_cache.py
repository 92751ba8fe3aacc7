"""The e4m3 paged KV cache (`integrations.hf_e4m3_cache`) under transformers' continuous batching, on the CPU.

The greedy tokens of continuous batching on `hf.FLASH_IMPLEMENTATION` with the e4m3 cache equal a float64 oracle's
whose attention sees the keys and values rounded through e4m3 with the same scales, and differ from the unrounded
model's (the model's attention is made peaky so that the rounding shows: a cache that were not e4m3 would fail).
Both of transformers' paths: the index path (every step on the CPU: writes and reads by index) and the block-table
decode (transformers enables it with flash_attn on CUDA only; the test lifts that check, and our decode kernel's
CPU reference runs it on the e4m3 pages with the scales). Also: the calibrated scales, and the refusals."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashmoe_science.attention.record import recording  # noqa: E402
from flashmoe_science.integrations import hf  # noqa: E402
from flashmoe_science.integrations import hf_e4m3_cache as e4m3  # noqa: E402
from integrations.e4m3_oracle import oracle  # noqa: E402
from supported import supported  # noqa: E402

pytestmark = supported("transformers-cb")
PROMPTS = [[1, 5, 9, 22, 7], [3, 4], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 11, 40, 2, 19, 20, 21, 22]]
NEW = 12
GAIN = 16.0  # q and k projections scaled up: attention peaky enough for e4m3's rounding to change greedy tokens


def peaky_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(GAIN)
            layer.self_attn.k_proj.weight.mul_(GAIN)
    model.set_attn_implementation(hf.register_flash())
    return model


def continuous_batching(model, prompts, new_tokens, scales=None, decode_path=False):
    """Greedy tokens per prompt from transformers' continuous batching (e4m3 cache with ``scales`` if given)."""
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    options = dict(num_blocks=8, max_batch_tokens=64, max_blocks_per_request=4 if decode_path else 0)
    manager = model.init_continuous_batching(generation_config=generation,
                                             continuous_batching_config=hf.continuous_batching_config(16, **options))
    if scales is not None:
        e4m3.use_e4m3_cache(manager, scales)
    manager.start()
    try:
        ids = manager.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, "continuous batching returned nothing for 60 s"
            if result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=10)
    return [list(results[i].generated_tokens) for i in ids]


@pytest.fixture(scope="module")
def peaky():
    model = peaky_llama()
    scales = e4m3.calibrate_scales(model)
    want = oracle(model, PROMPTS, NEW, scales)
    assert want != oracle(model, PROMPTS, NEW), "e4m3 rounding changes no greedy token: the check would be blind"
    return model, scales, want


def test_the_index_path_gives_the_e4m3_oracle_tokens(peaky):
    model, scales, want = peaky
    with recording() as ran:
        assert continuous_batching(model, PROMPTS, NEW, scales) == want
    assert {kernel for _, _, kernel in ran} == {"reference.attention_reference"}


def test_the_block_table_decode_gives_the_e4m3_oracle_tokens(peaky, monkeypatch):
    from transformers.generation.continuous_batching import initialization

    monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", lambda *args: None)
    model, scales, want = peaky
    with recording() as ran:
        assert continuous_batching(model, PROMPTS, NEW, scales, decode_path=True) == want
    assert "decode.decode_reference" in {kernel for _, _, kernel in ran}


def test_the_cache_holds_one_byte_a_value():
    model = peaky_llama()
    scales = e4m3.calibrate_scales(model)
    generation = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    sizes = {}
    for name, given in (("auto", None), ("e4m3", scales)):
        manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=hf.continuous_batching_config(16, num_blocks=8))
        if given is not None:
            e4m3.use_e4m3_cache(manager, given)
        manager.warmup()
        cache = manager.batch_processor.cache
        sizes[name] = (cache.num_blocks, cache.cache_tensor.numel())
        manager.stop(block=True, timeout=10)
    assert sizes["auto"][0] == sizes["e4m3"][0] == 8
    assert sizes["auto"][1] == 4 * sizes["e4m3"][1]  # float32 model: four bytes a value against one


def test_the_scales_are_twice_the_calibration_amax_over_448():
    """Layer 0's values are v_proj(input_layernorm(embeddings)) of the calibration tokens: their amax per KV head,
    recomputed here in float64, sets the v scales."""
    model = peaky_llama()
    scales = e4m3.calibrate_scales(model, seed=3)
    batch, length = e4m3.CALIBRATION_SHAPE
    ids = torch.randint(128, (batch, length), generator=torch.Generator().manual_seed(3))
    layer = model.model.layers[0]
    with torch.no_grad():
        values = layer.self_attn.v_proj(layer.input_layernorm(model.model.embed_tokens(ids))).double()
    amax = values.view(batch, length, 2, 16).abs().amax(dim=(0, 1, 3))
    assert scales.k.shape == scales.v.shape == (2, 2) and scales.k.dtype == torch.float32
    torch.testing.assert_close(scales.v[0].double(), e4m3.HEADROOM * amax / 448, rtol=1e-5, atol=0)
    assert (scales.k > 0).all()


def test_refusals():
    sliding = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(ValueError, match="full-attention layers only; this model has sliding_attention"):
        e4m3.check_config(sliding)
    latent = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, kv_lora_rank=16)
    with pytest.raises(ValueError, match="MLA layers cache latents"):
        e4m3.check_config(latent)
    model = peaky_llama()
    manager = model.init_continuous_batching(
        generation_config=transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None),
        continuous_batching_config=hf.continuous_batching_config(16))
    e4m3.use_e4m3_cache(manager, e4m3.calibrate_scales(model))
    with pytest.raises(ValueError, match="needs its size"):
        manager.warmup()


def test_an_unsupported_transformers_is_refused_by_name(monkeypatch):
    from flashmoe_science.integrations import versions

    monkeypatch.setattr(versions, "installed", lambda distribution: "5.99.0")
    manager = peaky_llama().init_continuous_batching(continuous_batching_config=hf.continuous_batching_config(16))
    with pytest.raises(RuntimeError, match=r"installed: transformers 5\.99\.0; .* supports transformers>=5\.24,<5\.26"):
        e4m3.use_e4m3_cache(manager, None)
