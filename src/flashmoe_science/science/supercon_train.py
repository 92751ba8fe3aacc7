"""Training the composition transformer on SuperCon: seeded splits, AdamW with warmup and cosine decay, L1 loss on
the standardised Tc, the checkpoint of the best validation epoch, test metrics, a parity plot and a loss curve."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashmoe_science.science.supercon_data import CompositionSet, iterate_batches, split_indices
from flashmoe_science.science.supercon_model import (
    CompositionTransformer,
    ModelConfig,
    default_implementation,
    make_batch,
)

PREDICT_BATCH = 4096
LOSSES = {"mse": torch.nn.functional.mse_loss, "l1": torch.nn.functional.l1_loss,
          "huber": torch.nn.functional.smooth_l1_loss}


@dataclass
class TrainConfig:
    epochs: int = 60
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.05
    loss: str = "mse"  # on the standardised Tc: "mse" (what R² measures), "l1" or "huber"
    seed: int = 0
    split: str = "random"
    implementation: str | None = None  # None: default_implementation(device)
    model: ModelConfig = field(default_factory=ModelConfig)


def _r2(predicted: torch.Tensor, measured: torch.Tensor) -> float:
    total = (measured - measured.mean()).pow(2).sum()
    return float(1 - (predicted - measured).pow(2).sum() / total) if total > 0 else math.nan


def regression_metrics(predicted: torch.Tensor, measured: torch.Tensor) -> dict[str, float]:
    """R² and errors in kelvin; also R² of log(1 + Tc), the scale of Stanev et al.'s ln(Tc) regression."""
    predicted, measured = predicted.double(), measured.double()
    residual = predicted - measured
    return {
        "r2": _r2(predicted, measured),
        "r2_log1p": _r2(predicted.clamp_min(0).log1p(), measured.clamp_min(0).log1p()),
        "mae_K": float(residual.abs().mean()),
        "rmse_K": float(residual.pow(2).mean().sqrt()),
        "n": int(measured.numel()),
    }


