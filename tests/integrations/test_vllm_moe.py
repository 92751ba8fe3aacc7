"""The vLLM MoE switch on the CPU, without vLLM (it pins a CUDA torch): what ``moe_config`` accepts and refuses, the
expert call against vLLM's unquantized MoE semantics written out in float64, and ``moe.py``'s method and
registration run against stand-ins of the vLLM 0.26 classes it subclasses (in a child process, so that no stand-in
``vllm`` module outlives the test). On a GPU with vLLM: ``tests/integrations/gpu_vllm_moe.py``.
"""

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.integrations.vllm import moe_config
from flashmoe_science.integrations.vllm.moe_config import LayerSettings, check_layer, check_settings, refusal
from flashmoe_science.integrations.vllm.switches import MOE_SWITCH

SRC = Path(__file__).resolve().parents[2] / "src"
BASE = LayerSettings(activation="silu", in_dtype=torch.bfloat16, num_experts=8, num_local_experts=8, tp_size=2)


def vllm_unquantized_moe(x, w13, w2, topk_weights, topk_ids):
    """vLLM's unquantized experts in float64: silu_and_mul on x @ w13[e].T ([gate | up] halves), @ w2[e].T,
    weighted by topk_weights and summed over the top-k slots."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    d_ff = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ x[t]
            out[t] += float(topk_weights[t, j]) * (w2[e] @ (F.silu(gate_up[:d_ff]) * gate_up[d_ff:]))
    return out


def vllm_grouped_topk(logits, top_k, num_groups, topk_group, bias, scaling):
    """vLLM's grouped_topk (DeepSeek-V3) with sigmoid scores, a correction bias, renormalisation and routed
    scaling: float32 weights, int32 ids."""
    scores = logits.sigmoid()
    biased = scores + bias
    group_scores = biased.view(logits.shape[0], num_groups, -1).topk(2, dim=-1)[0].sum(-1)
    groups = group_scores.topk(topk_group, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).repeat_interleave(logits.shape[1] // num_groups, 1)
    ids = biased.masked_fill(mask == 0, float("-inf")).topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    return (weights / weights.sum(-1, keepdim=True) * scaling).float(), ids.to(torch.int32)


def experts(num_experts, d, f, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * f, d, generator=g) * d ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, d, f, generator=g) * f ** -0.5).to(dtype)
    return w13, w2


# ------------------------------------------------------------------------------------------------ settings
def test_accepts_tensor_parallel_swiglu():
    assert refusal(BASE) is None
    check_settings(replace(BASE, in_dtype=torch.float16, moe_backend="humming"))


@pytest.mark.parametrize("change, named", [
    (dict(activation="gelu"), "activation='gelu'"),
    (dict(activation="swigluoai"), "activation='swigluoai'"),
    (dict(activation="silu_no_mul"), "activation='silu_no_mul'"),
    (dict(swiglu_limit=7.0), "swiglu_limit=7.0"),
    (dict(has_bias=True), "has_bias=True"),
    (dict(in_dtype=torch.float32), "dtype=torch.float32"),
    (dict(use_ep=True, ep_size=2, num_local_experts=4), "expert parallelism"),
    (dict(num_local_experts=4), "4 of 8 experts"),
    (dict(enable_eplb=True), "enable_eplb=True"),
    (dict(dp_size=2), "data_parallel_size=2"),
    (dict(pcp_size=2), "prefill_context_parallel_size=2"),
    (dict(sequence_parallel=True), "sequence-parallel MoE=True"),
    (dict(lora=True), "LoRA"),
    (dict(moe_backend="flashinfer_cutlass"), "moe_backend='flashinfer_cutlass'"),
    (dict(cuda=False), "not CUDA"),
])
def test_refuses_with_one_line_naming_the_setting(change, named):
    settings = replace(BASE, **change)
    assert named in refusal(settings)
    with pytest.raises(ValueError) as error:
        check_settings(settings)
    message = str(error.value)
    assert "\n" not in message and named in message
    assert message.startswith(f"{MOE_SWITCH}=1: ") and f"Unset {MOE_SWITCH}" in message


def test_check_layer_takes_vllms_loaded_weights():
    w13, w2 = experts(8, 64, 32)
    check_layer(w13, w2, num_experts=8, hidden_size=64, intermediate_size=32, in_dtype=torch.bfloat16)


@pytest.mark.parametrize("change, named", [
    (dict(expert_map=torch.arange(8, dtype=torch.int32)), "expert_map"),
    (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input=True"),
    (dict(w13=torch.zeros(8, 64, 64, dtype=torch.float8_e4m3fn)), "w13_weight is torch.float8_e4m3fn"),
    (dict(w2=torch.zeros(8, 64, 32)), "w2_weight is torch.float32"),
    (dict(w13=torch.zeros(8, 32, 64, dtype=torch.bfloat16)), "w13_weight has shape (8, 32, 64), expected (8, 64, 64)"),
    (dict(w2=torch.zeros(8, 32, 64, dtype=torch.bfloat16)), "w2_weight has shape (8, 32, 64), expected (8, 64, 32)"),
])
def test_check_layer_refuses(change, named):
    w13, w2 = experts(8, 64, 32)
    kwargs = dict(w13=w13, w2=w2, num_experts=8, hidden_size=64, intermediate_size=32, in_dtype=torch.bfloat16)
    kwargs.update(change)
    with pytest.raises(ValueError, match=f"^{MOE_SWITCH}=1: ") as error:
        check_layer(kwargs.pop("w13"), kwargs.pop("w2"), **kwargs)
    assert named in str(error.value)


# ---------------------------------------------------------------------------------------------- the call
@pytest.mark.parametrize("routing", ["softmax", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_run_experts_matches_vllms_semantics(routing, dtype):
    num_experts, d, f, top_k, tokens = 16, 64, 48, 4, 13
    w13, w2 = experts(num_experts, d, f, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d, generator=g).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g)
    if routing == "softmax":  # vLLM's fused_topk with renormalize: float32 weights, int32 ids
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        weights, ids = weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)
    else:
        bias = torch.randn(num_experts, generator=g) * 0.1
        weights, ids = vllm_grouped_topk(logits, top_k, num_groups=4, topk_group=2, bias=bias, scaling=2.5)
    out = moe_config.run_experts(x, w13, w2, weights, ids, backend="reference")
    expected = vllm_unquantized_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-2 * expected.abs().max().item(), rtol=0)


def test_the_default_backend_never_runs_the_host_synchronising_reference(monkeypatch):
    # the PyTorch reference reads routing ids on the host (a CUDA graph cannot capture it): without the Triton
    # kernels the call raises instead of falling back
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w13, w2 = experts(4, 32, 16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    weights, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="triton"):
        moe_config.run_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=f"^{MOE_SWITCH}=1: .*triton"):
        moe_config.check_plan(w13, w2, top_k=2)


def test_moe_config_and_switches_import_no_vllm():
    code = ("import sys; import flashmoe_science.integrations.vllm.moe_config, "
            "flashmoe_science.integrations.vllm.switches, flashmoe_science.integrations.engine_moe; "
            "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules, 'an engine imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=_child_env())


# ----------------------------------------------------------------------------- moe.py against stand-ins
# The vLLM 0.26 pieces moe.py touches, as vllm/model_executor/custom_op.py (CustomOp.__new__ builds the class
# registered out of tree under the class's name), fused_moe/fused_moe_method_base.py and
# fused_moe/unquantized_fused_moe_method.py define them; vLLM's own __init__ (its kernel selection) must not run.
STAND_INS = '''
import sys, types
import torch

def module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m

op_registry_oot = {}

class CustomOp(torch.nn.Module):
    def __new__(cls, *args, **kwargs):
        return super().__new__(op_registry_oot.get(cls.__name__, cls))

    def __init__(self, *, enforce_enable=False, compile_native=False):
        super().__init__()
        self._forward_method = self.forward_cuda

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    @classmethod
    def register_oot(cls, _decorated_op_cls=None, name=None):
        def decorator(op_cls):
            reg_name = name if name is not None else cls.__name__
            assert reg_name not in op_registry_oot, f"Duplicate op name: {reg_name}"
            op_cls.name = reg_name
            op_registry_oot[reg_name] = op_cls
            return op_cls
        return decorator if _decorated_op_cls is None else decorator(_decorated_op_cls)

class QuantizeMethodBase:
    def process_weights_after_loading(self, layer):
        return

class FusedMoEMethodBase(QuantizeMethodBase):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe
        self.moe_quant_config = None
        self.moe_kernel = None

class UnquantizedFusedMoEMethod(FusedMoEMethodBase, CustomOp):
    def __init__(self, moe):
        raise AssertionError("vLLM's backend selection ran")

    def get_fused_moe_quant_config(self, layer):
        return "unquantized quant config"

class Platform:
    def is_cuda(self):
        return True

module("vllm")
module("vllm.model_executor.custom_op", CustomOp=CustomOp, op_registry_oot=op_registry_oot)
module("vllm.model_executor.layers.fused_moe.fused_moe_method_base", FusedMoEMethodBase=FusedMoEMethodBase)
module("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
       UnquantizedFusedMoEMethod=UnquantizedFusedMoEMethod)
module("vllm.platforms", current_platform=Platform())
'''

GLUE = '''
from types import SimpleNamespace as NS
import torch
from flashmoe_science.integrations import engine_moe
from flashmoe_science.integrations.vllm.moe import FlashMoEUnquantizedMethod, register_moe
from flashmoe_science.moe.reference import fused_experts_reference

engine_moe.BACKEND = "reference"  # the CPU: the PyTorch reference stands in for the Triton kernels

def fused_moe_config(activation="silu", ep_size=1):
    parallel = NS(tp_size=1, dp_size=1, pcp_size=1, ep_size=ep_size, use_ep=ep_size > 1, is_sequence_parallel=False,
                  enable_eplb=False)
    return NS(activation=NS(value=activation), in_dtype=torch.bfloat16, num_experts=8, num_local_experts=8 // ep_size,
              moe_parallel_config=parallel, has_bias=False, is_lora_enabled=False, swiglu_limit=None,
              swiglu_alpha=None, swiglu_beta=None, moe_backend="auto", hidden_dim=64,
              intermediate_size_per_partition=32, experts_per_token=2)

register_moe()
register_moe()  # idempotent: vLLM may load its plugins more than once per process
method = UnquantizedFusedMoEMethod(fused_moe_config())  # as vLLM's RoutedExperts builds it
assert type(method) is FlashMoEUnquantizedMethod, type(method)
assert FlashMoEUnquantizedMethod.name == "UnquantizedFusedMoEMethod"
assert method.moe_kernel is None and not method.is_monolithic and not method.supports_eplb

g = torch.Generator().manual_seed(0)
layer = NS(w13_weight=(torch.randn(8, 64, 64, generator=g) / 8).bfloat16(),
           w2_weight=(torch.randn(8, 64, 32, generator=g) / 6).bfloat16(),
           expert_map=None, apply_router_weight_on_input=False, layer_name="model.layers.0.mlp.experts")
method.process_weights_after_loading(layer)
assert method.moe_quant_config == "unquantized quant config" and "reference" in method.kernel_plan

x = torch.randn(5, 64, generator=g).bfloat16()
weights = torch.rand(5, 2, generator=g)
ids = torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int32)
expected = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
out = method.apply(layer=layer, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                   shared_experts_input=None)
assert torch.equal(out, expected)
assert torch.equal(method(layer, x, weights, ids, None, None), expected)  # CustomOp's forward dispatch

for change, named in ((dict(activation="gelu"), "activation='gelu'"), (dict(ep_size=2), "expert parallelism")):
    try:
        UnquantizedFusedMoEMethod(fused_moe_config(**change))
    except ValueError as error:
        assert named in str(error), error
    else:
        raise AssertionError(f"{change} was not refused")
for change, named in ((dict(expert_map=torch.arange(8)), "expert_map"),
                      (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input")):
    try:
        method.process_weights_after_loading(NS(**{**vars(layer), **change}))
    except ValueError as error:
        assert named in str(error), error
    else:
        raise AssertionError(f"{change} was not refused")

import sys
sys.modules["vllm.model_executor.custom_op"].op_registry_oot["UnquantizedFusedMoEMethod"] = type("Other", (), {})
try:
    register_moe()
except RuntimeError as error:
    assert "already replaced" in str(error), error
else:
    raise AssertionError("a second replacement was not refused")
print("glue ok")
'''


def _child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env.pop("TRITON_INTERPRET", None)
    return env


def test_method_and_registration_against_vllm_stand_ins():
    code = textwrap.dedent(STAND_INS) + textwrap.dedent(GLUE)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env())
    assert result.returncode == 0 and "glue ok" in result.stdout, result.stdout + result.stderr
