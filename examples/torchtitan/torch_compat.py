"""TorchTitan 0.3.0 on torch 2.11 (and 2.13): what its trainer takes from a newer torch, expressed with the older one.

TorchTitan 0.3.0 follows torch's development branch. On torch 2.11 its trainer stops at these, each one provided
here only where this torch lacks it (:func:`install`), so on a torch that has them nothing changes:

1. ``torch.distributed.fsdp.DataParallelMeshDims``, imported at module level by ``torchtitan.distributed.fsdp`` and
   ``full_dtensor`` (so ``torchtitan.train`` fails to import), and passed to ``fully_shard`` only under
   ``parallelism.spmd_backend`` "full_dtensor" / "spmd_types". Without it ``fully_shard`` cannot run those
   backends: the class is provided for the import, and a job that would pass one is refused (ValueError) before
   anything is sharded; "partial_dtensor" is the backend to use.
2. Per-parameter meshes in one FSDP unit (``shard_placement_fn`` returning ``ShardPlacementResult(placement,
   mesh_info)``), used only under expert parallelism: in an MoE block the routed experts shard over the ``efsdp``
   mesh and everything else over ``fsdp``. Without it ``fully_shard`` takes one mesh per unit, so the routed
   experts become their own FSDP unit on the ``efsdp`` mesh, inside the block's unit on ``fsdp`` (which skips
   parameters an inner unit manages). The shards are TorchTitan's: experts ``Shard(0)`` over ``efsdp``
   (``Shard(1)`` when ``efsdp * ep`` exceeds the expert count), the rest ``Shard(0)`` over ``fsdp``, with its
   mixed-precision and reshard policies. The expert unit all-gathers and reduce-scatters apart from its block;
   forward and backward prefetch name both units of the next block. On 4 CPU ranks (gloo) a Qwen3-MoE trained
   with FSDP 4 + EP 4 this way gives the losses and gradient norms of FSDP 4 alone to 5 digits.
3. ``ChunkedLossWrapper`` (lm_head and loss per sequence chunk, each chunk's backward run inside the loss): with the
   FSDP2 of item 2 the first chunk's backward reshards the final norm, grouped with lm_head in one FSDP unit,
   before the decoder's backward reaches it ("The tensor has a non-zero number of elements, but its data is not
   allocated yet"; seen on torch 2.11, not on 2.13). A job with it is refused when it is built (ValueError);
   ``CrossEntropyLoss`` (whole logits) is the loss to use.
4. ``create_block_mask(separate_full_blocks=...)``: TorchTitan passes True (full blocks of a mask kept apart from
   partial ones, skipping the mask function there) except in its batch-invariant mode. Without the argument
   ``create_block_mask`` always does that: True is dropped, False is refused.
5. ``torch.distributed.set_timeout(timeout, group)``, called after the first step to shorten every process group's
   timeout: the same operation is ``distributed_c10d._set_pg_timeout``.
6. ``torch.compiler._is_non_strict_tracing()``, asked by the token dispatcher before its all-to-alls: a newer torch
   sets it while its own non-strict make_fx tracing runs, which an older torch does not have: False.

Everything else (model, EP all-to-all, optimizer, loss, gradient clipping over both meshes) is TorchTitan's code.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.nn.attention.flex_attention import create_block_mask


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """A newer torch's record of which named mesh axes FSDP shards and replicates over (for the import only)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None


def _has_per_parameter_meshes() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "ShardPlacementResult")


def missing() -> list[str]:
    """What of the module docstring's list this torch lacks (empty: :func:`install` changes nothing)."""
    gaps = []
    if not hasattr(torch_fsdp, "DataParallelMeshDims"):
        gaps.append("DataParallelMeshDims")
    if not _has_per_parameter_meshes():
        gaps += ["per-parameter FSDP meshes", "ChunkedLossWrapper"]
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        gaps.append("create_block_mask(separate_full_blocks)")
    if not hasattr(torch.distributed, "set_timeout"):
        gaps.append("torch.distributed.set_timeout")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        gaps.append("torch.compiler._is_non_strict_tracing")
    return gaps


def _routed_experts(block):
    """The module holding a block's routed-expert weights, or None for a dense block."""
    if not getattr(block, "moe_enabled", False):
        return None
    return block.moe.routed_experts.inner_experts


