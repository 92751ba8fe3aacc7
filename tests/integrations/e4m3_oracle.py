"""The greedy tokens a model gives when its attention sees its keys and values as an e4m3 KV cache holds them: full
float64 forwards (no cache), keys and values rounded through e4m3 with the cache's scales (`hf_e4m3_cache.KVScales`)
by the decode kernels' rule (`attention.decode.reference.quantize_to_cache`) and multiplied back."""

import copy

import torch

from flashmoe_science.attention.decode.reference import quantize_to_cache

IMPLEMENTATION = "e4m3_oracle"


def _rounded_attention(scales):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, mask, **kwargs):
        if scales is not None:
            k_scale, v_scale = (s.double() for s in scales.layer(module.layer_idx))
            key, value = ((quantize_to_cache(t.transpose(1, 2), s).double() * s[:, None]).transpose(1, 2)
                          for t, s in ((key, k_scale), (value, v_scale)))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    return attention


def oracle(model, prompts, new_tokens, scales=None) -> list[list[int]]:
    """Greedy tokens per prompt of a float64 copy of ``model`` (unrounded keys and values when ``scales`` is None)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _rounded_attention(scales))
    reference = copy.deepcopy(model).double()  # its own config: the attention implementation is set on it
    reference.set_attn_implementation(IMPLEMENTATION)
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(reference(input_ids=torch.tensor([ids], device=model.device),
                                         use_cache=False).logits[0, -1].argmax()))
            tokens.append(ids[len(prompt):])
    return tokens
