"""The FP8 (e4m3) number format as the attention kernels use it, shared by the front door (fp8.py) and the kernels
(triton_fp8.py): the largest finite value a scale maps onto, and the fixed random signs of the Hadamard rotation
(see fp8.py's docstring for the rotation)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
HADAMARD_SEED = 0x5EED


def hadamard_signs(head_dim: int, device) -> torch.Tensor:
    """The fixed random ±1 vector of the rotation (the same for Q and K, so it cancels in QKᵀ)."""
    gen = torch.Generator().manual_seed(HADAMARD_SEED + head_dim)
    return (torch.randint(0, 2, (head_dim,), generator=gen) * 2 - 1).to(device=device, dtype=torch.float32)
