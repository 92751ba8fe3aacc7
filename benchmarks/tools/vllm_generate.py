"""vLLM 0.26 on this library's kernels beside vLLM's own backends, one GPU, one engine process per backend.

  python benchmarks/tools/vllm_generate.py agree --out DIR     # greedy tokens and first-step logprobs, eager
  python benchmarks/tools/vllm_generate.py bench --out DIR [--models llama8b,qwen3moe] [--backends ...] [--cases ...]
      [--profile DIR]   # each case once more under torch.profiler: its kernels' CUDA time per backend
  python benchmarks/tools/vllm_generate.py online --out DIR [--models llama8b] [--backends ...]  # `vllm serve`

Backends: ``flashmoe`` (the CUSTOM attention backend; on MoE models our fused MoE too), ``flashmoe-attn`` (our
attention, vLLM's MoE), ``flashmoe-fp8`` (ours with an e4m3 KV cache), ``vllm-fa3`` (FLASH_ATTN: FlashAttention-3
on Hopper), ``vllm-triton`` (TRITON_ATTN). Random weights (``load_format="dummy"``), token-id prompts, greedy,
``ignore_eos``; `bench` runs vLLM's defaults (torch.compile and CUDA graphs). Records: ``op: "vllm-generate"``,
model, case, backend, tokens_per_s (prompt + generated), output_tokens_per_s; the envelope names the GPU, versions
and commit. Needs vLLM importable and this package's ``vllm.general_plugins`` entry point installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from engine_workloads import MAX_MODEL_LEN, MODELS, envelope, spawn, workload

# small models of the same kinds for the eager agreement run
TINY = {
    "llama": dict(MODELS["llama8b"], vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
    "qwen3moe": dict(MODELS["qwen3moe"], vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_experts=16,
                     num_experts_per_tok=4, moe_intermediate_size=512, num_attention_heads=16, num_key_value_heads=4),
}
BACKENDS = {  # name -> (attention_backend, our MoE, kv_cache_dtype)
    "flashmoe": ("CUSTOM", True, "auto"),
    "flashmoe-attn": ("CUSTOM", False, "auto"),
    "flashmoe-fp8": ("CUSTOM", True, "fp8"),
    "vllm-fa3": ("FLASH_ATTN", False, "auto"),
    "vllm-fa3-fp8": ("FLASH_ATTN", False, "fp8"),
    "vllm-triton": ("TRITON_ATTN", False, "auto"),
}

def _worker(spec: dict) -> list[dict]:
    os.environ.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    attention, our_moe, cache_dtype = BACKENDS[spec["backend"]]
    if our_moe:
        os.environ["FLASHMOE_SCIENCE_VLLM_MOE"] = "1"
    from vllm import LLM, SamplingParams

    config = spec["config"]
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    eager = spec["mode"] == "agree"
    started = time.time()
    cache = {"kv_cache_memory_bytes": int(spec["kv_cache_gib"] * 2**30)} if spec.get("kv_cache_gib") else {}
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              attention_backend=attention, kv_cache_dtype=cache_dtype, enforce_eager=eager,
              max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=spec.get("memory", 0.85), **cache)
    init_s = time.time() - started
    if eager:  # weights at a trained model's scale, the same in every process: greedy tokens are then meaningful
        llm.apply_model(_reinitialize)
    records = []
    for case in spec["cases"]:
        prompts, new = workload(case, config["vocab_size"])
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False,
                                logprobs=5 if eager else None)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        if not eager:
            llm.generate(inputs[:8], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))  # warm-up
        torch_sync()
        t0 = time.time()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.time() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(p) for p in prompts)
        record = dict(op="vllm-generate", model=spec["model"], case=case, backend=spec["backend"],
                      kv_cache_gib=spec.get("kv_cache_gib"),
                      attention_backend=attention, kv_cache_dtype=cache_dtype, our_moe=our_moe, seconds=seconds,
                      engine_start_s=init_s, prompts=len(prompts), prompt_tokens=prompt_tokens,
                      output_tokens=generated, tokens_per_s=(prompt_tokens + generated) / seconds,
                      output_tokens_per_s=generated / seconds)
        if eager:
            record["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            record["first_logprobs"] = [{int(k): float(v.logprob) for k, v in o.outputs[0].logprobs[0].items()}
                                        for o in outs]
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k not in ("tokens", "first_logprobs")}), flush=True)
        if spec.get("profile"):  # prompts of another seed: the timed ones are in vLLM's prefix cache by now
            fresh = [{"prompt_token_ids": p} for p in workload(case, config["vocab_size"], seed=1)[0]]
            _profile(llm, fresh, params, os.path.join(spec["profile"], f"{spec['model']}-{case}-{spec['backend']}"))
    return records


def _profile(llm, inputs, params, stem: str) -> None:
    """The same generate once more under torch.profiler (the engine runs in this process): the kernels by their
    total CUDA time (graph replays included) in ``stem``.txt, with the share of the whole."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: a run holds ~10^5 of them
        llm.generate(inputs, params, use_tqdm=False)
        torch_sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]  # the kernels, memcpys and memsets
    total = sum(e.self_device_time_total for e in events) or 1.0
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:40]
    with open(stem + ".txt", "w") as f:
        f.write(f"CUDA time {total / 1e3:.1f} ms over the run\n")
        for e in rows:
            f.write(f"{e.self_device_time_total / 1e3:10.2f} ms {100 * e.self_device_time_total / total:5.1f}% "
                    f"{e.count:7d}x  {e.key[:110]}\n")


