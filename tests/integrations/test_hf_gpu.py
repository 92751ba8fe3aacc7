"""attn_implementation=hf.ATTN_IMPLEMENTATION on the GPU in bf16 (H200: `pytest -m gpu tests/integrations`): logits
and gradients of small Llama, Qwen3-MoE and Mixtral models (MoE blocks swapped for FusedMoE) against the same models
in float64, the error within twice that of the `sdpa` models in bf16, with and without padding."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import batch, converted_copy, logits_and_grads, model_pair  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "mixtral", "mistral_window", "gemma2_softcap"])
def test_bf16_error_within_twice_sdpa(name, padding):
    # The reference in float64, except for eager models (soft-capping): their softmax runs in float32, where the
    # float64 mask value (finfo.min) becomes -inf, so a padded query row with no visible key turns NaN and the NaN
    # reaches every gradient; float32 (finite mask value, error ~1e-6 against bf16's ~1e-2) is their reference.
    reference_dtype = torch.float32 if name == "gemma2_softcap" else torch.float64
    sdpa64, _, _ = model_pair(name, dtype=reference_dtype, device=DEVICE)
    sdpa16 = copy.deepcopy(sdpa64).to(torch.bfloat16)
    ours16, params16 = converted_copy(sdpa16)
    ids, mask = batch(padding, device=DEVICE)
    want_logits, want_grads = logits_and_grads(sdpa64, dict(sdpa64.named_parameters()), ids, mask)
    sdpa_logits, sdpa_grads = logits_and_grads(sdpa16, dict(sdpa16.named_parameters()), ids, mask)
    ours_logits, ours_grads = logits_and_grads(ours16, params16, ids, mask)

    def error(got, want):
        return (got.double() - want).abs().max().item()

    assert error(ours_logits, want_logits) <= 2 * error(sdpa_logits, want_logits) + 1e-2
    for param_name, want in want_grads.items():
        assert error(ours_grads[param_name], want) <= 2 * error(sdpa_grads[param_name], want) + 1e-2, param_name
