"""One layer of the TorchTitan example jobs, TorchTitan's default module against the one our overrides put in its
place: forward + backward time and a torch.profiler table of the top-20 kernels of each.

    PYTHONPATH=src:/tmp/site python benchmarks/tools/bench_torchtitan_moe_layer.py --out "$OUT"
    PYTHONPATH=src python benchmarks/tools/bench_torchtitan_moe_layer.py --size tiny --device cpu   # smoke run
    ... --cases qwen3_moe/moe                     # one case (comma list of model/layer)

Cases, at the shapes of ``examples/torchtitan/flashmoe_jobs.py`` (``--size job``; ``tiny``: a few-token model for
CPU):

- ``qwen3_moe/moe``: the ``MoE`` module of a Qwen3-MoE block (router, dispatch, experts, combine) as TorchTitan's
  config builds it (``torch._grouped_mm`` experts between its argsort dispatch and scatter-add combine), and with
  ``flash_decoder`` (``fused_experts``); same weights, so the same routing of the same input.
- ``qwen3_moe/attention`` and ``llama_100m/attention``: the inner attention of a block, TorchTitan's compiled
  ``FlexAttention`` on its per-document causal ``BlockMask`` against ``FlashAttention`` on the same documents'
  varlen metadata. The documents are a batch of the job's own data loader (``--dataset-path``).
- ``*/masks``: building the attention masks (once per step): Flex's ``create_block_mask`` against the varlen
  metadata (``document_metadata``).
- ``*/attention_step``: a training step's attention: the masks of a new batch of the loader (batches rotate, so
  each step has new document boundaries, as in training), then the inner attention of every layer forward on those
  masks, then their backward.

Parameters are bfloat16 as TorchTitan's FSDP2 mixed precision hands them to the layer on one GPU (its routers'
float32 buffers stay float32). Each time is the median of ``triton.testing.do_bench`` after its sustained
warm-up (``bench.report.gpu_median_ms``); on the CPU, the median of a few wall-clock calls, and Flex (no CPU
backward) runs its mask function as a dense mask through SDPA. The step estimate multiplies each layer's
difference by the model's layer count. Beside each time, the host's: ms to issue one call while the GPU is kept
busy (behind a long sleep kernel, so nothing waits for the GPU), and the device synchronisations per call
(``torch.cuda.set_sync_debug_mode``): a call whose host ms reach its time is bound by the host. Writes
``torchtitan_layers.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "torchtitan"
TOP_KERNELS = 20
PROFILED_CALLS = 3


@dataclass
class Case:
    """One module pair at one model's shapes: ``make_inputs(which)`` -> (args, kwargs) of a call with fresh leaves,
    bound (``functools.partial``) to this model's tensors, not looked up when the cases run."""
    model: str
    layer: str
    titan: torch.nn.Module | object
    ours: torch.nn.Module | object
    make_inputs: object
    layers: int
    backward: bool = True


def _titan_modules():
    sys.path.insert(0, str(EXAMPLES))
    import torch_compat

    torch_compat.install()  # before any TorchTitan model package is imported
    import titan_models

    return titan_models


def _specs(size: str, titan_models) -> dict[str, tuple]:
    """model name -> (ModelSpec, local batch, seq_len, the override entries of our jobs)."""
    if size == "job":
        import flashmoe_jobs  # TorchTitan's trainer (and what it imports: tensorboard, ...)

        overrides = flashmoe_jobs.FLASH
        specs = {}
        for name in ("qwen3_moe", "llama_100m"):
            job = getattr(flashmoe_jobs, f"{name}_titan")()
            specs[name] = (job.model_spec, job.training.local_batch_size, job.training.seq_len, overrides)
        return specs
    from flashmoe_science.integrations.torchtitan import flash_decoder

    overrides = [f"{flash_decoder.__module__}.{flash_decoder.__name__}"]
    return {
        "qwen3_moe": (titan_models.qwen3_moe_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                  moe_hidden_dim=32, num_experts=8, top_k=2, vocab_size=257,
                                                  max_seq_len=64, attn_backend="flex"), 2, 64, overrides),
        # another batch and length than qwen3_moe's, as at the job size: a case handed the other model's masks fails
        "llama_100m": (titan_models.llama3_spec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                                                vocab_size=257, max_seq_len=64, attn_backend="flex"), 3, 48,
                       overrides),
    }


