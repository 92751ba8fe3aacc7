"""Rung 4, hopper: the same algorithm, with the GPU's parts working at the same time instead of taking turns.

The library's Gluon sm_90 kernel (`attention/hopper/fwd_sm90.py`), called through the front door with
``backend="hopper"``. On the previous rung one warp issues a load, waits, issues a product, waits, computes the
softmax, issues the next product: the copy engine, the tensor cores and the CUDA cores take turns. Hopper gives
each its own instruction stream:

* TMA: one thread describes a whole K or V tile and the copy engine moves it into shared memory, signalling an
  mbarrier when it lands; a producer warp keeps a ring of such tiles in flight.
* warp specialisation: the producer warp only loads (and gives most of its registers to the others); two consumer
  warpgroups of 64 query rows each only compute, so one's softmax runs while the other's products do.
* wgmma: asynchronous tensor-core products on 64-row warpgroup tiles, operands read straight from shared memory;
  a warpgroup issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}, then computes the softmax of S_j while the tensor
  cores are still busy with P_{j-1} V_{j-1}.
* persistent CTAs: one per SM, each looping over work items, so the next item's Q loads under the current one.

None of this changes the arithmetic: the FLOPs and HBM bytes are those of `tiled_tensor_cores`; what rises is
the fraction of time the tensor cores are busy.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.ladder.inputs import check_inputs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v by the Gluon sm_90 kernel (Hopper GPUs, bf16/fp16; elsewhere a ValueError says
    why not)."""
    scale = check_inputs(q, k, v, softmax_scale)
    return flash_attention_science(q, k, v, causal=bool(causal), softmax_scale=scale, backend="hopper")