@torch.no_grad()
def predict(model: CompositionTransformer, data: CompositionSet, index: torch.Tensor, implementation: str,
            device: torch.device, mc_samples: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tc of the compositions ``index`` (CPU float32); and the MC-dropout std where ``mc_samples >= 2`` (else 0)."""
    was_training = model.training
    model.eval()
    means, stds = [], []
    for chunk in iterate_batches(index, PREDICT_BATCH):
        with _autocast(device):
            pooled = make_batch(data.batch(chunk).to(device), implementation).pooled(model)
            mean, std = model.head_samples(pooled, mc_samples)
        means.append(mean.float().cpu())
        stds.append(std.float().cpu())
    model.train(was_training)
    return torch.cat(means), torch.cat(stds)


def _autocast(device: torch.device):
    """bf16 autocast on a GPU (the attention and MoE kernels' dtype); float32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress))


def train(data: CompositionSet, config: TrainConfig, device: torch.device, out_dir: Path | None = None,
          progress: bool = True) -> tuple[CompositionTransformer, dict]:
    """Trains on ``config.split`` (seeded); returns the model (best validation epoch) and its metrics. With
    ``out_dir``: writes ``model.pt``, ``metrics.json``, ``parity.png`` and ``loss.png`` there."""
    torch.manual_seed(config.seed)
    implementation = config.implementation or default_implementation(device)
    parts = split_indices(data, config.split, config.seed)
    model = CompositionTransformer(config.model)
    train_targets = data.targets[parts["train"]]
    model.target_mean.fill_(float(train_targets.mean()))
    model.target_std.fill_(float(train_targets.std()))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(parts["train"].numel() / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, total_steps, max(1, round(config.warmup_fraction * total_steps))))
    shuffle = torch.Generator().manual_seed(config.seed)
    history = {"epoch": [], "train_loss": [], "val_loss": [], "val_mae_K": [], "val_r2": []}
    best = (math.inf, None)
    started = time.perf_counter()
    bar = tqdm(total=total_steps, desc=f"train {config.split}", unit="step", disable=not progress, mininterval=1.0)
    for epoch in range(config.epochs):
        model.train()
        loss_sum, count = torch.zeros((), device=device), 0
        for chunk in iterate_batches(parts["train"], config.batch_size, shuffle):
            batch = make_batch(data.batch(chunk).to(device), implementation)
            target = (data.targets[chunk].to(device) - model.target_mean) / model.target_std
            with _autocast(device):
                predicted = model(batch)
            loss = LOSSES[config.loss]((predicted - model.target_mean) / model.target_std, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            loss_sum += loss.detach() * chunk.numel()
            count += chunk.numel()
            bar.update(1)
        val_pred, _ = predict(model, data, parts["val"], implementation, device)
        val = regression_metrics(val_pred, data.targets[parts["val"]])
        history["epoch"].append(epoch + 1)
        history["train_loss"].append(float(loss_sum) / count)
        val_targets = data.targets[parts["val"]]
        std, mean = float(model.target_std), float(model.target_mean)
        history["val_loss"].append(float(LOSSES[config.loss]((val_pred - mean) / std, (val_targets - mean) / std)))
        history["val_mae_K"].append(val["mae_K"])
        history["val_r2"].append(val["r2"])
        bar.set_postfix(train_loss=f"{history['train_loss'][-1]:.4f}", val_mae=f"{val['mae_K']:.2f}K",
                        val_r2=f"{val['r2']:.3f}")
        if history["val_loss"][-1] < best[0]:
            best = (history["val_loss"][-1], {k: v.detach().clone() for k, v in model.state_dict().items()})
    bar.close()
    train_seconds = time.perf_counter() - started
    model.load_state_dict(best[1])
    test_pred, test_std = predict(model, data, parts["test"], implementation, device, mc_samples=16)
    measured = data.targets[parts["test"]]
    metrics = {
        "split": config.split,
        "seed": config.seed,
        "implementation": implementation,
        "device": str(device),
        "sizes": {part: int(index.numel()) for part, index in parts.items()},
        "test": regression_metrics(test_pred, measured),
        "best_val_loss": best[0],
        "uncertainty_error_spearman": _spearman(test_std, (test_pred - measured).abs()),
        "train_seconds": train_seconds,
        "history": history,
        "train_config": {**{k: v for k, v in config.__dict__.items() if k != "model"}},
        "model_config": config.model.to_dict(),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model_config": config.model.to_dict(), "state_dict": model.state_dict()}, out_dir / "model.pt")
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        plot_parity(test_pred, measured, out_dir / "parity.png", metrics)
        plot_loss(history, out_dir / "loss.png", config.split, config.loss)
    return model, metrics


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation (does a larger predicted std go with a larger error?)."""
    if a.numel() < 2 or float(a.std()) == 0:
        return math.nan
    ranks = [torch.empty(x.numel()).index_put_((x.argsort(),), torch.arange(x.numel(), dtype=torch.float32))
             for x in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def load_model(path: str | Path, device: torch.device | str = "cpu") -> CompositionTransformer:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = CompositionTransformer(ModelConfig(**checkpoint["model_config"]))
    model.load_state_dict(checkpoint["state_dict"])
    return model.to(device).eval()


def plot_parity(predicted: torch.Tensor, measured: torch.Tensor, path: Path, metrics: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test = metrics["test"]
    figure, axes = plt.subplots(figsize=(5, 5))
    axes.scatter(measured.numpy(), predicted.numpy(), s=4, alpha=0.4)
    top = max(float(measured.max()), float(predicted.max())) * 1.05
    axes.plot([0, top], [0, top], color="black", linewidth=0.8)
    axes.set(xlim=(0, top), ylim=(0, top), xlabel="measured Tc (K)", ylabel="predicted Tc (K)",
             title=f"SuperCon {metrics['split']} test split (seed {metrics['seed']})\n"
                   f"R² = {test['r2']:.3f}, MAE = {test['mae_K']:.2f} K, n = {test['n']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_loss(history: dict, path: Path, split: str, loss: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(history["epoch"], history["train_loss"], label="train (dropout on)")
    axes.plot(history["epoch"], history["val_loss"], label="validation")
    axes.set(xlabel="epoch", ylabel=f"{loss} loss on standardised Tc", title=f"training, {split} split",
             yscale="log")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
