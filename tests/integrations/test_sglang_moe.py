"""The SGLang MoE switch on the CPU, without SGLang (it pins a CUDA torch): what ``integrations.sglang.moe`` accepts
and refuses of layers shaped as SGLang 0.5.17 builds them (``MoeRunnerConfig``'s fields, ``FusedMoE``'s attributes,
the server's MoE options), and the method itself on stand-ins of the SGLang modules it imports (its class hook, the
layer's construction order, weight processing, the forward); the forward's Triton kernels under TRITON_INTERPRET=1
(a child process) against the float64 reference with SGLang's triton-runner semantics: the routed scaling factor
applied to the summed experts, ids of padded tokens (-1) adding nothing. On a GPU with SGLang:
``python3 tests/integrations/gpu_sglang_backend.py moe``.
"""

import importlib
import os
import subprocess
import sys
import types
from collections import defaultdict
from dataclasses import replace
from enum import Enum
from pathlib import Path
from types import SimpleNamespace as NS
from typing import NamedTuple

import pytest
import torch

from flashmoe_science.integrations import engine_moe
from flashmoe_science.integrations.sglang import MOE_SWITCH
from flashmoe_science.moe.reference import fused_experts_reference
from interpreter_driver import interpreter_suite, run_marked_suite

SRC = Path(__file__).resolve().parents[2] / "src"
MODULE = "flashmoe_science.integrations.sglang.moe"
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreted = pytest.mark.skipif(not IN_INTERPRETER,
                                 reason="runs in the TRITON_INTERPRET=1 child process of test_sglang_moe.py")
E, D, F, TOP_K = 8, 64, 32, 2


@interpreter_suite(__file__)
def test_forward_kernels_in_interpreter_child(request):
    if IN_INTERPRETER:
        pytest.skip("already under TRITON_INTERPRET=1: the cases run in this process")
    print(f"TRITON_INTERPRET=1 child: {run_marked_suite(request)}")


# ------------------------------------------------------------------------- stand-ins of SGLang 0.5.17's pieces
class HookType(Enum):  # sglang/srt/plugins/hook_registry.py
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class HookRegistry:
    """SGLang's registry as a class ``REPLACE`` uses it: ``load_plugins`` runs the plugins' ``register``, then
    ``apply_hooks`` sets the target's module attribute to the replacement."""

    _hooks = defaultdict(list)

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER):
        cls._hooks[target].append((hook_type, hook))

    @classmethod
    def apply_hooks(cls):
        for target, hooks in cls._hooks.items():
            module, name = target.rsplit(".", 1)
            replacements = [hook for hook_type, hook in hooks if hook_type is HookType.REPLACE]
            setattr(sys.modules[module], name, replacements[-1])


class StandardTopKOutput(NamedTuple):  # sglang/srt/layers/moe/topk.py
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class StandardCombineInput(NamedTuple):  # sglang/srt/layers/moe/token_dispatcher/standard.py
    hidden_states: torch.Tensor


