"""TorchTitan 0.3.0 on torch 2.11: the two FSDP2 features it takes from torch >= 2.12, expressed with torch 2.11's.

TorchTitan 0.3.0 uses, from torch >= 2.12's ``fully_shard``:

1. ``torch.distributed.fsdp.DataParallelMeshDims``, imported at module level by ``torchtitan.distributed.fsdp`` and
   ``full_dtensor`` (so ``torchtitan.train`` fails to import without it), and passed to ``fully_shard`` only under
   ``parallelism.spmd_backend`` "full_dtensor" / "spmd_types". Torch 2.11 cannot run those backends; the class is
   provided for the import, and a job that would pass one is refused with a ValueError before anything is sharded.
2. Per-parameter meshes in one FSDP unit (``shard_placement_fn`` returning ``ShardPlacementResult(placement,
   mesh_info)``), used only under expert parallelism: in an MoE block the routed experts shard over the ``efsdp``
   mesh and everything else over ``fsdp``. Torch 2.11's ``fully_shard`` takes one mesh per unit, so the routed
   experts become their own FSDP unit on the ``efsdp`` mesh, inside the block's unit on ``fsdp`` (the block's unit
   skips parameters an inner unit already manages). The shards are the same as TorchTitan's: experts ``Shard(0)``
   over ``efsdp`` (``Shard(1)`` when ``efsdp * ep`` exceeds the expert count), all else ``Shard(0)`` over
   ``fsdp``; the mixed-precision policy and reshard policy are TorchTitan's. The expert unit all-gathers and
   reduce-scatters separately from its block; forward and backward prefetch name both units of the next block.

3. ``create_block_mask(separate_full_blocks=...)``: TorchTitan passes True (full blocks of a mask kept apart from
   partial ones, skipping the mask function there) except in its batch-invariant mode. Torch 2.11's
   ``create_block_mask`` always does that and has no such argument: True is dropped, False is refused.

4. ``torch.distributed.set_timeout(timeout, group)``, called after the first step to shorten every process group's
   timeout: torch 2.11 (and 2.13) has the same operation as ``distributed_c10d._set_pg_timeout``.
5. ``ChunkedLossWrapper`` (lm_head and loss per sequence chunk, each chunk's backward run inside the loss): with
   torch 2.11's FSDP2 the first chunk's backward reshards the final norm, grouped with lm_head in one FSDP unit,
   before the decoder's backward reaches it ("The tensor has a non-zero number of elements, but its data is not
   allocated yet"). No torch 2.11 API avoids that; a job with it is refused at build time, and
   ``CrossEntropyLoss`` (whole logits) is the loss to use.

6. ``torch.compiler._is_non_strict_tracing()``, asked by the token dispatcher before its all-to-alls: newer torch sets
   it inside its own non-strict make_fx tracing sessions, which torch 2.11 does not have, so on 2.11 it is False.

Everything else (model, EP all-to-all, optimizer, loss, gradient clipping over both meshes) is TorchTitan's own code.
With torch >= 2.12 :func:`install` changes nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.fsdp as torch_fsdp


def needed() -> bool:
    """Whether this torch's ``fully_shard`` lacks what TorchTitan 0.3.0 imports (torch < 2.12)."""
    return not hasattr(torch_fsdp, "DataParallelMeshDims")


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Torch >= 2.12's record of which named mesh axes FSDP shards over and replicates over (import only)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None


def _routed_experts(block):
    """The module holding a block's routed-expert weights, or None for a dense block."""
    if not getattr(block, "moe_enabled", False):
        return None
    return block.moe.routed_experts.inner_experts


def _set_prefetch(model) -> None:
    """Explicit FSDP prefetch under EP (as TorchTitan sets it: EP's device-to-host syncs defeat implicit
    prefetch), naming the expert unit of the next block beside the block."""
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


def _apply_fsdp_to_decoder_torch211(original):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

    def apply_fsdp_to_decoder(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=False,
                              reshard_after_forward_policy="default", ep_degree=1, edp_mesh=None,
                              dp_mesh_dims=None, edp_mesh_dims=None, enable_symm_mem=False):
        if dp_mesh_dims is not None or edp_mesh_dims is not None:
            raise ValueError("parallelism.spmd_backend 'full_dtensor' / 'spmd_types' needs torch >= 2.12 "
                             "(fully_shard's dp_mesh_dims); use spmd_backend 'partial_dtensor' on this torch")
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
        # ep_degree=1: TorchTitan's single-mesh path wraps each block (skipping the expert units above), the
        # embeddings, head and root, and turns off FSDP's gradient division on every unit, the expert ones too.
        original(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=cpu_offload,
                 reshard_after_forward_policy=reshard_after_forward_policy, ep_degree=1,
                 enable_symm_mem=enable_symm_mem)
        if ep_degree > 1:
            _set_prefetch(model)

    return apply_fsdp_to_decoder


def _create_block_mask_torch211(compiled_create_block_mask):
    def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise ValueError("create_block_mask(separate_full_blocks=False) (TorchTitan's batch-invariant mode) "
                             "needs torch >= 2.12")
        return compiled_create_block_mask(*args, **kwargs)

    return create_block_mask


def _refuse_chunked_loss(*_args, **_kwargs):
    raise ValueError("loss ChunkedLossWrapper needs torch >= 2.12 (its per-chunk backward frees the FSDP-sharded "
                     "final norm early on torch 2.11); use CrossEntropyLoss")


def install() -> None:
    """On torch < 2.12, make TorchTitan 0.3.0 importable and its FSDP2 + EP path run (module docstring); call
    before importing ``torchtitan.train`` or any TorchTitan model package."""
    if not needed():
        return
    torch_fsdp.DataParallelMeshDims = DataParallelMeshDims
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
    from torchtitan.components.loss import ChunkedLossWrapper

    ChunkedLossWrapper.set_lm_head = _refuse_chunked_loss
    import torchtitan.distributed.fsdp as titan_fsdp

    patched = _apply_fsdp_to_decoder_torch211(titan_fsdp.apply_fsdp_to_decoder)
    titan_fsdp.apply_fsdp_to_decoder = patched
    import torchtitan.models.common.attention as titan_attention

    titan_attention._compiled_create_block_mask = _create_block_mask_torch211(
        titan_attention._compiled_create_block_mask)
    # the model packages bind the name at import: install() runs before they are imported, so they bind ours
