"""Our fused MoE as vLLM's kernel for unquantized MoE layers (vLLM 0.26; ``FLASHMOE_SCIENCE_VLLM_MOE=1``).

``register_moe()`` replaces vLLM's ``UnquantizedFusedMoEMethod`` (the CustomOp "unquantized_fused_moe", the method
of every MoE layer without a quantization method: Qwen3-MoE, Mixtral and other SwiGLU MoE models in bf16/fp16) by
`FlashMoEUnquantizedMethod`, through ``CustomOp.register_oot``: vLLM builds the subclass wherever it builds its own.
Quantized layers keep their methods. Call it before the model is built (the plugin's ``register()`` does).

The contract, per forward: vLLM's MoE runner, inside its ``moe_forward`` custom op (opaque to torch.compile),
routes the tokens with vLLM's router (grouped top-k, renormalisation, scoring function, score-correction bias,
routed scaling) and calls ``apply(layer, x, topk_weights, topk_ids, ...)``; the method returns the routed experts'
weighted sum from ``fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)``, on the weights as
vLLM loaded them. The runner runs the shared experts (the method holds no vLLM kernel, so they are never handed to
it), scales, adds and all-reduces across tensor-parallel ranks. The call makes no host synchronisation (the
``triton`` backend: never the PyTorch reference), so it runs under CUDA graphs.

Refused, with one line naming the setting (``moe_config.refusal``): at model construction, another activation than
SwiGLU, biases, SwiGLU clamps, dtypes other than bf16/fp16, expert parallelism and EPLB, data/context/sequence
parallelism, MoE LoRA, a ``moe_backend`` other than "auto", a platform other than CUDA; at weight processing, an
expert map, router weights applied on the input, weights of another dtype or shape, shapes the kernels cannot take.
"""

from __future__ import annotations

import logging

from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.platforms import current_platform

from flashmoe_science.integrations.vllm import moe_config

logger = logging.getLogger(__name__)


def layer_settings(moe) -> moe_config.LayerSettings:
    """A vLLM ``FusedMoEConfig``'s settings that our kernel depends on."""
    parallel = moe.moe_parallel_config
    return moe_config.LayerSettings(
        activation=moe.activation.value, in_dtype=moe.in_dtype, num_experts=moe.num_experts,
        num_local_experts=moe.num_local_experts, tp_size=parallel.tp_size, dp_size=parallel.dp_size,
        pcp_size=parallel.pcp_size, ep_size=parallel.ep_size, use_ep=parallel.use_ep,
        sequence_parallel=parallel.is_sequence_parallel, enable_eplb=parallel.enable_eplb, has_bias=moe.has_bias,
        lora=moe.is_lora_enabled, swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
        swiglu_beta=moe.swiglu_beta, moe_backend=moe.moe_backend, cuda=current_platform.is_cuda())


class FlashMoEUnquantizedMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with our kernel for the routed experts (see the module's docstring)."""

    def __init__(self, moe):
        # vLLM's base setup without vLLM's kernel selection: no vLLM kernel is built or held (moe_kernel stays None)
        FusedMoEMethodBase.__init__(self, moe)
        moe_config.check_settings(layer_settings(moe))
        self.unquantized_backend = None
        self.experts_cls = None
        self.kernel_plan = ""  # the kernels' plan at weight processing (moe_config.check_plan), for logs

    @property
    def is_monolithic(self) -> bool:
        return False  # vLLM routes, then calls apply

    @property
    def supports_eplb(self) -> bool:
        return False

    def process_weights_after_loading(self, layer) -> None:
        # the weights stay as vLLM loaded them (fused_experts' layout); a reload writes into the same parameters
        moe = self.moe
        moe_config.check_layer(layer.w13_weight, layer.w2_weight, num_experts=moe.num_local_experts,
                               hidden_size=moe.hidden_dim, intermediate_size=moe.intermediate_size_per_partition,
                               in_dtype=moe.in_dtype, expert_map=layer.expert_map,
                               apply_router_weight_on_input=layer.apply_router_weight_on_input)
        self.kernel_plan = moe_config.check_plan(layer.w13_weight, layer.w2_weight, moe.experts_per_token)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        logger.debug("%s: %s", getattr(layer, "layer_name", "MoE layer"), self.kernel_plan)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return moe_config.run_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)

    # CustomOp's dispatch (forward) is not used by vLLM's runner for this method; kept consistent with apply
    def forward_native(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return self.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    forward_cuda = forward_native


def register_moe() -> None:
    """Make vLLM build `FlashMoEUnquantizedMethod` for its unquantized MoE layers (idempotent). RuntimeError where
    another out-of-tree class already replaces vLLM's method."""
    name = UnquantizedFusedMoEMethod.__name__
    current = op_registry_oot.get(name)
    if current is FlashMoEUnquantizedMethod:
        return
    if current is not None:
        raise RuntimeError(f"{moe_config.MOE_SWITCH}=1: vLLM's {name} is already replaced by "
                           f"{current.__module__}.{current.__qualname__}; unset {moe_config.MOE_SWITCH} or remove "
                           "the other plugin")
    UnquantizedFusedMoEMethod.register_oot(FlashMoEUnquantizedMethod)
