"""The supercon benchmark: screening throughput (candidates/s end to end: candidate decoding, batching, the model,
the top-N merge) and training step time, the library build against the plain-PyTorch build on the same weights,
plus the agreement of their outputs. Writes JSON and a markdown table."""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmoe_science.bench.report import environment_metadata, resolve_commit, result_stem, unused_result_path
from flashmoe_science.science.progress import progress_bar
from flashmoe_science.science.supercon_data import CompositionSet, iterate_batches
from flashmoe_science.science.supercon_model import IMPLEMENTATIONS, CompositionTransformer, make_batch
from flashmoe_science.science.supercon_screen import CandidateSpace, score, screen
from flashmoe_science.science.supercon_train import _autocast


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def output_agreement(model: CompositionTransformer, space: CandidateSpace, count: int, dtype: torch.dtype,
                     mc_samples: int) -> dict:
    """Both builds in ``dtype`` against the plain build in float64 on the first ``count`` candidates (head
    dropout off, so the outputs are deterministic): max and mean absolute error of each, in kelvin."""
    padded = space.padded_batch(0, min(count, len(space)))
    reference_model = copy.deepcopy(model).double()
    reference = score(reference_model, type(padded)(padded.elements, padded.fractions.double(), padded.mask),
                      "plain", 0)[0]
    errors = {}
    for implementation in IMPLEMENTATIONS:
        predicted = score(model.cast_parameters(dtype), padded, implementation, 0)[0]
        error = (predicted.double() - reference).abs()
        errors[implementation] = {"max_abs_K": float(error.max()), "mean_abs_K": float(error.mean())}
    return {"candidates": padded.mask.shape[0], "dtype": str(dtype).removeprefix("torch."), "vs_float64": errors,
            "mc_samples_note": f"screening uses {mc_samples} MC-dropout head samples; this check runs dropout off"}


def screening_throughput(model: CompositionTransformer, space: CandidateSpace, candidates: int, batch_size: int,
                         mc_samples: int, rounds: int = 3, bar=None, implementations=IMPLEMENTATIONS) -> dict:
    """Candidates/s of each build (median of ``rounds`` runs over the same ``candidates``, after a warm-up of at
    most two batches and never more than ``candidates``); ``bar`` (a progress bar) advances by one per run."""
    results = {}
    warmup = min(2 * batch_size, candidates)
    for implementation in implementations:
        screen(model, space, top=100, batch_size=batch_size, implementation=implementation, mc_samples=mc_samples,
               limit=warmup, progress=False)  # warm-up: compilation, autotuning, allocator
        runs = []
        for _ in range(rounds):
            runs.append(screen(model, space, top=100, batch_size=batch_size, implementation=implementation,
                               mc_samples=mc_samples, limit=candidates, progress=False))
            _advance(bar, f"screening, {implementation}")
        per_s = [run["candidates_per_s"] for run in runs]
        results[implementation] = {"candidates_per_s": statistics.median(per_s), "rounds": per_s,
                                   "candidates": runs[0]["candidates"]}
    return results