def _reinitialize(model) -> None:
    import torch

    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            if "norm" in name:
                p.fill_(1.0)
            elif p.is_floating_point():
                g = torch.Generator(device=p.device).manual_seed(1000 + i)
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * 0.02)


def torch_sync() -> None:
    import torch

    torch.cuda.synchronize()


def agree(out: str) -> int:
    """Greedy tokens and first-step logprobs of ours against FLASH_ATTN (and TRITON_ATTN against it: what two of
    vLLM's own backends agree to), tiny Llama and Qwen3-MoE, eager."""
    runs = {"llama": ["vllm-fa3", "vllm-triton", "flashmoe", "flashmoe-fp8"],
            "qwen3moe": ["vllm-fa3", "vllm-triton", "flashmoe", "flashmoe-attn"]}
    records, ok = [], True
    with open(os.path.join(out, "vllm-agree.log"), "w") as log:
        for model, backends in runs.items():
            by = {}
            for backend in backends:
                spec = dict(mode="agree", model=model, config=TINY[model], backend=backend, cases=["agree"],
                            memory=0.3, timeout=300)
                got = spawn(__file__, spec, log)
                if got:
                    by[backend] = got[0]
            base = by.get("vllm-fa3")
            for backend, rec in by.items():
                if base is None or backend == "vllm-fa3":
                    continue
                same = sum(a == b for a, b in zip(rec["tokens"], base["tokens"]))
                prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                          for a, b in zip(rec["tokens"], base["tokens"])]
                diffs = [abs(lp[t] - bl[t]) for lp, bl in zip(rec["first_logprobs"], base["first_logprobs"])
                         for t in lp if t in bl]
                line = dict(model=model, backend=backend, vs="vllm-fa3", prompts=len(prefix),
                            prompts_equal_32=same, first_divergence=prefix, first_step_logprob_max_diff=max(diffs))
                records.append(line)
                print(json.dumps(line), flush=True)
            # ours must agree with FLASH_ATTN as closely as TRITON_ATTN does (random weights leave near-ties that
            # any two bf16 backends break differently); an e4m3 cache is held to the logprobs only
            judge = next((r for r in records if r["model"] == model and r["backend"] == "vllm-triton"), None)
            for r in (r for r in records if r["model"] == model and r["backend"].startswith("flashmoe")):
                if judge is None:
                    continue
                close = r["first_step_logprob_max_diff"] <= 2 * judge["first_step_logprob_max_diff"] + 0.01
                tokens = r["backend"].endswith("fp8") or r["prompts_equal_32"] >= judge["prompts_equal_32"] - 1
                ok &= close and tokens
            missing = set(backends) - set(by)
            if missing:
                ok = False
                print(f"AGREE {model}: no result from {sorted(missing)}", flush=True)
    json.dump(envelope(records, "vllm"), open(os.path.join(out, "vllm-agree.json"), "w"), indent=1)
    print("AGREE", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def bench(out: str, models: list[str], backends: list[str], cases: list[str], name: str,
          kv_cache_gib: float | None = None, profile: str | None = None) -> int:
    records = []
    path = os.path.join(out, f"vllm-generate-{name}.json")
    with open(os.path.join(out, f"vllm-generate-{name}.log"), "w") as log:
        for model in models:
            for backend in backends:
                if backend == "flashmoe-attn" and model != "qwen3moe":
                    continue
                spec = dict(mode="bench", model=model, config=MODELS[model], backend=backend, cases=cases,
                            kv_cache_gib=kv_cache_gib, profile=profile)
                records += spawn(__file__, spec, log)
                json.dump(envelope(records, "vllm"), open(path, "w"), indent=1)
    for r in records:
        print(f"{r['model']:9} {r['case']:8} {r['backend']:14} {r['tokens_per_s']:10.0f} tok/s "
              f"{r['output_tokens_per_s']:9.0f} out/s  start {r['engine_start_s']:.0f}s", flush=True)
    return 0 if records else 1


ONLINE = ((1, 16), (8, 64), (64, 256))  # (concurrency, requests)


async def _load(port: int, prompts: list[list[int]], new: int, concurrency: int) -> list[dict]:
    """Streams ``prompts`` to /v1/completions, ``concurrency`` at a time: per request the time to the first token
    and the gaps between tokens (each streamed chunk is one decode step's token)."""
    import asyncio

    import aiohttp

    queue, done = list(prompts), []

    async def one(client, prompt):
        body = dict(model="m", prompt=prompt, max_tokens=new, temperature=0.0, ignore_eos=True, stream=True,
                    return_token_ids=True)
        start, times = time.perf_counter(), []
        async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter())
        done.append(dict(prompt=len(prompt), ttft=times[0] - start, itl=[b - a for a, b in zip(times, times[1:])]))

    async def worker(client):
        while queue:
            await one(client, queue.pop())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done


