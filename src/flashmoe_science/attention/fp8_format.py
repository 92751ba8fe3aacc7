"""The FP8 (e4m3) number format as the attention kernels use it, shared by the front door (fp8.py) and the kernels
(triton/fp8.py, triton/decode.py): the largest finite value a scale maps onto (the package's ``fp8_format``), and
the fixed random signs of the Hadamard rotation (see fp8.py's docstring for the rotation)."""

from __future__ import annotations

import torch

from flashmoe_science.fp8_format import FP8_MAX  # noqa: F401  (the kernels here read it from this module)

HADAMARD_SEED = 0x5EED


def hadamard_signs(head_dim: int, device) -> torch.Tensor:
    """The fixed random ±1 vector of the rotation (the same for Q and K, so it cancels in QKᵀ)."""
    gen = torch.Generator().manual_seed(HADAMARD_SEED + head_dim)
    return (torch.randint(0, 2, (head_dim,), generator=gen) * 2 - 1).to(device=device, dtype=torch.float32)