class UnquantizedFusedMoEMethod(torch.nn.Module):
    """sglang/srt/layers/quantization/unquant.py's method as ours meets it: a MultiPlatformOp whose ``forward``
    calls the method picked at construction (``forward_cuda`` on CUDA; ``forward_native`` once SGLang's torch.compile
    modes switch a class without "FusedMoE" in its name), ``create_weights`` registering the (E, 2F, d) and (E, d, F)
    parameters, ``create_moe_runner`` keeping the config and building SGLang's runner. Its own kernels must not run."""

    def __init__(self, use_triton_kernels=False, use_flashinfer_trtllm_moe=False, use_deep_gemm=False):
        super().__init__()
        self._forward_method = self.forward_cuda
        self.use_triton_kernels, self.with_bias = use_triton_kernels, False

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       with_bias=False, **extra_weight_attrs):
        self.with_bias = with_bias
        shapes = {"w13_weight": (num_experts, 2 * intermediate_size_per_partition, hidden_size),
                  "w2_weight": (num_experts, hidden_size, intermediate_size_per_partition)}
        for name, shape in shapes.items():
            layer.register_parameter(name, torch.nn.Parameter(torch.empty(shape, dtype=params_dtype),
                                                              requires_grad=False))

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        self.runner = "SGLang's triton runner"

    def process_weights_after_loading(self, layer):
        raise AssertionError("SGLang's weight processing ran")

    def apply(self, layer, dispatch_output):
        return self.forward(layer=layer, dispatch_output=dispatch_output)

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def enter_torch_compile(self, num_tokens):
        assert "FusedMoE" not in type(self).__name__, "SGLang would run its native MoE at one token"
        self._forward_method = self.forward_native

    def forward_cuda(self, layer, dispatch_output):
        raise AssertionError("SGLang's triton runner ran")

    def forward_cpu(self, layer, dispatch_output):
        raise AssertionError("SGLang's native MoE ran")

    forward_native = forward_cpu


ENGINE = NS(runner_backend="auto", a2a_backend="none", moe_dp_size=1, cuda=True,
            server_args=NS(enable_dp_attention=False, enable_lora=None, kt_weight_path=None))


@pytest.fixture
def sglang_moe(monkeypatch):
    """``integrations.sglang.moe`` imported against stand-in SGLang modules (removed after the test)."""
    stubs = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe", "sglang.srt.layers.moe.token_dispatcher",
        "sglang.srt.layers.quantization", "sglang.srt.layers.quantization.unquant", "sglang.srt.plugins",
        "sglang.srt.plugins.hook_registry", "sglang.srt.runtime_context", "sglang.srt.utils")}
    engine = NS(**{**vars(ENGINE), "server_args": NS(**vars(ENGINE.server_args))})
    stubs["sglang.srt.layers.moe"].__dict__.update(
        get_moe_runner_backend=lambda: NS(value=engine.runner_backend),
        get_moe_a2a_backend=lambda: NS(value=engine.a2a_backend))
    stubs["sglang.srt.layers.moe.token_dispatcher"].StandardCombineInput = StandardCombineInput
    stubs["sglang.srt.layers.quantization"].unquant = stubs["sglang.srt.layers.quantization.unquant"]
    stubs["sglang.srt.layers.quantization.unquant"].UnquantizedFusedMoEMethod = UnquantizedFusedMoEMethod
    registry = type("HookRegistry", (HookRegistry,), {"_hooks": defaultdict(list)})
    stubs["sglang.srt.plugins.hook_registry"].__dict__.update(HookRegistry=registry, HookType=HookType)
    stubs["sglang.srt.runtime_context"].__dict__.update(get_parallel=lambda: NS(moe_dp_size=engine.moe_dp_size),
                                                        get_server_args=lambda: engine.server_args)
    stubs["sglang.srt.utils"].is_cuda = lambda: engine.cuda
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    module = importlib.import_module(MODULE)
    yield NS(moe=module, engine=engine, registry=registry, unquant=stubs["sglang.srt.layers.quantization.unquant"])
    sys.modules.pop(MODULE, None)


def _runner_config(**changes):
    """A ``MoeRunnerConfig`` (sglang/srt/layers/moe/moe_runner/base.py: all its fields) as ``FusedMoE`` fills it for
    a Qwen3-MoE layer on one rank."""
    config = dict(num_experts=E, num_local_experts=E, hidden_size=D, intermediate_size_per_partition=F, layer_id=0,
                  top_k=TOP_K, num_fused_shared_experts=0, params_dtype=torch.bfloat16, routing_method_type=None,
                  activation="silu", is_gated=True, apply_router_weight_on_input=False, inplace=True,
                  no_combine=False, routed_scaling_factor=None, gemm1_alpha=None, gemm1_clamp_limit=None,
                  swiglu_limit=None, gate_up_interleaved=True, layer=None, use_tp_all_gather_activation=False)
    config.update(changes)
    return NS(**config)


