"""vLLM 0.26 with our fused MoE for its unquantized MoE layers (FLASHMOE_SCIENCE_VLLM_MOE), on one GPU.

Not collected by pytest (no test_ prefix): it needs vLLM, which pins its own CUDA torch. Run from the repository root:

    PYTHONPATH=src:/tmp/site python3 tests/integrations/gpu_vllm_moe.py [--models qwen3,mixtral] [--no-graphs]

1. kernel: our method's ``apply`` and vLLM's ``fused_experts`` on the same routing (vLLM's ``fused_topk``, and the
   fused grouped top-k that its ``grouped_topk`` runs on CUDA, with sigmoid scores, a score-correction bias and
   routed scaling), each against a float64 reference: ours must be within 1.5x vLLM's error plus 2e-3 (errors
   relative to the output's largest magnitude).
2. graph: our call captured in a CUDA graph and replayed on new inputs matches the eager call (within 1% of its
   largest magnitude: float32 atomics add in any order); a host synchronisation would fail the capture.
3. model: small random Qwen3-MoE and Mixtral models (2 layers, ``load_format="dummy"``, no tokenizer, offline), one
   process per run: vLLM's MoE (eager) against ours (eager, then torch.compile with CUDA graphs for the first
   model). After loading, every weight is redrawn with a fixed seed at unit scale (vLLM's dummy weights are
   ~1e-3: the MoE would not move the logits). Compared: which method each MoE layer holds, the prompt tokens'
   logprobs, and 16 greedy tokens for a batch of three prompts and for one prompt alone (the one-token decode
   kernel); greedy sequences may part only where vLLM's own top two logprobs were within 0.1 of each other.

Prints one PASS/FAIL line per check and exits 1 on any FAIL.
"""

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = {
    "qwen3": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 4096,
        "hidden_size": 1024, "intermediate_size": 3072, "moe_intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 4096, "hidden_size": 1024,
        "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu", "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}
PROMPTS = [[1, 5, 9, 42, 7], list(range(3, 300)), [1] + [100 + i % 50 for i in range(700)]]
NEW_TOKENS = 16
PROMPT_LOGPROB_MAX, PROMPT_LOGPROB_MEAN = 0.25, 0.03  # |ours - vLLM's| over every prompt position, nats
NEAR_TIE = 0.1  # greedy sequences may part where vLLM's top two logprobs are this close
SWITCH = "FLASHMOE_SCIENCE_VLLM_MOE"
CHILD_TIMEOUT_S = 300
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

FAILED = []


def report(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


# --------------------------------------------------------------------------------------------- 1. kernel
def kernel_checks():
    import torch
    from vllm.model_executor.layers.fused_moe import fused_experts as vllm_fused_experts
    from vllm.model_executor.layers.fused_moe import fused_topk
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import fused_grouped_topk

    from flashmoe_science.integrations.vllm.moe import FlashMoEUnquantizedMethod
    from flashmoe_science.moe.reference import fused_experts_reference

    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        context = set_current_vllm_config(VllmConfig())
    except Exception as error:  # vLLM's kernel reads its tuned configs without one too
        print(f"(no vLLM config context: {error})")
        from contextlib import nullcontext
        context = nullcontext()

    torch.manual_seed(0)
    dev = "cuda"
    cases = [  # name, E, d, F, top_k, token counts, routing
        ("qwen3-30b-a3b layer", 128, 2048, 768, 8, (1, 2, 7, 256, 1000), "softmax"),
        ("mixtral tp8 shard", 8, 4096, 1792, 2, (1, 3, 512), "softmax"),
        ("grouped sigmoid+bias+scale", 64, 1024, 256, 6, (1, 5, 300), "grouped"),
    ]
    with context, torch.inference_mode():
        for name, num_experts, d, f, top_k, token_counts, routing in cases:
            w13 = (torch.randn(num_experts, 2 * f, d, device=dev) * d ** -0.5).to(torch.bfloat16)
            w2 = (torch.randn(num_experts, d, f, device=dev) * f ** -0.5).to(torch.bfloat16)
            w13_64, w2_64 = w13.double(), w2.double()
            layer = type("Layer", (), {"w13_weight": w13, "w2_weight": w2})()  # what apply reads of vLLM's layer
            bias = torch.randn(num_experts, device=dev) * 0.1
            for tokens in token_counts:
                x = torch.randn(tokens, d, device=dev).to(torch.bfloat16)
                logits = torch.randn(tokens, num_experts, device=dev)
                try:
                    if routing == "softmax":
                        weights, ids, _ = fused_topk(x, logits, top_k, renormalize=True)
                    else:  # DeepSeek-V3's routing (vLLM's grouped_topk calls it on CUDA)
                        weights, ids = fused_grouped_topk(x, logits, top_k, renormalize=True,
                                                          e_score_correction_bias=bias, num_expert_group=8,
                                                          topk_group=4, scoring_func="sigmoid",
                                                          routed_scaling_factor=2.5)
                except Exception as error:
                    print(f"SKIP kernel {name} T={tokens}: vLLM's routing failed: {type(error).__name__}: {error}")
                    continue
                ours = FlashMoEUnquantizedMethod.apply(None, layer, x, weights, ids)  # apply does not read self
                theirs = vllm_fused_experts(x.clone(), w13, w2, weights, ids)
                ref = fused_experts_reference(x.double(), w13_64, w2_64, weights.double(), ids)
                scale = ref.abs().max().item()
                err_ours = (ours.double() - ref).abs().max().item() / scale
                err_theirs = (theirs.double() - ref).abs().max().item() / scale
                ok = (ours.dtype == x.dtype and ours.shape == x.shape and ids.dtype == torch.int32
                      and err_ours <= 1.5 * err_theirs + 2e-3)
                report(f"kernel {name} T={tokens}", ok,
                       f"max error / max |ref|: ours {err_ours:.2e}, vLLM's {err_theirs:.2e} (bf16, vs float64)")
            del w13, w2, w13_64, w2_64, layer
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- 2. graph
def graph_checks():
    import torch

    from flashmoe_science.integrations.vllm.moe_config import run_experts

    torch.manual_seed(1)
    dev, num_experts, d, f, top_k = "cuda", 64, 1024, 384, 8
    w13 = (torch.randn(num_experts, 2 * f, d, device=dev) * d ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, d, f, device=dev) * f ** -0.5).to(torch.bfloat16)

    def routing(tokens):
        probs = torch.randn(tokens, num_experts, device=dev).softmax(-1)
        weights, ids = probs.topk(top_k, dim=-1)
        return torch.randn(tokens, d, device=dev).to(torch.bfloat16), weights / weights.sum(-1, keepdim=True), \
            ids.to(torch.int32)

    for tokens in (1, 8, 64):
        x, weights, ids = routing(tokens)
        try:
            with torch.inference_mode():
                for _ in range(2):  # compile, then the prepared call that the capture records
                    run_experts(x, w13, w2, weights, ids)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = run_experts(x, w13, w2, weights, ids)
                new_x, new_weights, new_ids = routing(tokens)
                x.copy_(new_x)
                weights.copy_(new_weights)
                ids.copy_(new_ids)
                graph.replay()
                eager = run_experts(new_x, w13, w2, new_weights, new_ids)
                torch.cuda.synchronize()
            diff = (out.float() - eager.float()).abs().max().item()
            scale = eager.float().abs().max().item()
            report(f"graph T={tokens}", diff <= 1e-2 * scale,
                   f"replay vs eager max |diff| {diff:.2e} (scale {scale:.2f})")
        except Exception as error:  # a host synchronisation fails the capture
            report(f"graph T={tokens}", False, f"{type(error).__name__}: {error}")
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- 3. model
def redraw_weights(model):
    """Every parameter redrawn with a fixed seed at unit scale: norms 1, other vectors 0, embeddings N(0, 1), matrices
    N(0, 1/fan_in) (fan_in = the last dim: (out, in) linears, w13 (E, 2F, d), w2 (E, d, F))."""
    import torch

    generator = torch.Generator(device="cuda")
    generator.manual_seed(1234)
    with torch.inference_mode():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0, generator=generator)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    return True


