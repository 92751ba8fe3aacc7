"""TorchTitan's Llama 3 and Qwen3-MoE with our modules (its override registry) against its own modules, same weights.

TorchTitan's FlexAttention layer is the attention reference, with TorchTitan's per-document causal mask: its mask
function is evaluated into a dense mask for SDPA's math kernel in float64 (``flex_attention`` has no backward on
the CPU). TorchTitan's
``GroupedExperts`` rounds activations and weights to bfloat16 whatever the model's dtype, so the MoE model is
compared at that precision, and the routed-experts layer alone exactly, in float64, against TorchTitan's own token
dispatch and combine around TorchTitan's ``FeedForward`` run expert by expert.
"""

import copy
import dataclasses
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("torchtitan")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "torchtitan"
sys.path.insert(0, str(EXAMPLES))
import torch_compat  # noqa: E402

torch_compat.install()  # TorchTitan's model packages import what torch 2.11 lacks

from torch.nn.attention.flex_attention import create_block_mask, create_mask  # noqa: E402
from torchtitan.config import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common import attention as titan_attention  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

from flashmoe_science.integrations import torchtitan as ours  # noqa: E402

def _titan_models():
    return importlib.import_module("titan_models")


def _dense_flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux, **_):
    """``flex_attention`` with ``block_mask``'s mask function as a dense boolean mask (SDPA math, any dtype)."""
    assert not return_aux.lse
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                            enable_gqa=enable_gqa), None


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(titan_attention.FlexAttention, "_compiled_flex_attn", _dense_flex)
    eager = create_block_mask
    if "create_block_mask(separate_full_blocks)" in torch_compat.missing():
        eager = torch_compat._create_block_mask_without_separate_full_blocks(create_block_mask)
    monkeypatch.setattr(titan_attention, "_compiled_create_block_mask", eager)


def _with_overrides(spec, **kwargs):
    """``spec``'s model config with ``flash_decoder`` applied (``kwargs``: its keywords) as a job's override.imports
    apply it (the model config under its ModelSpec, as under the trainer's config)."""
    spec = dataclasses.replace(spec, model=copy.deepcopy(spec.model))
    target = f"{ours.__name__}.flash_decoder"
    apply_overrides(OverrideConfig(imports=[(target, kwargs) if kwargs else target]), spec)
    return spec.model


def _pair(spec, dtype, **kwargs):
    """TorchTitan's model (initialised) and ours with its weights, both in ``dtype``."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # not .to(dtype): that would drop the imaginary part of complex RoPE buffers
    try:
        reference = spec.model.build()
        reference.init_states()
        model = _with_overrides(spec, **kwargs).build()
    finally:
        torch.set_default_dtype(default)
    model.load_state_dict(reference.state_dict())  # same names and shapes: a TorchTitan checkpoint loads as is
    return reference, model


def _batch(vocab_size, seq_len):
    """Two packed rows: documents of 5, 11 and 16 tokens, then one of ``seq_len`` (positions restart at 0)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (2, seq_len), generator=generator)
    first = torch.cat([torch.arange(5), torch.arange(11), torch.arange(seq_len - 16)])
    positions = torch.stack([first, torch.arange(seq_len)])
    return tokens, positions


def _run(model, tokens, positions):
    model.zero_grad()
    out = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    (out.square().mean()).backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_override_swaps_the_modules_and_keeps_the_parameters():
    spec = _titan_models().qwen3_moe_spec(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                          moe_hidden_dim=16, num_experts=4, top_k=2, vocab_size=50, max_seq_len=32,
                                          attn_backend="flex")
    reference = spec.model.build()
    model = _with_overrides(spec).build()
    assert isinstance(model, type(reference))
    assert type(model).get_attention_masks is not type(reference).get_attention_masks
    layer = model.layers["0"]
    assert isinstance(layer.attention.inner_attention, ours.FlashAttention)
    assert isinstance(layer.moe.routed_experts, ours.FlashRoutedExperts)
    assert isinstance(layer.moe.routed_experts.inner_experts, ours.FlashGroupedExperts)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}


