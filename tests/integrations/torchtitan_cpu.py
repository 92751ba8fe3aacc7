"""TorchTitan's trainer on CPU ranks (gloo), for tests: tiny versions of ``examples/torchtitan/flashmoe_jobs.py``.

    torchrun --nproc-per-node 2 tests/integrations/torchtitan_cpu.py --module torchtitan_cpu --config moe_flash ...

TorchTitan 0.3.0 assumes an accelerator, so before the trainer is imported: its device type is "cpu" and
``torch.cpu`` gets the device-module functions its trainer and memory monitor call (no memory statistics); gloo has
no ``PREMUL_SUM``, so FSDP2 reduces with a plain sum and divides itself (TorchTitan sets the factor to 1);
``flex_attention`` has no CPU backward, so TorchTitan's Flex attention runs its own mask function as a dense mask
in SDPA's math kernel. With ``FLASHMOE_ONE_MESH_PER_UNIT=1`` TorchTitan's FSDP2 + EP wrapping is
``torch_compat``'s (item 2 of its docstring) even on a torch that has per-parameter meshes.
"""

import os
import sys
import types
from pathlib import Path

import torch

torch._utils._get_available_device_type = lambda: "cpu"  # before TorchTitan reads it (when imported)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "torchtitan"
sys.path.insert(0, str(EXAMPLES))

import torch_compat  # noqa: E402

torch_compat.install()
if os.environ.get("FLASHMOE_ONE_MESH_PER_UNIT") == "1" and "per-parameter FSDP meshes" not in torch_compat.missing():
    # before the model packages are imported: they bind apply_fsdp_to_decoder when imported
    from torchtitan.distributed import fsdp

    fsdp.apply_fsdp_to_decoder = torch_compat._apply_fsdp_to_decoder_one_mesh_per_unit(fsdp.apply_fsdp_to_decoder)

import flashmoe_jobs  # noqa: E402
from local_text import VOCAB_SIZE  # noqa: E402
from titan_models import llama3_spec, qwen3_moe_spec  # noqa: E402


def _moe():
    return qwen3_moe_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32, num_experts=8,
                          top_k=2, vocab_size=VOCAB_SIZE, max_seq_len=128, attn_backend="flex")


def _llama():
    return llama3_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=VOCAB_SIZE,
                       max_seq_len=128, attn_backend="flex")


def moe_titan():
    return flashmoe_jobs._job(_moe(), lr=1e-3, batch=2, seq_len=128, overrides=[])


def moe_flash():
    return flashmoe_jobs._job(_moe(), lr=1e-3, batch=2, seq_len=128, overrides=flashmoe_jobs.FLASH)


def moe_flash_titan_dispatch():  # under expert parallelism TorchTitan's dispatcher instead of our exchange
    return flashmoe_jobs._job(_moe(), lr=1e-3, batch=2, seq_len=128,
                              overrides=[(flashmoe_jobs.FLASH[0], {"exchange": "titan"})])


def llama_titan():
    return flashmoe_jobs._job(_llama(), lr=1e-3, batch=2, seq_len=128, overrides=[])


def llama_flash():
    return flashmoe_jobs._job(_llama(), lr=1e-3, batch=2, seq_len=128, overrides=flashmoe_jobs.FLASH)


def _on_cpu() -> None:
    cpu = torch.cpu
    cpu.get_device_name = lambda *_: "cpu"
    cpu.get_device_properties = lambda *_: types.SimpleNamespace(total_memory=1 << 34)
    cpu.memory_stats = lambda *_: {}
    cpu.reset_peak_memory_stats = lambda *_: None
    cpu.empty_cache = lambda *_: None
    cpu.current_device = lambda: 0

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_then_divide(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                        force_sum_reduction_for_comms=False):
        return divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor,
                              force_sum_reduction_for_comms=True)

    _fsdp_collectives._get_gradient_divide_factors = sum_then_divide

    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.models.common import attention

    def dense_flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux, **_):
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, None

    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex)
    # eager create_block_mask: no inductor compile on the CPU
    if "create_block_mask(separate_full_blocks)" in torch_compat.missing():
        create_block_mask = torch_compat._create_block_mask_without_separate_full_blocks(create_block_mask)
    attention._compiled_create_block_mask = create_block_mask


if __name__ == "__main__":
    _on_cpu()
    from torchtitan.train import main

    main()