def _stop(server: subprocess.Popen) -> None:
    """Ends the server's process group (the API server and its engine core): SIGTERM, then SIGKILL after 60 s."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait_s)
            time.sleep(5)  # the engine core leaves after the server
            os.killpg(server.pid, 0)  # raises once the whole group is gone
        except (subprocess.TimeoutExpired, PermissionError):
            continue
        except ProcessLookupError:
            return


def online(out: str, models: list[str], backends: list[str], name: str) -> int:
    """`vllm serve` per backend (vLLM's defaults, one process each) loaded at concurrency 1, 8 and 64 by prompts of
    256..2048 tokens, 128 new: p50/p99 time to first token and inter-token latency (op ``vllm-serve``)."""
    import asyncio
    import statistics
    import urllib.request

    records, port = [], 8123
    path = os.path.join(out, f"vllm-serve-{name}.json")
    for model in models:
        for backend in backends:
            attention, our_moe, cache_dtype = BACKENDS[backend]
            model_dir = tempfile.mkdtemp()
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(MODELS[model], f)
            env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
            if our_moe:
                env["FLASHMOE_SCIENCE_VLLM_MOE"] = "1"
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--served-model-name", "m", "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                   "--attention-backend", attention, "--kv-cache-dtype", cache_dtype, "--max-model-len",
                   str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.85", "--port", str(port)]
            log = open(os.path.join(out, f"vllm-serve-{name}-{model}-{backend}.log"), "w")
            # its own process group: the engine core is the server's child, and both must be gone (with their GPU
            # memory) before the next backend's server starts
            server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                deadline = time.time() + 300
                while time.time() < deadline and server.poll() is None:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                        break
                    except OSError:
                        time.sleep(2)
                else:
                    print(f"{model} {backend}: the server did not start (see its log)", flush=True)
                    continue
                vocab = MODELS[model]["vocab_size"]
                asyncio.run(_load(port, workload("prefill", vocab, seed=99)[0][:8], 8, 8))  # warm-up
                for level, (concurrency, count) in enumerate(ONLINE):
                    # prompts of a seed per level: none of them is in vLLM's prefix cache from an earlier level
                    prompts, new = workload("prefill", vocab, seed=level)
                    got = asyncio.run(_load(port, prompts[:count], new, concurrency))
                    itl = sorted(g for r in got for g in r["itl"])
                    ttft = sorted(r["ttft"] for r in got)
                    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
                    record = dict(op="vllm-serve", model=model, backend=backend, concurrency=concurrency,
                                  requests=count, ttft_p50_ms=q(ttft, 0.5), ttft_p99_ms=q(ttft, 0.99),
                                  itl_p50_ms=q(itl, 0.5), itl_p99_ms=q(itl, 0.99),
                                  itl_mean_ms=statistics.fmean(itl) * 1e3 if itl else None,
                                  ttft_ms_by_prompt=sorted([r["prompt"], round(r["ttft"] * 1e3, 2)] for r in got))
                    records.append(record)
                    print(json.dumps({k: v for k, v in record.items() if k != "ttft_ms_by_prompt"}), flush=True)
                    json.dump(envelope(records, "vllm"), open(path, "w"), indent=1)
            finally:
                _stop(server)
    return 0 if records else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        json.dump(_worker(json.loads(argv[1])), open(argv[2], "w"))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["agree", "bench", "online"])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--models", default="llama8b,qwen3moe")
    p.add_argument("--backends", default="flashmoe,flashmoe-attn,vllm-fa3,vllm-triton")
    p.add_argument("--cases", default="prefill,decode")
    p.add_argument("--name", default="run")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="the KV cache's bytes, the same for every backend (an e4m3 cache then holds twice the tokens); "
                        "default: what gpu_memory_utilization 0.85 leaves")
    p.add_argument("--profile", metavar="DIR", help="bench: after each timed case, run it once more under "
                   "torch.profiler and write its kernels' CUDA time to DIR/<model>-<case>-<backend>.txt")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.what == "agree":
        return agree(a.out)
    if a.what == "online":
        return online(a.out, a.models.split(","), a.backends.split(","), a.name)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    return bench(a.out, a.models.split(","), a.backends.split(","), a.cases.split(","), a.name, a.kv_cache_gib,
                 a.profile and os.path.abspath(a.profile))


if __name__ == "__main__":
    sys.exit(main())
