"""The SGLang plugin on a GPU (not collected by pytest): the ``flashmoe`` attention backend against SGLang's own
``triton`` backend in SGLang 0.5.17, our batch translation against float64, and the fused MoE switch
(``FLASHMOE_SCIENCE_SGLANG_MOE=1``) against SGLang's own MoE kernel.

On the GPU machine, after the SGLang kit's install call (``../shared/peers/sglang/README.md``: SGLang in
``/tmp/sgsite``), from the repository root:

    export PYTHONPATH=src:/tmp/sgsite SGLANG_IS_FLASHINFER_AVAILABLE=false TVM_FFI_CACHE_DIR=/tmp/sgjit \\
           HF_HUB_OFFLINE=1 PATH="$(dirname "$(python3 -c 'import sys;print(sys.executable)')"):$PATH"
    python3 tests/integrations/gpu_sglang_backend.py [float64|engine|moe|all] [--eager]

- ``float64``: ``pytest -m gpu tests/integrations/test_sglang_metadata.py tests/integrations/test_sglang_moe.py``:
  SGLang-shaped decode and extend batches (pages of 16 and 64, bf16 and e4m3 pools, decodes up to 32k keys, extends
  with prefixes) within twice PyTorch's bf16 error of float64; the MoE method's forward (on stand-ins of SGLang's
  classes) in bf16 against float64, eager and replayed in a CUDA graph.
- ``engine``: a random two-layer Llama (config.json only, ``load_format="dummy"``, no tokenizer) served by
  ``sglang.Engine`` with ``attention_backend="triton"`` and then ``"flashmoe"`` (``page_size=16``, decode CUDA graphs
  unless ``--eager``): greedy tokens and first-step logprobs of the same prompts, a repeated long prompt (a
  prefix-cache hit: an extend with prefix keys), and a batch that mixes prompt lengths. Passes when every first
  token agrees or is a tie (ours is among SGLang's ``TOP_LOGPROBS`` likeliest first tokens, within
  ``LOGPROB_TOLERANCE`` of its choice), the first-step logprobs agree within ``LOGPROB_TOLERANCE``, and at least
  ``TOKEN_AGREEMENT`` of all greedy tokens agree (random weights give near-tied logits, so later tokens may part).
- ``moe``: a random four-layer Qwen3-MoE (16 experts, top-4) served with SGLang's ``triton`` attention, first as is
  and then with ``FLASHMOE_SCIENCE_SGLANG_MOE=1`` (our fused MoE in place of SGLang's triton MoE runner), then with
  both ours (``flashmoe`` attention: Qwen3's rope writes the pool itself), the same prompts and the same criteria;
  and the logprobs must not be bit-identical to SGLang's (else the switch did not
  take effect in the scheduler processes). Its weights are a checkpoint written here (normal, std 0.02, in
  Qwen3-MoE's per-expert names), not SGLang's dummy ones: those are uniform in +-1e-3, which leaves the experts'
  output below bf16's rounding of the residual stream, so the MoE would hardly reach the logits.

The package is not pip-installed on the GPU machine, so the script writes the ``sglang.srt.plugins`` entry point
(pyproject.toml's) into a dist-info folder on PYTHONPATH: SGLang's scheduler processes, started by spawn, load the
plugin from there as they would from an installed package.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN_AGREEMENT = 0.9
LOGPROB_TOLERANCE = 0.05
TOP_LOGPROBS = 5
NEW_TOKENS = 16

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
MOE_CONFIG = {  # benchmarks/tools/vllm_generate.py's TINY["qwen3moe"]
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 1024,
    "intermediate_size": 6144, "moe_intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
MOE_SWITCH = "FLASHMOE_SCIENCE_SGLANG_MOE"
INIT_STD = 0.02  # transformers' initializer_range for Qwen3-MoE


def float64_check() -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           *(str(ROOT / "tests/integrations" / name) for name in ("test_sglang_metadata.py", "test_sglang_moe.py"))]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode == 0


def install_entry_point(folder: Path) -> None:
    """pyproject.toml's ``sglang.srt.plugins`` entry point as an installed distribution would carry it."""
    info = folder / "flashmoe_science_sglang_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashmoe-science-sglang-plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nflashmoe_science = flashmoe_science.integrations.sglang:register\n")
    (info / "RECORD").write_text("")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(folder))