def _build_layer(stand_ins, config, with_bias=False, moe_ep_size=1):
    """``FusedMoE.__init__``'s steps: the unquantized method of the class SGLang's module holds now, its weights,
    its runner."""
    layer = torch.nn.Module()
    layer.with_bias, layer.moe_ep_size, layer.layer_name = with_bias, moe_ep_size, "model.layers.0.mlp.experts"
    layer.moe_runner_config = config
    layer.quant_method = stand_ins.unquant.UnquantizedFusedMoEMethod(False, False, False)
    layer.quant_method.create_weights(layer=layer, num_experts=config.num_local_experts, hidden_size=D,
                                      intermediate_size_per_partition=F, params_dtype=config.params_dtype,
                                      with_bias=with_bias)
    layer.quant_method.create_moe_runner(layer, config)
    return layer


def _registered(stand_ins):
    stand_ins.moe.register_moe()
    stand_ins.registry.apply_hooks()


def _load_weights(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=g) * D ** -0.5)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=g) * F ** -0.5)
    layer.quant_method.process_weights_after_loading(layer)


def _dispatch(tokens, dtype, seed=1, pad=0):
    """SGLang's standard dispatch output: the tokens, and the router's float32 weights and int32 ids; the last
    ``pad`` tokens are CUDA-graph padding (ids -1, as SGLang's top-k masks them)."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(TOP_K, dim=-1)
    ids = ids.to(torch.int32)
    ids[tokens - pad:] = -1
    topk = StandardTopKOutput(weights / weights.sum(-1, keepdim=True), ids, torch.zeros(tokens, E))
    return NS(hidden_states=torch.randn(tokens, D, generator=g).to(dtype), hidden_states_scale=None,
              topk_output=topk)


def _on(dispatch, device):
    topk = StandardTopKOutput(*(t.to(device) for t in dispatch.topk_output))
    return NS(hidden_states=dispatch.hidden_states.to(device), hidden_states_scale=None, topk_output=topk)


def _sglang_triton(layer, dispatch, routed_scaling_factor):
    """What SGLang's triton runner computes, in float64: the weighted sum of each token's SwiGLU experts (w13's first
    half the gate), ids outside the experts adding nothing, times the routed scaling factor."""
    weights, ids, _ = dispatch.topk_output
    out = fused_experts_reference(dispatch.hidden_states.double(), layer.w13_weight.double(),
                                  layer.w2_weight.double(), weights.double(), ids)
    return out * (1.0 if routed_scaling_factor is None else routed_scaling_factor)


# --------------------------------------------------------------------------------------------------- settings
BASE_SETTINGS = dict(num_experts=E, num_local_experts=E, params_dtype=torch.bfloat16)


def test_layer_settings_read_sglangs_objects(sglang_moe):
    config = _runner_config(params_dtype=torch.float16, routed_scaling_factor=2.5, num_fused_shared_experts=1)
    layer = NS(with_bias=True, moe_ep_size=2)
    server_args = NS(enable_dp_attention=True, enable_lora=None, kt_weight_path="/kt")
    got = sglang_moe.moe.layer_settings(config, layer, server_args, runner_backend="triton", a2a_backend="deepep",
                                        moe_dp_size=2, cuda=False)
    assert got == sglang_moe.moe.LayerSettings(
        num_experts=E, num_local_experts=E, params_dtype=torch.float16, with_bias=True, ep_size=2, moe_dp_size=2,
        dp_attention=True, lora=False, kt_experts=True, runner_backend="triton", a2a_backend="deepep", cuda=False)


def test_accepts_unquantized_swiglu_layers(sglang_moe):
    settings = sglang_moe.moe.LayerSettings(**BASE_SETTINGS)
    assert sglang_moe.moe.refusal(settings) is None
    for change in (dict(params_dtype=torch.float16), dict(runner_backend="triton"), dict(num_experts=E + 1,
                                                                                         num_local_experts=E + 1)):
        assert sglang_moe.moe.refusal(replace(settings, **change)) is None, change


@pytest.mark.parametrize("change, named", [
    (dict(activation="gelu"), "activation='gelu'"),
    (dict(activation="situ"), "activation='situ'"),
    (dict(is_gated=False), "is_gated=False"),
    (dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0), "gemm1_alpha=1.702, gemm1_clamp_limit=7.0"),
    (dict(swiglu_limit=10.0), "swiglu_limit=10.0"),
    (dict(with_bias=True), "with_bias=True"),
    (dict(params_dtype=torch.float32), "dtype=torch.float32"),
    (dict(ep_size=2, num_local_experts=4), "expert parallelism (ep_size=2, 4 of 8 experts"),
    (dict(lora=True), "LoRA"),
    (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input=True"),
    (dict(no_combine=True), "no_combine=True"),
    (dict(runner_backend="flashinfer_trtllm"), "--moe-runner-backend flashinfer_trtllm"),
    (dict(runner_backend="triton_kernel"), "--moe-runner-backend triton_kernel"),
    (dict(runner_backend="deep_gemm"), "--moe-runner-backend deep_gemm"),
    (dict(runner_backend="flashinfer_cutlass"), "--moe-runner-backend flashinfer_cutlass"),
    (dict(a2a_backend="deepep"), "--moe-a2a-backend deepep"),
    (dict(moe_dp_size=2), "--moe-dp-size 2"),
    (dict(dp_attention=True), "--enable-dp-attention=True"),
    (dict(kt_experts=True), "--kt-weight-path"),
    (dict(cuda=False), "not CUDA"),
])
def test_refuses_with_one_line_naming_the_setting(sglang_moe, change, named):
    settings = sglang_moe.moe.LayerSettings(**{**BASE_SETTINGS, **change})
    assert named in sglang_moe.moe.refusal(settings)
    with pytest.raises(ValueError) as error:
        sglang_moe.moe.SWITCH.check(sglang_moe.moe.refusal(settings))
    message = str(error.value)
    assert "\n" not in message and named in message
    assert message.startswith(f"{MOE_SWITCH}=1: ") and f"Unset {MOE_SWITCH} to run SGLang's own" in message


def test_only_moe_imports_sglang():
    code = ("import sys; import flashmoe_science.integrations.sglang, flashmoe_science.integrations.engine_moe; "
            "assert 'sglang' not in sys.modules, 'sglang imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------------------------ the method on stand-ins
def test_register_replaces_sglangs_class_once(sglang_moe):
    moe, original = sglang_moe.moe, UnquantizedFusedMoEMethod
    moe.register_moe()
    moe.register_moe()  # idempotent: one hook
    assert dict(sglang_moe.registry._hooks) == {moe.TARGET: [(HookType.REPLACE, moe.FlashMoEUnquantizedMethod)]}
    assert moe.TARGET == "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod"
    assert moe.FlashMoEUnquantizedMethod.__base__ is original
    sglang_moe.registry.apply_hooks()
    assert sglang_moe.unquant.UnquantizedFusedMoEMethod is moe.FlashMoEUnquantizedMethod
    moe.register_moe()  # applied: nothing more to do
    assert len(sglang_moe.registry._hooks[moe.TARGET]) == 1


def test_register_refuses_a_class_another_plugin_replaced(sglang_moe):
    sglang_moe.unquant.UnquantizedFusedMoEMethod = type("OtherMethod", (UnquantizedFusedMoEMethod,), {})
    with pytest.raises(RuntimeError, match="already replaced by .*OtherMethod"):
        sglang_moe.moe.register_moe()


def test_the_plugin_registers_the_method_only_with_the_switch(sglang_moe, monkeypatch):
    from flashmoe_science.integrations import sglang as plugin
    from flashmoe_science.integrations import versions

    attention = types.ModuleType("sglang.srt.layers.attention.attention_registry")
    attention.ATTENTION_BACKENDS = {}
    attention.register_attention_backend = lambda name: lambda factory: attention.ATTENTION_BACKENDS.update(
        {name: factory})
    arguments = types.ModuleType("sglang.srt.server_args")
    arguments.ATTENTION_BACKEND_CHOICES = []
    arguments.add_attention_backend_choices = arguments.ATTENTION_BACKEND_CHOICES.extend
    for module in (attention, arguments, types.ModuleType("sglang.srt.layers.attention")):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(versions, "installed", lambda distribution: "0.5.17")
    monkeypatch.delenv(MOE_SWITCH, raising=False)
    plugin.register()
    assert plugin.NAME in attention.ATTENTION_BACKENDS and not sglang_moe.registry._hooks
    monkeypatch.setenv(MOE_SWITCH, "1")
    plugin.register()
    assert sglang_moe.registry._hooks[sglang_moe.moe.TARGET] == [(HookType.REPLACE,
                                                                  sglang_moe.moe.FlashMoEUnquantizedMethod)]


def test_construction_refuses_what_the_kernel_cannot_run(sglang_moe):
    _registered(sglang_moe)
    for change, named in ((dict(activation="gelu"), "activation='gelu'"), (dict(no_combine=True), "no_combine"),
                          (dict(gemm1_clamp_limit=7.0), "gemm1_clamp_limit=7.0")):
        with pytest.raises(ValueError, match=f"^{MOE_SWITCH}=1: .*{named}"):
            _build_layer(sglang_moe, _runner_config(**change))
    with pytest.raises(ValueError, match="with_bias=True"):
        _build_layer(sglang_moe, _runner_config(), with_bias=True)
    with pytest.raises(ValueError, match="expert parallelism"):
        _build_layer(sglang_moe, _runner_config(num_local_experts=E // 2), moe_ep_size=2)
    for engine_change, named in ((dict(runner_backend="flashinfer_trtllm"), "--moe-runner-backend"),
                                 (dict(a2a_backend="deepep"), "--moe-a2a-backend"), (dict(cuda=False), "not CUDA")):
        saved = {name: getattr(sglang_moe.engine, name) for name in engine_change}
        vars(sglang_moe.engine).update(engine_change)
        with pytest.raises(ValueError, match=named):
            _build_layer(sglang_moe, _runner_config())
        vars(sglang_moe.engine).update(saved)
    sglang_moe.engine.server_args.enable_lora = True
    with pytest.raises(ValueError, match="LoRA"):
        _build_layer(sglang_moe, _runner_config())


def test_weight_processing_refuses_other_weights(sglang_moe, monkeypatch):
    monkeypatch.setattr(engine_moe, "BACKEND", "reference")
    _registered(sglang_moe)
    layer = _build_layer(sglang_moe, _runner_config())
    _load_weights(layer)
    assert "reference" in layer.quant_method.kernel_plan
    layer.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * F, D, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=f"^{MOE_SWITCH}=1: .*w13_weight is torch.float8_e4m3fn"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.w13_weight = torch.nn.Parameter(torch.zeros(E, F, D, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(ValueError, match=r"w13_weight has shape \(8, 32, 64\), expected \(8, 64, 64\)"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("routed_scaling_factor", [None, 2.5])
def test_method_returns_what_sglangs_runner_returns(sglang_moe, monkeypatch, routed_scaling_factor):
    # on the CPU the PyTorch reference stands in for the Triton kernels (the interpreter cases below run them)
    monkeypatch.setattr(engine_moe, "BACKEND", "reference")
    _registered(sglang_moe)
    layer = _build_layer(sglang_moe, _runner_config(routed_scaling_factor=routed_scaling_factor))
    method = layer.quant_method
    assert type(method) is sglang_moe.moe.FlashMoEUnquantizedMethod and not method.load_up_proj_weight_first
    assert method.runner == "SGLang's triton runner"
    _load_weights(layer)
    dispatch = _dispatch(7, torch.bfloat16, pad=2)
    hidden = dispatch.hidden_states.clone()
    combined = method.apply(layer=layer, dispatch_output=dispatch)
    assert isinstance(combined, StandardCombineInput) and combined.hidden_states.dtype == torch.bfloat16
    expected = _sglang_triton(layer, dispatch, routed_scaling_factor)
    torch.testing.assert_close(combined.hidden_states.double(), expected, atol=2e-2 * expected.abs().max().item(),
                               rtol=0)
    assert combined.hidden_states[-2:].abs().max() == 0  # padded tokens
    assert torch.equal(dispatch.hidden_states, hidden)  # a new tensor: the input is left as it was
    method.enter_torch_compile(num_tokens=1)  # SGLang's torch.compile modes
    assert torch.equal(method.apply(layer=layer, dispatch_output=dispatch).hidden_states, combined.hidden_states)


# ------------------------------------------------------------------ the Triton kernels (TRITON_INTERPRET=1 child)
@interpreted
@pytest.mark.parametrize("tokens, pad, routed_scaling_factor", [(0, 0, None), (1, 0, 2.5), (5, 1, None),
                                                                 (33, 3, 2.5)])
def test_forward_on_the_triton_kernels_matches_float64(sglang_moe, tokens, pad, routed_scaling_factor):
    # float16: the interpreter's bfloat16 dot is broken (tests/attention/test_decode_interpreter.py)
    _registered(sglang_moe)
    layer = _build_layer(sglang_moe, _runner_config(params_dtype=torch.float16,
                                                    routed_scaling_factor=routed_scaling_factor))
    _load_weights(layer)
    assert "triton" in layer.quant_method.kernel_plan
    dispatch = _dispatch(tokens, torch.float16, pad=pad)
    out = layer.quant_method.apply(layer=layer, dispatch_output=dispatch).hidden_states
    expected = _sglang_triton(layer, dispatch, routed_scaling_factor)
    assert out.dtype == torch.float16 and out.shape == (tokens, D)
    scale = expected.abs().amax().item() if tokens else 1.0
    torch.testing.assert_close(out.double(), expected, atol=4e-3 * scale, rtol=0)


# ------------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routed_scaling_factor", [None, 2.5])
def test_forward_on_a_gpu_matches_float64_and_replays_in_a_cuda_graph(sglang_moe, routed_scaling_factor):
    _registered(sglang_moe)
    layer = _build_layer(sglang_moe, _runner_config(routed_scaling_factor=routed_scaling_factor)).to("cuda")
    _load_weights(layer)
    assert "triton" in layer.quant_method.kernel_plan
    method = layer.quant_method

    def check(out, dispatch):
        expected = _sglang_triton(layer, dispatch, routed_scaling_factor)
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        torch.testing.assert_close(out.double(), expected, atol=2e-2 * expected.abs().amax().item(), rtol=0)

    for tokens, pad in ((1, 0), (7, 2), (300, 4)):  # the decode kernel, then the grouped GEMMs
        dispatch = _on(_dispatch(tokens, torch.bfloat16, pad=pad), "cuda")
        check(method.apply(layer=layer, dispatch_output=dispatch).hidden_states, dispatch)
    # as SGLang's decode CUDA graphs: captured on static inputs, replayed on new values copied into them
    static = _on(_dispatch(8, torch.bfloat16, seed=2), "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        method.apply(layer=layer, dispatch_output=static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = method.apply(layer=layer, dispatch_output=static).hidden_states
    fresh = _on(_dispatch(8, torch.bfloat16, seed=3, pad=1), "cuda")
    static.hidden_states.copy_(fresh.hidden_states)
    static.topk_output.topk_weights.copy_(fresh.topk_output.topk_weights)
    static.topk_output.topk_ids.copy_(fresh.topk_output.topk_ids)
    graph.replay()
    torch.cuda.synchronize()
    check(captured, fresh)
