"""Megatron-core's MoE ``experts`` on our fused grouped GEMMs: :class:`FlashExperts`.

Megatron's token dispatchers (``allgather``, ``alltoall``) hand the experts module the rows for this rank's
experts grouped by local expert, the per-expert counts ``tokens_per_expert`` (on the host or the device),
and each row's router probability. ``SequentialMLP`` (the local spec) loops over the experts with two linears each
and applies the probability after the activation; this module stores every local expert's weights stacked and runs
them in one ``grouped_experts`` call (gather, the up GEMM with SwiGLU in its epilogue, the down GEMM with the
probability-weighted combine). The probability scales the down projection's input in Megatron and its output here:
the same product, the down GEMM being linear without a bias.

Parameters, per rank: ``weight1`` ``(local experts, 2·F/etp, hidden)``, rows ``[gate; up]`` (the layout of each
expert's ``linear_fc1.weight`` in ``SequentialMLP``: Megatron keeps every expert-tensor-parallel rank's gate and up
halves together) and ``weight2`` ``(local experts, hidden, F/etp)`` (``linear_fc2.weight``), F the
``moe_ffn_hidden_size``. Under expert tensor parallelism each rank computes its slice of F and returns a partial sum,
as ``SequentialMLP``'s expert linears do; Megatron's dispatcher reduces it. :meth:`FlashExperts.copy_from` loads a
``SequentialMLP``'s weights. Megatron's distributed checkpointing (``sharded_state_dict``) is not mapped (refused);
``state_dict`` works.

Refused when built (``ValueError`` naming the config field): activations other than SwiGLU (``gated_linear_unit``
with ``activation_func=F.silu``), linear biases, FP8/FP4, ``moe_latent_size``, clamped or offset GLUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule

from flashmoe_science.moe import grouped_experts


def check_config(config) -> None:
    """The config fields this module cannot honour, refused by name."""
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        raise ValueError("FlashExperts computes SwiGLU experts: set gated_linear_unit=True and "
                         "activation_func=torch.nn.functional.silu")
    if config.add_bias_linear:
        raise ValueError("FlashExperts has no expert biases: set add_bias_linear=False")
    if config.fp8 or getattr(config, "fp4", None):
        raise ValueError("FlashExperts runs bf16/fp16/fp32 experts: fp8 and fp4 must be unset")
    if getattr(config, "moe_latent_size", None) is not None:
        raise ValueError("FlashExperts does not take moe_latent_size")
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
        raise ValueError("FlashExperts computes the plain SwiGLU: activation_func_clamp_value must be None and "
                         "glu_linear_offset 0")


def _groups(pg_collection):
    """(expert-parallel size, expert-tensor-parallel size, tensor-parallel size) of this rank's groups."""
    if pg_collection is not None:
        return pg_collection.ep.size(), pg_collection.expt_tp.size(), pg_collection.tp.size()
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size())


class FlashExperts(MegatronModule):
    """Megatron-core's experts module (``SequentialMLP``'s constructor and forward) on ``grouped_experts``; see the
    module docstring. ``backend``: our experts' backend ("auto": Triton on a GPU, the PyTorch reference on the CPU).
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name=None,
                 backend: str = "auto"):
        super().__init__(config=config)
        check_config(config)
        ep, etp, tp = _groups(pg_collection)
        ffn = config.moe_ffn_hidden_size
        if ffn % etp:
            raise ValueError(f"moe_ffn_hidden_size={ffn} must divide by the expert tensor parallel size {etp}")
        self.num_local_experts, self.backend = num_local_experts, backend
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        shape1 = (num_local_experts, 2 * ffn // etp, config.hidden_size)
        shape2 = (num_local_experts, config.hidden_size, ffn // etp)
        self.weight1 = torch.nn.Parameter(torch.empty(shape1, dtype=config.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(shape2, dtype=config.params_dtype, device=device))
        # as Megatron's expert linears: split over the expert-TP group, reduced over expert data parallel where
        # the expert groups differ from the dense ones
        for weight, dim in ((self.weight1, 1), (self.weight2, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
            weight.allreduce = not (ep > 1 or etp != tp)
        if config.perform_initialization:
            self._initialize(config)

    @torch.no_grad()
    def _initialize(self, config) -> None:
        """Each expert's weights drawn as Megatron's expert linears draw theirs (its init methods, on the GPU under
        the expert-parallel RNG stream, so expert-parallel ranks draw different experts)."""
        def draw():
            for expert in range(self.num_local_experts):
                config.init_method(self.weight1[expert])
                config.output_layer_init_method(self.weight2[expert])

        if config.use_cpu_initialization:
            draw()
        else:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                draw()

    @torch.no_grad()
    def copy_from(self, sequential_mlp) -> "FlashExperts":
        """Loads a ``SequentialMLP``'s expert weights (the local spec's experts, same config and ranks)."""
        experts = sequential_mlp.local_experts
        if len(experts) != self.num_local_experts:
            raise ValueError(f"sequential_mlp has {len(experts)} local experts, this module {self.num_local_experts}")
        for index, expert in enumerate(experts):
            self.weight1[index].copy_(expert.linear_fc1.weight)
            self.weight2[index].copy_(expert.linear_fc2.weight)
        return self

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, routing_map=None, output_buffer=None, grad_input_buffer=None):
        """``(output, None)``: the rows' expert outputs (partial sums under expert tensor parallelism), no bias.
        ``routing_map`` (Megatron's inference dispatcher passes it) is not needed; the zero-copy buffers of
        Megatron's NCCL-EP dispatcher are refused (the output is a new tensor)."""
        if output_buffer is not None or grad_input_buffer is not None:
            raise ValueError("FlashExperts does not write into output_buffer/grad_input_buffer (NCCL-EP zero-copy "
                             "dispatch); use the allgather or alltoall token dispatcher")
        x = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:  # top-1 routing: the probability scales the input instead
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = None
        out = grouped_experts(x, self.weight1.to(x.dtype), self.weight2.to(x.dtype), tokens_per_expert,
                              permuted_probs, backend=self.backend)
        return out, None

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: the weight gradients are computed in the backward itself."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        raise NotImplementedError("FlashExperts does not map its weights for Megatron's distributed checkpointing; "
                                  "save with state_dict()")
