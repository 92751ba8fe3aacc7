"""Our fused MoE as SGLang's kernel for unquantized MoE layers (SGLang 0.5.17; ``FLASHMOE_SCIENCE_SGLANG_MOE=1``).

`register_moe()` registers `FlashMoEUnquantizedMethod`, a subclass of SGLang's ``UnquantizedFusedMoEMethod`` (the
method of every ``FusedMoE`` layer without a quantization method: Qwen3-MoE, Mixtral, DeepSeek-style models in
bf16/fp16), as a class ``REPLACE`` hook of SGLang's plugin hook registry. SGLang's ``load_plugins()`` runs the
plugins' ``register`` and then applies the registered hooks, in each process that calls it: the launcher
(``Engine.__init__``, ``launch_server``) and, first thing, each scheduler process (``run_scheduler_process``: one per
tensor-parallel rank), which builds the model and runs its forwards. Applying the hook rebinds the class in
``sglang.srt.layers.quantization.unquant`` and in every module that imported it (``FusedMoE``'s, the quantization
configs' for their unquantized layers), so each unquantized MoE layer built afterwards holds our method. Quantized
layers keep theirs.

The contract, per forward: ``FusedMoE.forward_impl`` dispatches with SGLang's standard dispatcher (the tokens stay;
the router's ``StandardTopKOutput``, float32 weights and int32 ids after top-k, renormalisation, scoring, correction
bias and any fused shared experts, passes through) and calls ``apply(layer, dispatch_output)``; ours returns
``StandardCombineInput`` of ``fused_experts(x, w13_weight, w2_weight, weights, ids)`` times the layer's
``routed_scaling_factor``: what SGLang's triton runner returns on CUDA, where that runner, not the router nor the
model, applies the factor. The output is a new tensor (where ``inplace``, SGLang's runner writes it into
``hidden_states``; the callers read the returned one). The model adds the shared experts and all-reduces. The call
makes no host synchronisation (the ``triton`` backend), so it runs under SGLang's CUDA graphs.

Refused, with one line naming the setting (`refusal`): at model construction (``create_moe_runner``), another
activation than gated SiLU, ``gemm1_alpha``/``gemm1_clamp_limit``/``swiglu_limit``, expert biases, dtypes other than
bf16/fp16, expert parallelism, LoRA, router weights applied on the input, ``no_combine``, a ``--moe-runner-backend``
other than auto/triton, a ``--moe-a2a-backend`` other than none, MoE data parallelism and DP attention, KTransformers'
CPU experts, a platform other than CUDA; at weight processing, weights of another dtype or shape, shapes the kernels
cannot take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.layers.moe import get_moe_a2a_backend, get_moe_runner_backend
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.quantization import unquant
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_parallel, get_server_args
from sglang.srt.utils import is_cuda

from flashmoe_science.integrations import engine_moe
from flashmoe_science.integrations.sglang import MOE_SWITCH

logger = logging.getLogger(__name__)

SWITCH = engine_moe.Switch(MOE_SWITCH, "SGLang")
TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod"
# --moe-runner-backend values under which SGLang runs an unquantized layer on its triton runner, the one ours replaces
RUNNER_BACKENDS = ("auto", "triton")


@dataclass(frozen=True)
class LayerSettings:
    """An SGLang MoE layer's settings that decide whether our kernel computes what SGLang's triton runner would: its
    ``MoeRunnerConfig``, its parallel sizes, the server's MoE backends and options, the platform."""

    num_experts: int  # with any fused shared experts and redundant copies
    num_local_experts: int
    params_dtype: torch.dtype
    activation: str = "silu"
    is_gated: bool = True
    gemm1_alpha: float | None = None
    gemm1_clamp_limit: float | None = None
    swiglu_limit: float | None = None
    with_bias: bool = False
    apply_router_weight_on_input: bool = False
    no_combine: bool = False
    ep_size: int = 1
    moe_dp_size: int = 1
    dp_attention: bool = False
    lora: bool = False
    kt_experts: bool = False  # --kt-weight-path: KTransformers' wrapper runs the CPU experts around the method
    runner_backend: str = "auto"
    a2a_backend: str = "none"
    cuda: bool = True


def layer_settings(config, layer, server_args, *, runner_backend: str, a2a_backend: str, moe_dp_size: int,
                   cuda: bool) -> LayerSettings:
    """The settings of ``layer`` (a ``FusedMoE``) with its ``MoeRunnerConfig`` ``config`` under ``server_args``."""
    return LayerSettings(
        num_experts=config.num_experts, num_local_experts=config.num_local_experts, params_dtype=config.params_dtype,
        activation=config.activation, is_gated=config.is_gated, gemm1_alpha=config.gemm1_alpha,
        gemm1_clamp_limit=config.gemm1_clamp_limit, swiglu_limit=config.swiglu_limit, with_bias=layer.with_bias,
        apply_router_weight_on_input=config.apply_router_weight_on_input, no_combine=config.no_combine,
        ep_size=layer.moe_ep_size, moe_dp_size=moe_dp_size, dp_attention=bool(server_args.enable_dp_attention),
        lora=bool(server_args.enable_lora), kt_experts=server_args.kt_weight_path is not None,
        runner_backend=runner_backend, a2a_backend=a2a_backend, cuda=cuda)