def _set_prefetch(model) -> None:
    """Explicit FSDP prefetch under EP, as TorchTitan sets it (EP's device-to-host syncs defeat implicit prefetch),
    naming the expert unit of the next block beside the block."""
    blocks = list(model.layers.values())

    def units(block):
        experts = _routed_experts(block)
        return [block] if experts is None else [block, experts]

    has_head = model.norm is not None and model.lm_head is not None
    if model.tok_embeddings is not None and blocks:
        model.tok_embeddings.set_modules_to_forward_prefetch(units(blocks[0]))
    for block, nxt in zip(blocks, blocks[1:] + [None]):
        if nxt is not None:
            block.set_modules_to_forward_prefetch(units(nxt))
        elif has_head:
            block.set_modules_to_forward_prefetch([model.norm, model.lm_head])
    if has_head and blocks:
        model.lm_head.set_modules_to_backward_prefetch(units(blocks[-1]))
    for block, prev in zip(blocks[::-1], blocks[::-1][1:] + [None]):
        if prev is not None:
            block.set_modules_to_backward_prefetch(units(prev))
        elif model.tok_embeddings is not None:
            block.set_modules_to_backward_prefetch([model.tok_embeddings])


def _apply_fsdp_to_decoder_one_mesh_per_unit(original):
    """TorchTitan's ``apply_fsdp_to_decoder`` where ``fully_shard`` takes one mesh per unit (item 2)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.tools.logging import logger

    def apply_fsdp_to_decoder(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=False,
                              reshard_after_forward_policy="default", ep_degree=1, edp_mesh=None,
                              dp_mesh_dims=None, edp_mesh_dims=None, enable_symm_mem=False):
        if dp_mesh_dims is not None or edp_mesh_dims is not None:
            raise ValueError("parallelism.spmd_backend 'full_dtensor' / 'spmd_types' needs fully_shard's "
                             "dp_mesh_dims (torch >= 2.12); use spmd_backend 'partial_dtensor' on this torch")
        if ep_degree > 1:
            if edp_mesh is None:
                raise ValueError("ep_degree > 1 needs edp_mesh (TorchTitan's efsdp mesh)")
            if cpu_offload:
                raise ValueError("training.enable_cpu_offload with expert parallelism needs torch >= 2.12")
            reshard = get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy, pp_enabled)
            mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                             cast_forward_inputs=False)
            for block in model.layers.values():
                experts = _routed_experts(block)
                if experts is None:
                    continue
                dim = 1 if edp_mesh["efsdp"].size() * ep_degree > experts.num_experts else 0
                fully_shard(experts, mesh=edp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                            shard_placement_fn=lambda _param, _dim=dim: Shard(_dim))
        # ep_degree=1: TorchTitan's single-mesh path wraps each block (around the expert units above), the
        # embeddings, head and root, and turns off FSDP's gradient division on every unit, expert units included
        original(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=cpu_offload,
                 reshard_after_forward_policy=reshard_after_forward_policy, ep_degree=1,
                 enable_symm_mem=enable_symm_mem)
        if ep_degree > 1:
            _set_prefetch(model)
            logger.info("Applied FSDP to the routed experts as their own units on the efsdp mesh (torch_compat)")

    return apply_fsdp_to_decoder


def _refuse_chunked_loss(*_args, **_kwargs):
    raise ValueError("loss ChunkedLossWrapper needs torch >= 2.12's FSDP2 (its per-chunk backward frees the "
                     "sharded final norm before the decoder's backward); use CrossEntropyLoss")


def _create_block_mask_without_separate_full_blocks(compiled_create_block_mask):
    def create(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise ValueError("create_block_mask(separate_full_blocks=False) (TorchTitan's batch-invariant mode) "
                             "needs torch >= 2.12")
        return compiled_create_block_mask(*args, **kwargs)

    return create


def install() -> list[str]:
    """Provide what :func:`missing` lists; call before importing ``torchtitan.train`` or a TorchTitan model package
    (they bind ``apply_fsdp_to_decoder`` when imported). Returns what was provided."""
    gaps = missing()
    if "DataParallelMeshDims" in gaps:
        torch_fsdp.DataParallelMeshDims = DataParallelMeshDims
    if "per-parameter FSDP meshes" in gaps:
        import torchtitan.distributed.fsdp as titan_fsdp
        from torchtitan.components.loss import ChunkedLossWrapper

        titan_fsdp.apply_fsdp_to_decoder = _apply_fsdp_to_decoder_one_mesh_per_unit(titan_fsdp.apply_fsdp_to_decoder)
        ChunkedLossWrapper.set_lm_head = _refuse_chunked_loss
    if "create_block_mask(separate_full_blocks)" in gaps:
        import torchtitan.models.common.attention as titan_attention

        titan_attention._compiled_create_block_mask = _create_block_mask_without_separate_full_blocks(
            titan_attention._compiled_create_block_mask)
    if "torch.distributed.set_timeout" in gaps:
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    if "torch.compiler._is_non_strict_tracing" in gaps:
        torch.compiler._is_non_strict_tracing = lambda: False
    return gaps
