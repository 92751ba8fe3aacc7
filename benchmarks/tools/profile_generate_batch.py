"""torch.profiler summary of transformers' continuous batching (`generate_batch`) per attention implementation.

The model and options of `bench.decode.run_serving_bench` on a small workload: `--prompts` prompts of 64..512
tokens (one or two prefill steps of up to 8192 tokens) and `--new-tokens` new tokens (that many minus one decode
steps). A first pass warms up (compilations, graph captures); the second runs under torch.profiler, whose
key_averages tables (top ops by self CPU time and by self CUDA time) go to `<out>/<implementation>_cpu.txt` and
`_cuda.txt`, with the Chrome trace beside them. `--graphs off` turns transformers' CUDA graphs and asynchronous
batching off (both implementations then run eagerly, step by step).

    python benchmarks/tools/profile_generate_batch.py --out $OUT/profile
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch


def profile(implementation: str, out: pathlib.Path, prompts: int, new_tokens: int, graphs: str, rows: int) -> None:
    import transformers

    from flashmoe_science.bench.decode import serving_model_config, serving_options
    from flashmoe_science.integrations import hf

    torch.manual_seed(0)
    config = serving_model_config()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    lengths = torch.randint(64, 513, (prompts,)).tolist()
    inputs = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in lengths]
    generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
    options = serving_options(lengths, new_tokens)
    if graphs == "off":
        options.update(use_cuda_graph=False, use_async_batching=False)
    name = hf.paged_sdpa(options) if implementation == "sdpa" else hf.register_flash()
    model.set_attn_implementation(name)
    cb_config = hf.continuous_batching_config(**options)

    def run():
        torch.cuda.synchronize()
        began = time.perf_counter()
        model.generate_batch(inputs=inputs, generation_config=generation, continuous_batching_config=cb_config,
                             persistent_manager=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    warm = run()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        seconds = run()
    decided = model.init_continuous_batching().continuous_batching_config
    model.destroy_cached_continuous_batching_manager()
    label = f"{'ours' if implementation != 'sdpa' else 'sdpa'}_graphs-{graphs}"
    averages = prof.key_averages()
    header = (f"{label} ({name}): {prompts} prompts, {new_tokens} new tokens, warm-up {warm:.3f} s, profiled pass "
              f"{seconds:.3f} s, cuda graphs {list(decided.cuda_graph_booleans)}, async "
              f"{bool(decided.use_async_batching)}\n")
    for sort in ("cpu", "cuda"):
        table = averages.table(sort_by=f"self_{sort}_time_total", row_limit=rows)
        (out / f"{label}_{sort}.txt").write_text(header + table)
        print(header + f"top {rows} by self {sort.upper()} time\n" + table, flush=True)
    prof.export_chrome_trace(str(out / f"{label}_trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--graphs", choices=("auto", "off"), default="auto")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--implementations", nargs="+", default=["ours", "sdpa"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for implementation in args.implementations:
        profile(implementation, args.out, args.prompts, args.new_tokens, args.graphs, args.rows)


if __name__ == "__main__":
    main()
