"""The models and workloads that the serving-engine benchmarks share (``vllm_generate.py``, ``sglang_generate.py``):
random-weight configs of real models' shapes and token-id prompt sets, the same in every engine and backend, and
the one-process-per-backend runner with the records' envelope."""

import json
import subprocess
import sys
import tempfile

# every engine runs with this context length (the longest workload: 2048-token prompts + 128 new)
MAX_MODEL_LEN = 4096

MODELS = {
    # Llama-3.1-8B's shape
    "llama8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    torch_dtype="bfloat16"),
    # Qwen3-30B-A3B's shape with 24 of its 48 layers (one H100's memory with room for the cache)
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
}


def workload(case: str, vocab: int, seed: int = 0):
    """(prompts as token ids, new tokens): ``prefill`` 256 prompts of 256..2048 tokens, 128 new; ``decode`` 256
    prompts of 128, 512 new; ``agree`` 8 prompts of 5..1500, 32 new."""
    import random

    rng = random.Random(seed)
    lengths, new = {"prefill": ([rng.randint(256, 2048) for _ in range(256)], 128),
                    "decode": ([128] * 256, 512),
                    "agree": ([5, 17, 64, 200, 333, 700, 1024, 1500], 32)}[case]
    return [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths], new


def spawn(script: str, spec: dict, log) -> list[dict]:
    """``python script worker SPEC OUT`` in a process of its own (each engine frees the GPU when it exits): the
    records it wrote, or [] (said in one line) when it failed or ran past ``spec["timeout"]`` (540 s)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
        cmd = [sys.executable, script, "worker", json.dumps(spec), f.name]
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=spec.get("timeout", 540))
        except subprocess.TimeoutExpired:
            print(f"{spec['model']} {spec['backend']}: timed out (see the log)", flush=True)
            return []
        if done.returncode != 0:
            print(f"{spec['model']} {spec['backend']}: exit {done.returncode} (see the log)", flush=True)
            return []
        return json.load(open(f.name))


def envelope(records: list[dict], *packages: str) -> dict:
    """The run's GPU, versions (with those of ``packages``, e.g. the engine) and commit around its records."""
    import importlib.metadata

    from flashmoe_science.bench.report import environment_metadata, resolve_commit

    meta = environment_metadata(resolve_commit())
    meta.update({name.replace("-", "_"): importlib.metadata.version(name) for name in packages})
    return {**meta, "max_model_len": MAX_MODEL_LEN, "records": records}
