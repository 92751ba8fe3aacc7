"""SGLang on this library's kernels beside SGLang's own attention backends, one GPU, one engine process per backend.

  python benchmarks/tools/sglang_generate.py bench --out DIR [--models llama8b,qwen3moe] [--backends ...] [--cases ...]

Backends: ``flashmoe`` (this package's ``flashmoe`` attention backend, pages of 16 tokens; on MoE models our fused MoE
too, ``FLASHMOE_SCIENCE_SGLANG_MOE=1``), ``flashmoe-p64`` (the same on pages of 64 tokens), ``flashmoe-attn`` (our
attention, SGLang's MoE), ``sglang-triton`` (SGLang's
``triton`` backend with SGLang's default page size and its own MoE). The models and workloads are vLLM's benchmark's
(``engine_workloads.py``): random weights (``load_format="dummy"``), token-id prompts, greedy, ``ignore_eos``, SGLang's
defaults otherwise (decode CUDA graphs, breakable prefill graphs), torch sampling in every backend. Records:
``op: "sglang-generate"``, model, case, backend, tokens_per_s (prompt + generated), output_tokens_per_s; the envelope
names the GPU, versions and commit. Needs SGLang importable and this package's ``sglang.srt.plugins`` entry point
installed (``benchmarks/tools/sglang_gpu.sh`` does both on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from engine_workloads import MAX_MODEL_LEN, MODELS, envelope, spawn, workload

from flashmoe_science.integrations.sglang import MOE_SWITCH

BACKENDS = {  # name -> (Engine settings beyond the shared ones, our MoE)
    "flashmoe": (dict(attention_backend="flashmoe", page_size=16), True),
    "flashmoe-attn": (dict(attention_backend="flashmoe", page_size=16), False),
    "flashmoe-p64": (dict(attention_backend="flashmoe", page_size=64), True),
    "sglang-triton": (dict(attention_backend="triton"), False),
}


def _worker(spec: dict) -> list[dict]:
    settings, our_moe = BACKENDS[spec["backend"]]
    if our_moe:  # read by the plugin in SGLang's scheduler processes, which inherit the environment
        os.environ[MOE_SWITCH] = "1"
    import sglang
    import torch

    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(spec["config"], f)
    started = time.time()
    engine = sglang.Engine(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                           context_length=MAX_MODEL_LEN, sampling_backend="pytorch", random_seed=0,
                           mem_fraction_static=spec.get("memory", 0.85), log_level="warning",
                           **settings)
    init_s = time.time() - started
    records = []
    try:
        for case in spec["cases"]:
            prompts, new = workload(case, spec["config"]["vocab_size"])
            params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
            engine.generate(input_ids=prompts[:8], sampling_params={**params, "max_new_tokens": 8})  # warm-up
            torch.cuda.synchronize()
            t0 = time.time()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.time() - t0
            generated = sum(len(o["output_ids"]) for o in outs)
            prompt_tokens = sum(len(p) for p in prompts)
            record = dict(op="sglang-generate", model=spec["model"], case=case, backend=spec["backend"],
                          **settings, our_moe=our_moe, seconds=seconds, engine_start_s=init_s, prompts=len(prompts),
                          prompt_tokens=prompt_tokens, output_tokens=generated,
                          tokens_per_s=(prompt_tokens + generated) / seconds, output_tokens_per_s=generated / seconds)
            records.append(record)
            print(json.dumps(record), flush=True)
    finally:
        engine.shutdown()
    return records


def bench(out: str, models: list[str], backends: list[str], cases: list[str], name: str) -> int:
    records = []
    path = os.path.join(out, f"sglang-generate-{name}.json")
    with open(os.path.join(out, f"sglang-generate-{name}.log"), "w") as log:
        for model in models:
            for backend in backends:
                if backend == "flashmoe-attn" and "num_experts" not in MODELS[model]:
                    continue
                spec = dict(model=model, config=MODELS[model], backend=backend, cases=cases)
                records += spawn(__file__, spec, log)
                json.dump(envelope(records, "sglang", "sglang-kernel"), open(path, "w"), indent=1)
    for r in records:
        print(f"{r['model']:9} {r['case']:8} {r['backend']:14} {r['tokens_per_s']:10.0f} tok/s "
              f"{r['output_tokens_per_s']:9.0f} out/s  start {r['engine_start_s']:.0f}s", flush=True)
    return 0 if records else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        json.dump(_worker(json.loads(argv[1])), open(argv[2], "w"))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["bench"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--models", default="llama8b,qwen3moe")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--cases", default="prefill,decode")
    p.add_argument("--name", default="run")
    a = p.parse_args(argv)
    unknown = sorted(set(a.backends.split(",")) - set(BACKENDS))
    if unknown:
        p.error(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)}")
    os.makedirs(a.out, exist_ok=True)
    return bench(a.out, a.models.split(","), a.backends.split(","), a.cases.split(","), a.name)


if __name__ == "__main__":  # SGLang starts its scheduler by spawn: keep the work under this guard
    sys.exit(main())
