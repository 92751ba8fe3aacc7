"""The first training step of a fresh process: our attention on an empty Triton cache, after `flashmoe-science
warmup`, and transformers' sdpa, side by side.

Each measurement is a new Python process (``--child``) that builds the dense Llama-style model of
bench_hf_models.py, then times its first forward + backward on the padded batch (our varlen path) and then its first
on the full batch (our dense path), each from issue to the device's end, and a second padded step (the steady
state). The parent runs, in this order: sdpa; ours with an empty cache (``cold``); ``flashmoe-science warmup`` for
the model's config into another empty cache (its wall time); ours on that cache (``warm``). With ``--profile`` the
warm child also writes the cProfile of its first step (what the first call still spends). One JSON line per run.

    PYTHONPATH=src python benchmarks/tools/first_call.py --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def _timed(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def child(implementation: str, batch: int, length: int, vocab: int, profile: str | None) -> dict:
    start = time.perf_counter()
    import transformers

    sys.path.insert(0, str(HERE))
    from bench_hf_models import make_batch, model_configs

    from flashmoe_science.integrations import hf

    hf.register()
    torch.manual_seed(0)
    config = model_configs(vocab)["dense"]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                          dtype=torch.bfloat16).cuda()
    padded, full = (make_batch(kind, batch, length, vocab, "cuda") for kind in ("padded", "full"))
    ready = time.perf_counter() - start

    def step(ids, mask):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        return run

    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    first_padded = _timed(step(*padded))
    if profiler:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        pathlib.Path(profile).write_text(text.getvalue())
    first_full = _timed(step(*full))
    second_padded = _timed(step(*padded))
    return dict(implementation=implementation, import_and_build_s=ready, first_padded_s=first_padded,
                first_full_s=first_full, second_padded_s=second_padded)


def _run_child(args, implementation: str, cache: str, profile: str | None = None) -> dict:
    command = [sys.executable, __file__, "--child", implementation, "--batch", str(args.batch), "--length",
               str(args.length), "--vocab", str(args.vocab)] + (["--profile", profile] if profile else [])
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    start = time.perf_counter()
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def _warmup(args, cache: str) -> float:
    sys.path.insert(0, str(HERE))
    from bench_hf_models import model_configs

    config_dir = tempfile.mkdtemp()
    model_configs(args.vocab)["dense"].save_pretrained(config_dir)
    command = [sys.executable, "-m", "flashmoe_science.cli", "warmup", "--hf-config", config_dir, "--seq-len",
               str(args.length), "--batch", str(args.batch), "--dtype", "bf16"]
    start = time.perf_counter()
    result = subprocess.run(command, env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True)
    print(result.stdout + result.stderr, flush=True)
    result.check_returncode()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help="with --child: write the first step's cProfile here")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", help="folder for first_call.json (and the warm first step's profile)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.length, args.vocab, args.profile)))
        return 0
    out = pathlib.Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp())
    runs = [dict(run="sdpa", **_run_child(args, "sdpa", str(root / "sdpa")))]
    print(json.dumps(runs[-1]), flush=True)
    runs.append(dict(run="cold", **_run_child(args, "fmoe_science", str(root / "cold"))))
    print(json.dumps(runs[-1]), flush=True)
    runs.append(dict(run="warmup", seconds=_warmup(args, str(root / "warm"))))
    print(json.dumps(runs[-1]), flush=True)
    runs.append(dict(run="warm", **_run_child(args, "fmoe_science", str(root / "warm"),
                                              str(out / "first_call_profile.txt"))))
    print(json.dumps(runs[-1]), flush=True)
    runs.append(dict(run="warm-again", **_run_child(args, "fmoe_science", str(root / "warm"))))
    print(json.dumps(runs[-1]), flush=True)
    (out / "first_call.json").write_text(json.dumps(dict(batch=args.batch, length=args.length, runs=runs), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