def _packed_positions(generator, rows: int, seq_len: int, *, whole_rows=(), row_starts=True) -> torch.Tensor:
    """Rows of documents of random lengths (1 included), positions restarting at 0 at each; rows in
    ``whole_rows`` are one document. ``row_starts=False``: each row starts inside a document."""
    out = []
    for row in range(rows):
        lengths = [seq_len] if row in whole_rows else []
        while sum(lengths) < seq_len:
            short = torch.rand(1, generator=generator) >= 0.7
            lengths.append(1 if short else int(torch.randint(1, 9, (1,), generator=generator)))
        positions = torch.cat([torch.arange(n) for n in lengths])[:seq_len]
        if not row_starts:
            positions[:3] += 5
        out.append(positions)
    return torch.stack(out)


@pytest.mark.parametrize("rows, seq_len", [(1, 1), (3, 17), (5, 64), (2, 129)])
def test_document_metadata_equals_titans(rows, seq_len):
    generator = torch.Generator().manual_seed(rows * 1000 + seq_len)
    positions = _packed_positions(generator, rows, seq_len, whole_rows={rows - 1})
    expected = titan_attention.create_varlen_metadata_for_document(positions)
    got = ours.document_metadata(positions)
    assert got.cu_seq_q.dtype == torch.int32 and got.cu_seq_q is got.cu_seq_k
    torch.testing.assert_close(got.cu_seq_q, expected.cu_seq_q, rtol=0, atol=0)
    assert (got.max_q, got.max_k) == (expected.max_q, expected.max_k)


def test_document_metadata_never_crosses_rows():
    # rows that start inside a document (TorchTitan's builder would run that document across the row boundary):
    # the documents are those of TorchTitan's per-row document mask function (get_document_mask_mod)
    generator = torch.Generator().manual_seed(5)
    positions = _packed_positions(generator, 4, 23, row_starts=False)
    meta = ours.document_metadata(positions)
    cu = meta.cu_seq_q.long()
    document = torch.bucketize(torch.arange(positions.numel()), cu[1:], right=True).view(4, 23)
    allowed = (document[:, :, None] == document[:, None, :]) & torch.ones(23, 23, dtype=torch.bool).tril()
    mask_mod = titan_attention.get_document_mask_mod(positions)
    causal = titan_attention.get_causal_mask_mod()
    b, q, k = torch.meshgrid(torch.arange(4), torch.arange(23), torch.arange(23), indexing="ij")
    expected = mask_mod(b, torch.zeros_like(b), q, k) & causal(b, torch.zeros_like(b), q, k)
    assert torch.equal(allowed, expected)
    assert meta.max_q == int((cu[1:] - cu[:-1]).max())


def test_document_metadata_refuses_bad_positions():
    with pytest.raises(TypeError, match="positions"):
        ours.document_metadata(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="positions"):
        ours.document_metadata(torch.zeros(6, dtype=torch.int64))
    empty = ours.document_metadata(torch.zeros(0, 4, dtype=torch.int64))
    assert empty.cu_seq_q.tolist() == [0] and empty.max_q == 0


def test_flash_decoder_keywords_choose_what_is_replaced():
    spec = _titan_models().qwen3_moe_spec(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                          moe_hidden_dim=16, num_experts=4, top_k=2, vocab_size=50, max_seq_len=32,
                                          attn_backend="flex")
    reference_cls = type(spec.model)
    experts_only = _with_overrides(spec, attention=None)
    assert type(experts_only) is reference_cls
    assert isinstance(experts_only.layers[0].attention.inner_attention, titan_attention.FlexAttention.Config)
    assert isinstance(experts_only.layers[0].moe.routed_experts, ours.FlashRoutedExperts.Config)
    attention_only = _with_overrides(spec, attention="triton", experts=None)
    assert type(attention_only).__qualname__ == f"Flash{reference_cls.__qualname__}"
    assert isinstance(attention_only, reference_cls)
    assert attention_only.layers[0].attention.inner_attention.backend == "triton"
    assert not isinstance(attention_only.layers[0].moe.routed_experts, ours.FlashRoutedExperts.Config)
    # one decoder class per TorchTitan decoder class; applied again, the override keeps it
    assert type(_with_overrides(spec)) is type(attention_only)
    again = dataclasses.replace(spec, model=attention_only)
    assert type(_with_overrides(again, attention="auto")) is type(attention_only)
    with pytest.raises(TypeError, match="attention"):
        _with_overrides(spec, attention=1)
    assert _with_overrides(spec, exchange="titan").layers[0].moe.routed_experts.exchange == "titan"
    assert experts_only.layers[0].moe.routed_experts.exchange == "flashmoe"
    with pytest.raises(ValueError, match="exchange"):
        _with_overrides(spec, exchange="p2p")