STEP_BATCHES = 4  # the attention_step case rotates through this many batches of the loader


def _positions(dataset_path: str, batch: int, seq_len: int, count: int = 1) -> list[torch.Tensor]:
    """``count`` batches of the example jobs' data loader: positions restarting at every document."""
    from local_text import ByteTokenizer, LocalTextDataLoader

    config = LocalTextDataLoader.Config(dataset_path=dataset_path)
    loader = LocalTextDataLoader(config, dp_world_size=1, dp_rank=0, tokenizer=ByteTokenizer(ByteTokenizer.Config()),
                                 seq_len=seq_len, local_batch_size=batch)
    batches = [inputs["positions"] for inputs, _ in (next(it) for it in [iter(loader)] * count)]
    if tuple(batches[0].shape) != (batch, seq_len):
        raise ValueError(f"dataset_path: its loader gave positions of shape {tuple(batches[0].shape)}, expected "
                         f"(local_batch_size, seq_len) = {(batch, seq_len)}")
    return batches


def _bf16_params(module: torch.nn.Module, device) -> torch.nn.Module:
    module.to(device)
    for p in module.parameters():
        p.data = p.data.to(torch.bfloat16)  # FSDP2's param_dtype; buffers keep their dtype
    return module


def _dense_flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux, **_):
    """``flex_attention`` without its compiled kernel (none on the CPU): the mask function as a dense SDPA mask."""
    from torch.nn.attention.flex_attention import create_mask

    # flex_attention's own check: the compiled kernel refuses a mask built for other lengths or another batch
    mask_batch, _, mask_q, mask_kv = block_mask.shape
    if (mask_q, mask_kv) != (q.shape[2], k.shape[2]) or mask_batch not in (1, q.shape[0]):
        raise ValueError(f"block_mask was created for block_mask.shape={tuple(block_mask.shape)} but got batch "
                         f"{q.shape[0]}, q_len={q.shape[2]} and kv_len={k.shape[2]}")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                            enable_gqa=enable_gqa), None


def _cpu_flex() -> None:
    import torch_compat
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention as titan_attention

    titan_attention.FlexAttention._compiled_flex_attn = _dense_flex
    eager = create_block_mask
    if "create_block_mask(separate_full_blocks)" in torch_compat.missing():
        eager = torch_compat._create_block_mask_without_separate_full_blocks(create_block_mask)
    titan_attention._compiled_create_block_mask = eager


