"""Layer specs with our core attention and experts: :func:`get_gpt_layer_flash_spec` and :func:`with_flash_modules`.

A Megatron-core ``TransformerLayer`` spec names its core attention at ``submodules.self_attention.submodules.
core_attention`` and, for MoE layers, its experts at ``submodules.mlp``'s ``MoESubmodules.experts``. Specs nest
``ModuleSpec`` dataclasses or ``functools.partial`` builders (the MLP entries since 0.17);
both are copied here with the two entries replaced, the rest (norms, linears, router, shared experts, dispatcher)
kept as the given spec has them.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from flashmoe_science.integrations.megatron.attention import FlashCoreAttention
from flashmoe_science.integrations.megatron.experts import FlashExperts


def _submodules(entry):
    if isinstance(entry, ModuleSpec):
        return entry.submodules
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return None


def _with_submodules(entry, submodules):
    """``entry`` (a ModuleSpec or a partial builder) with its submodules replaced."""
    if isinstance(entry, ModuleSpec):
        return dataclasses.replace(entry, submodules=submodules)
    return functools.partial(entry.func, *entry.args, **{**entry.keywords, "submodules": submodules})


def with_flash_modules(layer_spec: ModuleSpec, attention: str | None = "auto", experts: str | None = "auto"):
    """A copy of ``layer_spec`` (a ``TransformerLayer`` spec) with :class:`FlashCoreAttention` as its core attention
    where ``attention`` names a backend, and :class:`FlashExperts` as its MoE experts where ``experts`` does (a
    dense layer's MLP is kept); None keeps the spec's module."""
    for name, value in (("attention", attention), ("experts", experts)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a backend name or None, got {type(value).__name__}")
    layer = layer_spec.submodules
    if layer is None or not hasattr(layer, "self_attention"):
        raise ValueError("layer_spec must be a TransformerLayer spec (submodules with self_attention and mlp)")
    changes = {}
    if attention is not None:
        attn = _submodules(layer.self_attention)
        if attn is None or not hasattr(attn, "core_attention"):
            raise ValueError("layer_spec's self_attention has no core_attention entry to replace")
        core = ModuleSpec(module=FlashCoreAttention, params={"backend": attention})
        changes["self_attention"] = _with_submodules(layer.self_attention,
                                                     dataclasses.replace(attn, core_attention=core))
    moe = _submodules(layer.mlp)
    if experts is not None and isinstance(moe, MoESubmodules):
        flash = ModuleSpec(module=FlashExperts, params={"backend": experts})
        changes["mlp"] = _with_submodules(layer.mlp, dataclasses.replace(moe, experts=flash))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer, **changes))


def get_gpt_layer_flash_spec(num_experts: int | None = None, normalization: str | None = "RMSNorm",
                             qk_layernorm: bool = False, attention: str | None = "auto",
                             experts: str | None = "auto") -> ModuleSpec:
    """Megatron-core's ``get_gpt_layer_local_spec(num_experts, normalization=..., qk_layernorm=...)`` with our core
    attention and (for ``num_experts``) our experts: :func:`with_flash_modules` of the local spec."""
    local = get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization,
                                     qk_layernorm=qk_layernorm)
    return with_flash_modules(local, attention=attention, experts=experts)