def moe_methods(model):
    counts = {}
    for module in model.modules():
        if type(module).__name__ == "RoutedExperts":
            name = type(module.quant_method).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def child(model_name, mode, out_path):
    """One engine: mode "off" (vLLM's MoE), "on" (ours, eager) or "graphs" (ours, torch.compile + CUDA graphs)."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    if mode == "off":
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = "1"
        from flashmoe_science.integrations.vllm.moe import register_moe

        register_moe()  # what the plugin's register() does under the switch (the entry point may not be installed)
    model_dir = f"/tmp/flashmoe_vllm_moe_{model_name}"
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as file:
        json.dump(MODELS[model_name], file, indent=1)

    from vllm import LLM, SamplingParams

    kwargs = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=1024, gpu_memory_utilization=0.3, seed=0, enforce_eager=mode != "graphs")
    if mode == "off":
        kwargs["moe_backend"] = "triton"  # vLLM's weights in their loaded layout, which redraw_weights writes
    if mode == "graphs":
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        kwargs["max_num_seqs"] = 8
    start = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - start
    methods = llm.apply_model(moe_methods)[0]
    llm.apply_model(redraw_weights)

    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                                                  detokenize=False), use_tqdm=False)
    prompt_lp = []
    for output, ids in zip(scored, PROMPTS):
        positions = list(output.prompt_logprobs)
        prompt_lp.append([positions[i][ids[i]].logprob for i in range(1, len(ids))])

    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2, detokenize=False)

    def generate(batch):
        result = []
        for output in llm.generate(batch, greedy, use_tqdm=False):
            sample = output.outputs[0]
            steps = [sorted(((lp.rank, tid, lp.logprob) for tid, lp in step.items()), key=lambda r: r[0])
                     for step in sample.logprobs]
            result.append({"tokens": list(sample.token_ids), "top": steps})
        return result

    record = {"methods": methods, "init_s": init_s, "prompt_lp": prompt_lp, "batch": generate(prompts),
              "single": generate(prompts[:1])}
    with open(out_path, "w") as file:
        json.dump(record, file)


def run_child(model_name, mode):
    out_path = f"/tmp/flashmoe_vllm_moe_{model_name}_{mode}.json"
    if os.path.exists(out_path):
        os.remove(out_path)
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model_name, mode, out_path],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        report(f"model {model_name} {mode} run", False, f"no result after {CHILD_TIMEOUT_S}s")
        return None
    wall = time.time() - start
    if proc.returncode != 0 or not os.path.exists(out_path):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        report(f"model {model_name} {mode} run", False, f"exit {proc.returncode} after {wall:.0f}s\n{tail}")
        return None
    with open(out_path) as file:
        record = json.load(file)
    print(f"     {model_name} {mode}: engine start {record['init_s']:.0f}s, process {wall:.0f}s", flush=True)
    return record


def compare_sequences(theirs, ours):
    """(ok, detail): equal tokens, or parted only at a near tie of vLLM's own top two."""
    worst = []
    ok = True
    for index, (a, b) in enumerate(zip(theirs, ours)):
        if a["tokens"] == b["tokens"]:
            continue
        step = next(i for i, (s, t) in enumerate(zip(a["tokens"], b["tokens"])) if s != t)
        top = a["top"][step]
        gap = top[0][2] - top[1][2] if len(top) > 1 else float("inf")
        tie = gap < NEAR_TIE
        ok &= tie
        worst.append(f"seq {index} parts at step {step} (vLLM's top-2 gap {gap:.3f}{', a near tie' if tie else ''})")
    first = max(abs(a["top"][0][0][2] - b["top"][0][0][2]) for a, b in zip(theirs, ours))
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(theirs, ours))
    return ok, f"{same}/{len(theirs)} sequences equal; first-step top-1 logprob max |diff| {first:.3f}" + \
        ("; " + "; ".join(worst) if worst else "")