def training_step_ms(model: CompositionTransformer, data: CompositionSet, batch_size: int, device: torch.device,
                     steps: int = 30, warmup: int = 5, bar=None) -> dict:
    """Median ms of one training step (forward, L1 loss, backward, AdamW) of each build, from the same weights,
    on the same batches of the data (bf16 autocast on a GPU); ``bar`` advances by one per build."""
    results = {}
    generator = torch.Generator().manual_seed(0)
    chunks = list(iterate_batches(torch.arange(len(data)), batch_size, generator))
    chunks = [chunks[i % len(chunks)] for i in range(steps + warmup)]  # small data: batches reused
    for implementation in IMPLEMENTATIONS:
        trained = copy.deepcopy(model).float().train()
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-4)
        times = []
        for step, chunk in enumerate(chunks):
            _synchronize(device)
            started = time.perf_counter()
            batch = make_batch(data.batch(chunk).to(device), implementation)
            with _autocast(device):
                predicted = trained(batch)
            loss = torch.nn.functional.l1_loss(predicted, data.targets[chunk].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            _synchronize(device)
            if step >= warmup:
                times.append(1e3 * (time.perf_counter() - started))
        results[implementation] = {"median_ms": statistics.median(times), "steps": len(times)}
        _advance(bar, f"training steps, {implementation}")
    return results


def _advance(bar, what: str) -> None:
    if bar is not None:
        bar.set_postfix_str(what, refresh=False)
        bar.update(1)


@dataclass(frozen=True)
class BenchSizes:
    """How much the benchmark measures: candidates per timed screening run (and its batch), training steps."""

    candidates: int = 2_000_000
    batch_size: int = 65536
    train_steps: int = 30
    train_warmup: int = 5
    rounds: int = 3
    agreement_candidates: int = 8192


QUICK_SIZES = BenchSizes(candidates=8192, batch_size=4096, train_steps=10, train_warmup=3, agreement_candidates=2048)


def run_benchmark(model: CompositionTransformer, data: CompositionSet, space: CandidateSpace, *, sizes: BenchSizes,
                  train_batch_size: int, mc_samples: int, dtype: torch.dtype, out_dir: Path,
                  commit: str | None = None, progress: bool = True) -> tuple[Path, str]:
    """Agreement, training steps and screening throughput of both builds of the transformer (its tree members, the
    same work in either build, left out), and the whole model's screening throughput with the library build;
    writes ``supercon-<gpu>-<date>-<commit>`` .json and .md into ``out_dir``; returns the JSON's path and the
    markdown table."""
    device = space.device
    whole = model.to(device).eval()
    model = copy.deepcopy(whole).attach_members({}, torch.ones(1))
    parts = 1 + len(IMPLEMENTATIONS) * (1 + sizes.rounds) + sizes.rounds * bool(len(whole.members))
    with progress_bar(parts, "supercon bench", unit="part", enabled=progress) as bar:
        agreement = output_agreement(model, space, min(sizes.agreement_candidates, sizes.candidates), dtype,
                                     mc_samples)
        _advance(bar, "agreement")
        steps = training_step_ms(model, data, train_batch_size, device, sizes.train_steps, sizes.train_warmup, bar)
        throughput = screening_throughput(model.cast_parameters(dtype), space, sizes.candidates, sizes.batch_size,
                                          mc_samples, sizes.rounds, bar)
        members = {}
        if len(whole.members):
            members = {"members": list(whole.members), **screening_throughput(
                whole.cast_parameters(dtype), space, sizes.candidates, sizes.batch_size, mc_samples, sizes.rounds,
                bar, implementations=("fused",))["fused"]}
    record = {
        **environment_metadata(resolve_commit(commit)),
        "benchmark": "supercon",
        "screening": {"dtype": str(dtype).removeprefix("torch."), "batch_size": sizes.batch_size,
                      "mc_samples": mc_samples, "space_size": len(space), **throughput,
                      "speedup": throughput["fused"]["candidates_per_s"] / throughput["plain"]["candidates_per_s"],
                      "whole_model": members},
        "training_step": {"batch_size": train_batch_size, "precision": "bf16 autocast" if device.type == "cuda"
                          else "float32", **steps,
                          "speedup": steps["plain"]["median_ms"] / steps["fused"]["median_ms"]},
        "agreement": agreement,
        "model_config": model.config.to_dict(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = unused_result_path(out_dir, "supercon-" + result_stem(record["gpu"], record["date"], record["commit"]))
    path.write_text(json.dumps(record, indent=1) + "\n")
    table = markdown_table(record)
    if device.type != "cuda":
        table += ("\n\nOn a CPU the library build runs its PyTorch reference path: this checks the pipeline and the "
                  "agreement, it is no measure of the kernels.")
    path.with_suffix(".md").write_text(table + "\n")
    return path, table


def markdown_table(record: dict) -> str:
    s, t, a = record["screening"], record["training_step"], record["agreement"]["vs_float64"]
    return "\n".join([
        f"SuperCon composition transformer on {record['gpu']} ({record['date']}, commit {record['commit']}): "
        f"library build (packed varlen attention + fused_moe) vs plain PyTorch (padding + SDPA + per-expert loop), "
        f"same weights.",
        "",
        "| what | library | plain PyTorch | speedup |",
        "|---|---|---|---|",
        f"| screening, candidates/s ({s['dtype']}, batch {s['batch_size']}, {s['mc_samples']} MC samples) | "
        f"{s['fused']['candidates_per_s']:,.0f} | {s['plain']['candidates_per_s']:,.0f} | {s['speedup']:.2f}x |",
        *([f"| screening, whole model (library build + {' + '.join(s['whole_model']['members'])}), candidates/s | "
           f"{s['whole_model']['candidates_per_s']:,.0f} | | |"] if s.get("whole_model") else []),
        f"| training step, ms (batch {t['batch_size']}, {t['precision']}) | {t['fused']['median_ms']:.2f} | "
        f"{t['plain']['median_ms']:.2f} | {t['speedup']:.2f}x |",
        f"| max abs error vs float64, K ({record['agreement']['dtype']}, {record['agreement']['candidates']} "
        f"candidates) | {a['fused']['max_abs_K']:.3f} | {a['plain']['max_abs_K']:.3f} | |",
    ])