def prompts() -> dict:
    long = [1] + [(37 * j) % 8000 + 3 for j in range(1500)]
    return {
        "short and long": [[1, 5, 9, 42, 7], list(range(3, 300)), [1] + [100 + i % 50 for i in range(700)]],
        "mixed lengths": [[1] + [(7 * i + 13 * j) % 8000 + 3 for j in range(64 + 97 * i)] for i in range(12)],
        "prefix hit": [long, long[:1200] + [5, 6, 7]],  # the second shares 1200 cached keys with the first
    }


def qwen3_moe_checkpoint(config: dict, folder: Path, seed: int = 0) -> None:
    """Random weights for ``config`` as a Qwen3-MoE checkpoint names them (one tensor per expert projection):
    matrices normal with std ``INIT_STD``, norms ones; bf16 safetensors."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, hd, vocab, ff = config["hidden_size"], config["head_dim"], config["vocab_size"], config["moe_intermediate_size"]

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * INIT_STD).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": ones(h),
               "lm_head.weight": normal(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(config["num_attention_heads"] * hd, h),
            p + "self_attn.k_proj.weight": normal(config["num_key_value_heads"] * hd, h),
            p + "self_attn.v_proj.weight": normal(config["num_key_value_heads"] * hd, h),
            p + "self_attn.o_proj.weight": normal(h, config["num_attention_heads"] * hd),
            p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate.weight": normal(config["num_experts"], h)})
        for e in range(config["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            weights.update({q + "gate_proj.weight": normal(ff, h), q + "up_proj.weight": normal(ff, h),
                            q + "down_proj.weight": normal(h, ff)})
    save_file(weights, str(folder / "model.safetensors"))


def generate(backend: str, model_dir: str, eager: bool, our_moe: bool = False, load_format: str = "dummy") -> dict:
    """Greedy tokens and their logprobs per prompt group; ``our_moe``: with the MoE switch in the environment the
    scheduler processes inherit (the plugin reads it when SGLang loads it there)."""
    import sglang

    if our_moe:
        os.environ[MOE_SWITCH] = "1"
    else:
        os.environ.pop(MOE_SWITCH, None)
    kw = dict(model_path=model_dir, load_format=load_format, skip_tokenizer_init=True, attention_backend=backend,
              page_size=16, sampling_backend="pytorch", dtype="bfloat16", context_length=4096,
              mem_fraction_static=0.4, disable_cuda_graph=eager, random_seed=0, log_level="warning")
    if not eager:
        kw.update(cuda_graph_max_bs_decode=32, disable_prefill_cuda_graph=True)
    start = time.time()
    engine = sglang.Engine(**kw)
    print(f"{backend}{' with our MoE' if our_moe else ''}: engine up in {time.time() - start:.1f} s", flush=True)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    results = {}
    try:
        for name, batch in prompts().items():
            if name == "prefix hit":  # one after the other, so the second finds the first's keys cached
                outs = [engine.generate(input_ids=[p], sampling_params=params, return_logprob=True,
                                        top_logprobs_num=TOP_LOGPROBS)[0] for p in batch]
            else:
                outs = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                       top_logprobs_num=TOP_LOGPROBS)
            # per prompt: greedy ids, their logprobs, and the first step's likeliest tokens {id: logprob}
            results[name] = [(list(o["output_ids"]), [float(e[0]) for e in o["meta_info"]["output_token_logprobs"]],
                              {int(e[1]): float(e[0]) for e in o["meta_info"]["output_top_logprobs"][0]})
                             for o in outs]
    finally:
        engine.shutdown()
    return results


def tied(token: int, ref_token: int, ref_logprob: float, ref_top: dict) -> bool:
    """``token`` is ``ref_token`` (of logprob ``ref_logprob``) or, among the reference first step's likeliest
    ``ref_top``, within ``LOGPROB_TOLERANCE`` of it."""
    return token == ref_token or (token in ref_top and ref_logprob - ref_top[token] <= LOGPROB_TOLERANCE)


def agreement(ours: dict, theirs: dict, label: str, eager: bool) -> bool:
    """Every first token agrees or ties, first-step logprobs within ``LOGPROB_TOLERANCE``, ``TOKEN_AGREEMENT`` of
    all greedy tokens."""
    ok, agree, total = True, 0, 0
    for name in ours:
        for i, ((ids, lps, _), (ref_ids, ref_lps, ref_top)) in enumerate(zip(ours[name], theirs[name])):
            same = sum(a == b for a, b in zip(ids, ref_ids))
            agree, total = agree + same, total + len(ref_ids)
            first_lp = abs(lps[0] - ref_lps[0])
            if ids[0] != ref_ids[0]:
                print(f"{name} #{i}: first token {ids[0]} against {ref_ids[0]}; the reference's first step: "
                      + ", ".join(f"{t}: {lp:.4f}" for t, lp in sorted(ref_top.items(), key=lambda e: -e[1])))
            tie = tied(ids[0], ref_ids[0], ref_lps[0], ref_top)
            failed = [why for why, bad in (("first token differs, not a tie", not tie),
                                           ("first-step logprob", first_lp > LOGPROB_TOLERANCE),
                                           (f"{len(ids)} tokens", len(ids) != NEW_TOKENS)) if bad]
            ok &= not failed
            split = next((j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), None)
            print(f"{name} #{i}: {same}/{len(ref_ids)} tokens agree"
                  + (f" (first difference at token {split})" if split is not None else "")
                  + f", first-step logprob diff {first_lp:.4f}" + (f"; FAILS: {', '.join(failed)}" if failed else ""))
    print(f"greedy tokens agreeing with {label}: {agree}/{total} ({agree / total:.3f}); "
          f"CUDA graphs {'off' if eager else 'on (decode)'}")
    return ok and agree >= TOKEN_AGREEMENT * total


def served(config: dict, runs: list[tuple[str, bool]], eager: bool, checkpoint=None) -> list[dict]:
    """``generate`` of a random model with ``config`` for each (attention backend, our MoE) of ``runs``: SGLang's
    dummy weights, or those ``checkpoint(config, folder)`` writes."""
    with tempfile.TemporaryDirectory() as tmp:
        install_entry_point(Path(tmp) / "site")
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        if checkpoint is not None:
            checkpoint(config, model_dir)
        load_format = "dummy" if checkpoint is None else "safetensors"
        return [generate(backend, str(model_dir), eager, our_moe, load_format) for backend, our_moe in runs]


def engine_check(eager: bool) -> bool:
    ours, theirs = served(CONFIG, [("flashmoe", False), ("triton", False)], eager)
    return agreement(ours, theirs, "SGLang's triton backend", eager)


def moe_check(eager: bool) -> bool:
    theirs, ours, both = served(MOE_CONFIG, [("triton", False), ("triton", True), ("flashmoe", True)], eager,
                                checkpoint=qwen3_moe_checkpoint)
    if ours == theirs:
        print(f"{MOE_SWITCH}=1 gave SGLang's own results to the bit: the switch did not take effect")
        return False
    ok = agreement(ours, theirs, "SGLang's triton MoE runner (Qwen3-MoE, triton attention)", eager)
    # Qwen3's rope writes K and V into the pool itself (save_kv_cache=False), through the backend's pool
    return agreement(both, theirs, "SGLang's triton attention and MoE (Qwen3-MoE, ours for both)", eager) and ok


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    what = args[0] if args else "all"
    ok = True
    if what in ("float64", "all"):
        ok &= float64_check()
    if what in ("engine", "all"):
        ok &= engine_check("--eager" in sys.argv)
    if what in ("moe", "all"):
        ok &= moe_check("--eager" in sys.argv)
    print("SGLANG BACKEND", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":  # SGLang starts its scheduler by spawn: keep the work under this guard
    sys.exit(main())