def test_flash_decoder_refuses_a_decoder_with_masks_of_its_own():
    from torchtitan.models.gpt_oss import model_registry

    spec = model_registry("debugmodel")
    with pytest.raises(ValueError, match="masks of its own"):
        _with_overrides(spec)
    assert not isinstance(_with_overrides(spec, attention=None).layers[0].attention.inner_attention,
                          ours.FlashAttention.Config)


def test_warmup_cases_of_a_job_config():
    # TorchTitan's config as the job writes it (Flex) and after flash_decoder: the same packed cases, per layer kind
    spec = _titan_models().llama3_spec(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=96, vocab_size=61,
                                       max_seq_len=1024, attn_backend="flex")
    for config in (spec.model, _with_overrides(spec)):
        cases = ours.warmup_cases(config, seq_len=1024, batch=4)
        assert [(case.seq_len, case.batch) for case in cases] == [(1024, 4), (512, 8), (256, 16), (128, 32)]
        assert {(case.head_dim, case.heads, case.kv_heads, case.layout, case.causal, case.window, case.dtype)
                for case in cases} == {(16, 6, 2, "varlen", True, None, "bf16")}
    with pytest.raises(TypeError, match="Decoder.Config"):
        ours.warmup_cases(spec, seq_len=1024)


def test_llama3_matches_titan_flex_float64(eager_flex):
    spec = _titan_models().llama3_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                                       vocab_size=61, max_seq_len=64, attn_backend="flex")
    reference, model = _pair(spec, torch.float64)
    tokens, positions = _batch(61, 32)
    ref_out, ref_grads = _run(reference, tokens, positions)
    out, grads = _run(model, tokens, positions)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-8, atol=1e-10, msg=name)


def test_sliding_window_matches_titan_varlen_semantics():
    # TorchTitan's varlen (-1, 0) / (W, 0) windows, written as Flex masks: causal within the document and the window
    q, k, v = (torch.randn(2, 24, 4, 16, dtype=torch.float64) for _ in range(3))
    positions = torch.stack([torch.cat([torch.arange(9), torch.arange(15)]), torch.arange(24)])
    meta = titan_attention.create_varlen_metadata_for_document(positions)
    doc = torch.cumsum((positions == 0).int(), dim=1)
    idx = torch.arange(24)
    for window in (-1, 5):
        attention = ours.FlashAttention.Config(window_size=(window, 0)).build()
        allowed = (doc[:, :, None] == doc[:, None, :]) & (idx[None, :, None] >= idx[None, None, :])
        if window >= 0:
            allowed &= idx[None, :, None] - idx[None, None, :] <= window
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]).transpose(1, 2)
        torch.testing.assert_close(attention(q, k, v, attention_masks=meta), expected, rtol=1e-10, atol=1e-10)