def model_checks(model_name, graphs):
    base = run_child(model_name, "off")
    if base is None:
        return
    report(f"model {model_name} off: vLLM's method", set(base["methods"]) == {"UnquantizedFusedMoEMethod"},
           f"MoE layers by method {base['methods']}")
    for mode in ("on", "graphs") if graphs else ("on",):
        record = run_child(model_name, mode)
        if record is None:
            continue
        report(f"model {model_name} {mode}: our method", set(record["methods"]) == {"FlashMoEUnquantizedMethod"}
               and sum(record["methods"].values()) == sum(base["methods"].values()),
               f"MoE layers by method {record['methods']}")
        diffs = [abs(a - b) for pa, pb in zip(base["prompt_lp"], record["prompt_lp"]) for a, b in zip(pa, pb)]
        worst, mean = max(diffs), sum(diffs) / len(diffs)
        ok = worst <= PROMPT_LOGPROB_MAX and mean <= PROMPT_LOGPROB_MEAN
        report(f"model {model_name} {mode}: prompt logprobs", ok,
               f"|ours - vLLM's| over {len(diffs)} positions: max {worst:.3f}, mean {mean:.4f} "
               f"(limits {PROMPT_LOGPROB_MAX}, {PROMPT_LOGPROB_MEAN})")
        for batch in ("batch", "single"):
            ok, detail = compare_sequences(base[batch], record[batch])
            report(f"model {model_name} {mode}: greedy {batch}", ok, detail)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3,mixtral", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--no-graphs", action="store_true", help="skip the torch.compile + CUDA-graph run")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    start = time.time()
    import torch
    import vllm

    print(f"torch {torch.__version__} vllm {vllm.__version__} gpu {torch.cuda.get_device_name(0)}", flush=True)
    kernel_checks()
    graph_checks()
    for index, model_name in enumerate(args.models.split(",")):
        model_checks(model_name, graphs=not args.no_graphs and index == 0)
    print(f"{'FAIL' if FAILED else 'PASS'} gpu_vllm_moe: {len(FAILED)} failed {FAILED} in {time.time() - start:.0f}s",
          flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