def refusal(settings: LayerSettings) -> str | None:
    """Why our kernel cannot run this layer as SGLang's triton runner would (one phrase naming the setting), or
    None."""
    s = settings
    reason = engine_moe.expert_refusal(
        "SGLang", cuda=s.cuda, activation=s.activation, gated=s.is_gated, in_dtype=s.params_dtype,
        num_experts=s.num_experts, num_local_experts=s.num_local_experts, ep_size=s.ep_size,
        ep_hint="run with --ep-size 1", has_bias=s.with_bias, bias_setting="with_bias", lora=s.lora,
        apply_router_weight_on_input=s.apply_router_weight_on_input,
        swiglu_options=dict(gemm1_alpha=s.gemm1_alpha, gemm1_clamp_limit=s.gemm1_clamp_limit,
                            swiglu_limit=s.swiglu_limit))
    if reason is not None:
        return reason
    if s.no_combine:
        return "no_combine=True: the kernel returns the top-k outputs summed, not one per expert"
    if s.runner_backend not in RUNNER_BACKENDS:
        return (f"--moe-runner-backend {s.runner_backend} asks for another of SGLang's kernels (the switch replaces "
                "the triton runner: run with --moe-runner-backend triton)")
    if s.a2a_backend != "none":
        return f"--moe-a2a-backend {s.a2a_backend}: the switch runs SGLang's standard dispatcher only"
    if s.moe_dp_size > 1 or s.dp_attention:
        return (f"--moe-dp-size {s.moe_dp_size}, --enable-dp-attention={s.dp_attention}: the switch runs tensor "
                "parallelism only")
    if s.kt_experts:
        return "--kt-weight-path: KTransformers' CPU experts wrap the method"
    return None


class FlashMoEUnquantizedMethod(unquant.UnquantizedFusedMoEMethod):
    """SGLang's unquantized MoE method with our kernel for the routed experts (see the module's docstring)."""

    kernel_plan = ""  # the kernels' plan at weight processing (engine_moe.check_plan), for logs

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        settings = layer_settings(moe_runner_config, layer, get_server_args(),
                                  runner_backend=get_moe_runner_backend().value,
                                  a2a_backend=get_moe_a2a_backend().value, moe_dp_size=get_parallel().moe_dp_size,
                                  cuda=is_cuda())
        SWITCH.check(refusal(settings))
        # SGLang's runner object is built (no kernel: its triton runner core) and never run: code that reads the
        # layer's runner (its backend, the overlap arguments) finds what it expects
        super().create_moe_runner(layer, moe_runner_config)

    @property
    def load_up_proj_weight_first(self) -> bool:
        return False  # the kernel takes w13's gate rows first

    def process_weights_after_loading(self, layer) -> None:
        # the weights stay as SGLang loaded them (fused_experts' layout); a reload writes into the same parameters
        config = self.moe_runner_config
        engine_moe.check_layer(SWITCH, layer.w13_weight, layer.w2_weight, num_experts=config.num_local_experts,
                               hidden_size=config.hidden_size,
                               intermediate_size=config.intermediate_size_per_partition, in_dtype=config.params_dtype)
        self.kernel_plan = engine_moe.check_plan(SWITCH, layer.w13_weight, layer.w2_weight, config.top_k)
        logger.debug("%s: %s", getattr(layer, "layer_name", "MoE layer"), self.kernel_plan)

    def forward_cuda(self, layer, dispatch_output):
        topk_weights, topk_ids, _ = dispatch_output.topk_output  # a StandardTopKOutput, as SGLang's runner reads it
        out = engine_moe.run_experts(dispatch_output.hidden_states, layer.w13_weight, layer.w2_weight, topk_weights,
                                     topk_ids, self.moe_runner_config.routed_scaling_factor)
        return StandardCombineInput(hidden_states=out)

    # SGLang's torch.compile modes switch a MultiPlatformOp to forward_native (this class's name has no "FusedMoE",
    # which would pick SGLang's native MoE instead); fused_experts runs under torch.compile as a custom op
    forward_native = forward_cuda


_registered = False


def register_moe() -> None:
    """Register `FlashMoEUnquantizedMethod` in place of SGLang's ``UnquantizedFusedMoEMethod`` (idempotent); SGLang's
    ``load_plugins`` applies it once the plugins ran. RuntimeError where another class already replaced SGLang's."""
    global _registered
    current = unquant.UnquantizedFusedMoEMethod
    if _registered or current is FlashMoEUnquantizedMethod:
        return
    original = FlashMoEUnquantizedMethod.__base__
    if current is not original:
        raise RuntimeError(f"{MOE_SWITCH}=1: SGLang's {original.__name__} is already replaced by "
                           f"{current.__module__}.{current.__qualname__}; unset {MOE_SWITCH} or remove the other "
                           "plugin")
    HookRegistry.register(TARGET, FlashMoEUnquantizedMethod, HookType.REPLACE)
    _registered = True
    logger.info("%s=1: SGLang's unquantized MoE layers run on flashmoe-science's fused_experts", MOE_SWITCH)