def _attention_inputs(which: str, *, positions, masks, n_heads, n_kv_heads, head_dim, scale):
    """q, k, v ``(B, L, N, H)`` of the batch and length of ``positions``, the tokens its masks were built from."""
    batch, seq_len = positions.shape
    q = torch.randn(batch, seq_len, n_heads, head_dim, device=positions.device, dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(batch, seq_len, n_kv_heads, head_dim, device=positions.device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    return (q, k, v), dict(attention_masks=masks[which], scale=scale, enable_gqa=n_heads > n_kv_heads)


def _attention_step(inner, model, batches, qkv_kwargs: dict, layers: int):
    """A training step's attention (the ``attention_step`` case): masks of the next batch (``model``'s
    ``get_attention_masks``), ``layers`` calls of ``inner`` forward on them, then one backward through all."""
    leaves = [_attention_inputs("step", positions=batches[0], masks=dict(step=None), **qkv_kwargs)[0]
              for _ in range(layers)]
    grads = [torch.randn_like(q) for q, _, _ in leaves]
    kwargs = _attention_inputs("step", positions=batches[0], masks=dict(step=None), **qkv_kwargs)[1]
    turn = itertools.count()

    def step():
        masks = model.get_attention_masks(batches[next(turn) % len(batches)])
        outs = [inner(q, k, v, **{**kwargs, "attention_masks": masks}) for q, k, v in leaves]
        for layer in leaves:
            for t in layer:
                t.grad = None
        torch.autograd.backward(outs, grads)

    return step


def _moe_inputs(which: str, *, shape, device):
    """The same x ``(B, L, D)`` for both modules, so the same routing."""
    generator = torch.Generator(device=device).manual_seed(1)
    return (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_(),), {}


def build_cases(size: str, device: torch.device, dataset_path: str, only: set[str] | None = None) -> list[Case]:
    """The cases (``model/layer`` names in ``only``, default all), building nothing for a model none of them names."""
    titan_models = _titan_modules()
    from torchtitan.config import OverrideConfig, apply_overrides

    if device.type == "cpu":
        _cpu_flex()
    cases = []
    for name, (spec, batch, seq_len, overrides) in _specs(size, titan_models).items():
        if only is not None and not any(case.split("/")[0] == name for case in only):
            continue
        # under its ModelSpec, as under the trainer's config: the override replaces the model config itself
        ours_spec = replace(spec, model=copy.deepcopy(spec.model))
        apply_overrides(OverrideConfig(imports=list(overrides)), ours_spec)
        ours_config = ours_spec.model
        titan_block, ours_block = spec.model.layers[0], ours_config.layers[0]
        layers = len(spec.model.layers)
        with torch.device("meta"):  # get_attention_masks reads only the config
            titan_model, ours_model = spec.model.build(), ours_config.build()
        batches = [p.to(device) for p in _positions(dataset_path, batch, seq_len, STEP_BATCHES)]
        positions = batches[0]
        cases.append(Case(name, "masks", lambda p=positions, m=titan_model: m.get_attention_masks(p),
                          lambda p=positions, m=ours_model: m.get_attention_masks(p), None, 1, False))

        attention = titan_block.attention
        head_dim = attention.head_dim or attention.dim // attention.n_heads
        masks = dict(titan=titan_model.get_attention_masks(positions), ours=ours_model.get_attention_masks(positions))
        qkv_kwargs = dict(n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads or attention.n_heads,
                          head_dim=head_dim, scale=head_dim ** -0.5 if attention.head_dim is not None else None)
        titan_inner, ours_inner = (titan_block.attention.inner_attention.build(),
                                   ours_block.attention.inner_attention.build())
        cases.append(Case(name, "attention", titan_inner, ours_inner,
                          partial(_attention_inputs, positions=positions, masks=masks, **qkv_kwargs), layers))
        cases.append(Case(name, "attention_step",
                          _attention_step(titan_inner, titan_model, batches, qkv_kwargs, layers),
                          _attention_step(ours_inner, ours_model, batches, qkv_kwargs, layers), None, 1, False))
        if titan_block.moe is None:
            continue
        torch.manual_seed(0)
        titan_moe = titan_block.moe.build()
        titan_moe.init_states()
        ours_moe = ours_block.moe.build()
        ours_moe.load_state_dict(titan_moe.state_dict())  # same names and shapes
        cases.append(Case(name, "moe", _bf16_params(titan_moe, device), _bf16_params(ours_moe, device),
                          partial(_moe_inputs, shape=(*positions.shape, titan_block.moe.router.gate.in_features),
                                  device=device), layers))
    return [case for case in cases if only is None or f"{case.model}/{case.layer}" in only]


def _step(module, case: Case, which: str):
    """The call (forward and, for a layer, backward) on fresh inputs; its leaves for grad_to_none."""
    if case.make_inputs is None:
        return module, []
    args, kwargs = case.make_inputs(which)
    grad = None

    def step():
        nonlocal grad
        out = module(*args, **kwargs)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    return step, [*args, *params]


def median_ms(fn, leaves, device: torch.device, calls: int) -> float:
    if device.type == "cuda":
        from flashmoe_science.bench.report import gpu_median_ms

        return gpu_median_ms(fn, grad_to_none=leaves, sustained=True)
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def host_ms(fn, device: torch.device, calls: int) -> tuple[float, float]:
    """(host ms to issue one call, device synchronisations per call): ``calls`` calls issued behind a sleep kernel
    that keeps the GPU busy longer than they take to issue, counted by torch.cuda.set_sync_debug_mode("warn")."""
    if device.type != "cuda":
        return median_ms(fn, [], device, calls), 0.0
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s on an H100's clock
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return 1e3 * elapsed / calls, syncs / calls


def kernel_table(fn, device: torch.device) -> tuple[str, list[dict]]:
    """torch.profiler over PROFILED_CALLS calls: its top kernels (CPU ops on the CPU) by self time, per call."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:TOP_KERNELS]
    top = [dict(name=e.key, calls=e.count / PROFILED_CALLS, ms=getattr(e, key) / 1e3 / PROFILED_CALLS)
           for e in rows if getattr(e, key) > 0]
    return averages.table(sort_by=key, row_limit=TOP_KERNELS, max_name_column_width=70), top


def run(cases: list[Case], device: torch.device, calls: int, profile_tables: bool, save) -> list[dict]:
    """Each case's times (and kernel tables); ``save(results)`` after each, so a run stopped early keeps them."""
    results = []
    for case in cases:
        row = dict(model=case.model, layer=case.layer, layers=case.layers)
        for which in ("titan", "ours"):
            fn, leaves = _step(getattr(case, which), case, which)
            row[f"{which}_ms"] = median_ms(fn, leaves, device, calls)
            row[f"{which}_host_ms"], row[f"{which}_syncs"] = host_ms(fn, device, calls)
            if profile_tables and case.make_inputs is not None:
                table, top = kernel_table(fn, device)
                row[f"{which}_kernels"] = top
                print(f"\n== {case.model}/{case.layer} {which}: top {TOP_KERNELS} by self device time, "
                      f"per {PROFILED_CALLS} calls ==\n{table}", flush=True)
        row["speedup"] = row["titan_ms"] / row["ours_ms"]
        row["step_delta_ms"] = case.layers * (row["ours_ms"] - row["titan_ms"])
        results.append(row)
        save(results)
        print(f"{case.model}/{case.layer}: titan {row['titan_ms']:.3f} ms (host {row['titan_host_ms']:.3f}, "
              f"{row['titan_syncs']:g} syncs), ours {row['ours_ms']:.3f} ms (host {row['ours_host_ms']:.3f}, "
              f"{row['ours_syncs']:g} syncs)", flush=True)
    return results


def _corpus_of_docs() -> str:
    """A corpus of this repository's docs (the tiny size needs a few hundred tokens, not the docstring corpus)."""
    path = Path(tempfile.mkdtemp()) / "corpus.txt"
    path.write_text("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    return str(path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["job", "tiny"], default="job")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dataset-path", default=None,
                        help="the jobs' corpus (default: results/torchtitan/corpus.txt for --size job, written "
                             "as the jobs write it when missing; this repository's docs for --size tiny)")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per module on the CPU")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    parser.add_argument("--out", default="results/torchtitan")
    parser.add_argument("--cases", default="",
                        help="comma list of model/layer to run (e.g. qwen3_moe/moe; default: every case)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        raise ValueError(f"--calls must be >= 1, got {args.calls}")
    only = set(args.cases.split(",")) if args.cases else None
    known = {f"{m}/{layer}" for m in ("qwen3_moe", "llama_100m")
             for layer in ("masks", "attention", "attention_step", "moe")}
    if only is not None and not only <= known:
        raise ValueError(f"--cases: unknown {', '.join(sorted(only - known))}; expected some of "
                         f"{', '.join(sorted(known))}")
    device = torch.device(args.device)
    dataset_path = args.dataset_path or ("results/torchtitan/corpus.txt" if args.size == "job" else _corpus_of_docs())
    from flashmoe_science.bench.report import gpu_name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(size=args.size, device=gpu_name() if device.type == "cuda" else "cpu", torch=torch.__version__)

    def save(results):
        (out / "torchtitan_layers.json").write_text(json.dumps({**report, "results": results}, indent=2))

    cases = build_cases(args.size, device, dataset_path, only)
    results = run(cases, device, args.calls, not args.no_profile, save)
    print(f"\n{'case':<26}{'titan ms':>10}{'ours ms':>10}{'ours/titan':>12}{'x layers':>10}{'step delta ms':>15}"
          f"{'titan host':>12}{'ours host':>11}{'syncs t/o':>11}")
    for r in results:
        print(f"{r['model'] + '/' + r['layer']:<26}{r['titan_ms']:>10.3f}{r['ours_ms']:>10.3f}"
              f"{r['titan_ms'] / r['ours_ms']:>12.3f}{r['layers']:>10}{r['step_delta_ms']:>15.2f}"
              f"{r['titan_host_ms']:>12.3f}{r['ours_host_ms']:>11.3f}{r['titan_syncs']:>6g}/{r['ours_syncs']:g}")
    for model in dict.fromkeys(r["model"] for r in results):
        delta = sum(r["step_delta_ms"] for r in results if r["model"] == model and r["layer"] != "attention_step")
        print(f"{model}: ours - titan per step, these layers only: {delta:+.2f} ms (attention_step measures the "
              f"masks and attention layers together)")
    return {**report, "results": results}


if __name__ == "__main__":
    main()
