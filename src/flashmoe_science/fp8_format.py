"""The e4m3 number format every FP8 path shares (attention, the KV cache, the MoE experts): the dtype and the largest
finite value a scale maps onto. Each path's own conventions (Hadamard signs, weight blocks) live in its
``fp8_format`` beside its kernels, which import these names from there."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