def test_routed_experts_match_titan_dispatch_float64(monkeypatch):
    spec = _titan_models().qwen3_moe_spec(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                          moe_hidden_dim=24, num_experts=6, top_k=3, vocab_size=50, max_seq_len=32)
    reference, model = _pair(spec, torch.float64, attention=None)
    titan, flash = reference.layers["0"].moe, model.layers["0"].moe
    # TorchTitan's configs build the all-to-all dispatcher; without an EP mesh it only reorders local tokens, which
    # fused_experts does itself: the layer must not call it (nor run the experts at top-1 over its (T·K, D) rows)
    assert ours.dispatches_locally(flash.routed_experts.token_dispatcher)
    monkeypatch.setattr(flash.routed_experts.token_dispatcher, "dispatch", None)
    experts = titan.routed_experts.inner_experts
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        scores, ids, _ = titan.router(x)
    counts = torch.zeros(6, dtype=torch.int64).scatter_add_(0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.int64))

    def titan_experts(x_BLD, scores):
        """TorchTitan's dispatch around its dense SwiGLU FeedForward, one expert at a time, and its combine's
        weighted scatter-add in float64 (``LocalTokenDispatcher.combine`` rounds the weighted rows to float32)."""
        dispatcher = titan.routed_experts.token_dispatcher
        rows, grouped_counts, meta = dispatcher.dispatch(x_BLD.view(-1, 32), scores.view(-1, 3), ids.view(-1, 3),
                                                         counts)
        ffn = FeedForward.Config(w1=Linear.Config(in_features=32, out_features=24),
                                 w2=Linear.Config(in_features=24, out_features=32),
                                 w3=Linear.Config(in_features=32, out_features=24)).build()
        outs = [torch.func.functional_call(ffn, {"w1.weight": experts.w1_EFD[e], "w2.weight": experts.w2_EDF[e],
                                                 "w3.weight": experts.w3_EFD[e]}, (part,))
                for e, part in enumerate(rows.split(grouped_counts.tolist()))]
        weighted = torch.cat(outs) * meta.topk_scores_experts_sorted_N[:, None]
        return torch.zeros_like(x_BLD.view(-1, 32)).index_add(0, meta.token_indices_experts_sorted_N,
                                                              weighted).view_as(x_BLD)

    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    scores_ref, scores_ours = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    expected = titan_experts(x_ref, scores_ref)
    got = flash.routed_experts(x_ours, scores_ours, ids, counts)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores_ours.grad, scores_ref.grad, rtol=1e-10, atol=1e-12)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        ours_grad = getattr(flash.routed_experts.inner_experts, name).grad
        torch.testing.assert_close(ours_grad, getattr(experts, name).grad, rtol=1e-10, atol=1e-12, msg=name)


def test_grouped_experts_match_titan_on_grouped_rows():
    # the expert-parallel path: rows already grouped by local expert, two capacity-padding rows at the end
    config = ours.FlashGroupedExperts.Config(dim=16, hidden_dim=8, num_experts=3)
    torch.manual_seed(2)
    flash = config.build()
    for p in flash.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts = torch.tensor([4, 0, 5])
    x = torch.randn(11, 16, dtype=torch.float64)
    w13, w2 = flash.swiglu_weights(torch.float64)
    expected = torch.zeros_like(x)
    for e, (lo, hi) in enumerate([(0, 4), (4, 4), (4, 9)]):
        h = x[lo:hi] @ w13[e].T
        expected[lo:hi] = (torch.nn.functional.silu(h[:, :8]) * h[:, 8:]) @ w2[e].T
    torch.testing.assert_close(flash.to(torch.float64)(x, counts), expected, rtol=1e-10, atol=1e-12)


def test_qwen3_moe_model_matches_titan_at_its_bf16_experts(eager_flex):
    spec = _titan_models().qwen3_moe_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                          moe_hidden_dim=32, num_experts=8, top_k=2, vocab_size=61, max_seq_len=64,
                                          attn_backend="flex")
    reference, model = _pair(spec, torch.float32)
    tokens, positions = _batch(61, 32)
    ref_out, ref_grads = _run(reference, tokens, positions)
    out, grads = _run(model, tokens, positions)
    # TorchTitan rounds expert inputs, weights and the SwiGLU product to bf16 (8 significant bits): a few 2^-8
    # relative to each tensor's scale
    scale = ref_out.abs().max()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=float(0.03 * scale))
    for name, grad in grads.items():
        tol = 0.05 * float(ref_grads[name].abs().max()) + 1e-7
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=tol, msg=name)


