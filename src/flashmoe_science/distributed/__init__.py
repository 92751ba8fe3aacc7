"""Beyond one GPU through `torch.distributed`: context-parallel ring attention and expert-parallel MoE.

- `ring_attention`: one sequence sharded zig-zag over a process group (`zigzag_shard` / `zigzag_unshard` /
  `zigzag_positions`), K/V passed around the ring, partial results merged by log-sum-exp; forward and backward.
  `ring_attention_varlen`: the same for packed sequences of different lengths (``cu_seqlens``).
- `ExpertParallelMoE` / `expert_parallel_experts`: experts sharded over a process group, tokens exchanged with
  all-to-all, the local experts run by `fused_experts`; forward and backward.

Run under `torchrun` (NCCL on GPUs) or any initialised process group (gloo on CPUs).
"""

from flashmoe_science.distributed.expert_parallel import ExpertParallelMoE, expert_bounds, expert_parallel_experts
from flashmoe_science.distributed.ring_attention import ring_attention, ring_attention_varlen
from flashmoe_science.distributed.zigzag import zigzag_positions, zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "ring_attention_varlen", "zigzag_shard", "zigzag_unshard", "zigzag_positions", "ExpertParallelMoE",
           "expert_parallel_experts", "expert_bounds"]