@pytest.fixture
def cpu_trainer(tmp_path, monkeypatch):
    """``run.train`` of the example on CPU ranks: TorchTitan's trainer through ``torchtitan_cpu.py`` (its tiny jobs)
    on a corpus of this repository's docs."""
    root = EXAMPLES.parents[1]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md"))))
    cpu_launcher = Path(__file__).with_name("torchtitan_cpu.py")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(cpu_launcher.parent), str(root / "src")]))
    run = importlib.import_module("run")

    def train(config, ranks, *extra, steps=3):
        log = tmp_path / f"{config}-{ranks}-{len(list(tmp_path.iterdir()))}.log"
        result = run.train(config, ranks, steps, ["--dump_folder", str(tmp_path / "out"), "--dataloader.dataset_path",
                                                  str(corpus), *extra], log, 300, launcher=cpu_launcher,
                           module="torchtitan_cpu")
        assert not result["timed_out"] and len(result["rows"]) == steps
        return result["rows"], log.read_text()

    return train


def _close(rows, reference, rtol):
    # AdamW is blind to a gradient's scale: the gradient norm is what shows a wrong reduction
    for row, ref in zip(rows, reference, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=rtol), (row, ref)
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rtol), (row, ref)


@pytest.mark.slow
def test_trainer_trains_the_example_job_with_ours_as_with_titans(cpu_trainer):
    # TorchTitan's trainer end to end (data loader, FSDP2 on one rank, AdamW, the example's job config), 3 steps
    titan, _ = cpu_trainer("moe_titan", 1)
    ours, log = cpu_trainer("moe_flash", 1)
    assert "flash_decoder" in log
    _close(ours, titan, rtol=1e-3)  # float32 model whose experts TorchTitan rounds to bf16 (ours: float32)
    assert ours[-1]["loss"] < ours[0]["loss"]


@pytest.mark.slow
def test_fsdp_and_expert_parallel_with_one_mesh_per_unit_matches_fsdp_alone(cpu_trainer, monkeypatch):
    # torch_compat's FSDP2 + EP wrapping (routed experts as their own FSDP units), with our exchange (moe_flash:
    # expert_parallel_experts on its EP group) and with TorchTitan's dispatcher (moe_flash_titan_dispatch), against FSDP
    # over both ranks without EP: same global batch, same model, so the same losses and gradient norms
    fsdp, _ = cpu_trainer("moe_flash", 2)
    monkeypatch.setenv("FLASHMOE_ONE_MESH_PER_UNIT", "1")
    for job in ("moe_flash", "moe_flash_titan_dispatch"):
        expert_parallel, log = cpu_trainer(job, 2, "--parallelism.expert_parallel_degree", "2")
        assert "as their own units on the efsdp mesh" in log
        _close(expert_parallel, fsdp, rtol=1e-3)  # gradients summed in another order, through two Adam steps


def test_repeated_runs_compare_by_their_mean_rate_and_each_repeat():
    # two interleaved repeats: per-kind mean of each run's steady rate (steps after the first 10%), each repeat's ratio
    run = importlib.import_module("run")

    def one(rates, loss):
        return dict(rows=[dict(step=i + 1, loss=loss, grad_norm=1.0, memory_gib=2.0, tps=t, tflops=1.0, mfu=10.0)
                          for i, t in enumerate(rates)], timed_out=False)

    runs = {"titan": [one([1, 100, 100], 2.0), one([1, 50, 50], 2.0)],
            "flash": [one([1, 120, 120], 2.2), one([1, 60, 60], 2.2)]}
    result = run.compare(runs, ["flash"])
    assert result["titan"]["tokens_per_s_repeats"] == [100, 50] and result["titan"]["tokens_per_s"] == 75
    assert result["speedup_tokens_per_s"] == pytest.approx(90 / 75)
    assert result["speedup_repeats"] == pytest.approx([1.2, 1.2])
    assert result["loss_ratio_at_common_step"] == dict(step=3, ratio=pytest.approx(1.1))
    single = run.compare({kind: repeats[:1] for kind, repeats in runs.items()}, ["flash"])
    assert "speedup_repeats" not in single and single["speedup_tokens_per_s"] == pytest.approx(1.2)
