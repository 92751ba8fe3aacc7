"""Training the composition transformer on SuperCon: seeded splits, AdamW with warmup and cosine decay, MSE on the
standardised Tc (a two-stage head adds a cross-entropy on Tc > 0), an exponential average of the weights, the
averaged weights of the best validation epoch, test metrics, a parity plot and a loss curve."""

from __future__ import annotations

import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flashmoe_science.errors import CommandError
from flashmoe_science.science.checkpoint import CHECKPOINT_INTERVAL_S, Checkpoint, Interrupted, deferred_interrupt
from flashmoe_science.science.progress import progress_bar
from flashmoe_science.science.supercon_data import SPLIT_FRACTIONS, CompositionSet, iterate_batches, split_indices
from flashmoe_science.science.supercon_model import (
    CompositionTransformer,
    ModelConfig,
    composition_features,
    default_implementation,
    make_batch,
)
from flashmoe_science.science.supercon_trees import MEMBERS, TreeEnsemble, blend_weights, fit_member

PREDICT_BATCH = 4096
MIN_SPLIT_ROWS = 10  # per part (train, validation, test): R2 of fewer rows says little (and is nan on one)
MIN_ROWS = math.ceil(MIN_SPLIT_ROWS / min(SPLIT_FRACTIONS))
CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FORMAT = "flashmoe-science supercon model 2"
CHECKPOINT_FORMAT = "flashmoe-science supercon training checkpoint 2"
LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "huber": F.smooth_l1_loss}


@dataclass
class TrainConfig:
    epochs: int = 60
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.05
    loss: str = "mse"  # on the standardised Tc: "mse" (what R² measures), "l1" or "huber"
    ema_decay: float = 0.995  # validation, the best epoch and the saved model use this average of the weights (0: off)
    seed: int = 0
    split: str = "random"
    implementation: str | None = None  # None: default_implementation(device)
    model: ModelConfig = field(default_factory=ModelConfig)
    # tree members blended with the transformer (supercon_trees.MEMBERS; empty: the transformer alone) and the
    # extra-trees member's tree count
    members: tuple[str, ...] = MEMBERS
    forest_trees: int = 100


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
            batch = make_batch(data.batch(chunk).to(device), implementation)
            mean, std = model.predict_samples(batch, mc_samples)
        means.append(mean.float().cpu())
        stds.append(std.float().cpu())
    model.train(was_training)
    return torch.cat(means), torch.cat(stds)


def _autocast(device: torch.device):
    """bf16 autocast on a GPU (the attention and MoE kernels' dtype); float32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class WeightAverage:
    """An exponential moving average of a model's parameters, ``decay`` per step (ramped up from 0.1 over the first
    steps, so the average does not remember the initial weights). The averaged weights of a noisy small-batch
    optimisation generalise better than the last step's: validation and the saved model use them."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay, self.steps = decay, 0
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.steps += 1
        weight = 1 - min(self.decay, (1 + self.steps) / (10 + self.steps))
        for average, parameter in zip(self.shadow, model.parameters()):
            average.lerp_(parameter.detach(), weight)

    def state(self) -> dict:
        return {"steps": self.steps, "shadow": self.shadow}

    def load(self, state: dict) -> None:
        self.steps = state["steps"]
        for average, saved in zip(self.shadow, state["shadow"]):
            average.copy_(saved)

    @contextmanager
    def applied(self, model: torch.nn.Module):
        """Inside: the model holds the averaged weights (its own ones restored after; a no-op with decay 0)."""
        if self.decay == 0:
            yield
            return
        own = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for parameter, average in zip(model.parameters(), self.shadow):
                parameter.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, saved in zip(model.parameters(), own):
                    parameter.copy_(saved)


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress))


def data_digest(data: CompositionSet) -> str:
    """A short hash of the compositions and targets: a saved run belongs to the data it was trained on."""
    text = repr((data.formulas, data.targets.tolist()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_settings(config: TrainConfig, implementation: str, data: CompositionSet) -> dict:
    """What a run's numbers depend on (plain values): a checkpoint or finished run resumes only under the same."""
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in config.__dict__.items() if k != "model"},
            "implementation": implementation,
            "model": config.model.to_dict(), "data": data_digest(data), "rows": len(data)}


def _check_settings(saved: dict, wanted: dict, where: Path) -> None:
    if saved != wanted:
        changed = ", ".join(f"{key} {saved.get(key)!r} -> {wanted.get(key)!r}"
                            for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key))
        raise CommandError(f"{where} holds a run with other settings ({changed}): add --restart to start over, or "
                           "choose another --out")


def _check_sizes(parts: dict[str, torch.Tensor], split: str, n: int) -> None:
    small = {part: int(index.numel()) for part, index in parts.items() if index.numel() < MIN_SPLIT_ROWS}
    if small:
        sizes = ", ".join(f"{part} {count}" for part, count in small.items())
        raise CommandError(f"the {split} split of {n} compositions leaves too few rows ({sizes}; R2 and the best "
                           f"epoch need at least {MIN_SPLIT_ROWS} each): use at least {MIN_ROWS} rows (a larger "
                           "--rows, or leave it out)" + (", or --splits random" if split == "family" else ""))


def finished_run(out_dir: Path, settings: dict) -> dict | None:
    """The metrics of a run finished in ``out_dir`` under ``settings`` (None if there is none, or only a checkpoint);
    CommandError if a finished run there had other settings."""
    metrics_path = out_dir / "metrics.json"
    if (out_dir / CHECKPOINT_FILE).is_file() or not metrics_path.is_file():
        return None
    metrics = json.loads(metrics_path.read_text())
    _check_settings(metrics.get("settings"), settings, out_dir)
    return metrics


def train(data: CompositionSet, config: TrainConfig, device: torch.device, out_dir: Path | None = None,
          progress: bool = True, restart: bool = False,
          checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S) -> tuple[CompositionTransformer, dict]:
    """Trains on ``config.split`` (seeded); returns the model (best validation epoch) and its metrics. With
    ``out_dir``: the state goes to ``checkpoint.pt`` there every ``checkpoint_interval_s`` seconds and on Ctrl-C
    (raising :class:`Interrupted`), a later call with the same settings resumes from it (``restart``: starts
    over), and the finished run writes ``model.pt``, ``metrics.json``, ``parity.png`` and ``loss.png``."""
    if config.epochs < 1 or config.batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {config.epochs} and {config.batch_size}")
    unknown = [name for name in config.members if name not in MEMBERS]
    if unknown or len(set(config.members)) != len(config.members) or config.forest_trees < 1:
        raise ValueError(f"members must be distinct names from {MEMBERS} and forest_trees >= 1, got "
                         f"{config.members} and {config.forest_trees}")
    implementation = config.implementation or default_implementation(device)
    try:
        parts = split_indices(data, config.split, config.seed)
    except ValueError as error:
        raise CommandError(f"{error}; or use more rows") from None
    _check_sizes(parts, config.split, len(data))
    settings = run_settings(config, implementation, data)
    checkpoint_path = None if out_dir is None else out_dir / CHECKPOINT_FILE
    saved = None
    if checkpoint_path is not None:
        if restart:
            checkpoint_path.unlink(missing_ok=True)
        elif checkpoint_path.is_file():
            saved = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
            _check_settings(saved["settings"], settings, out_dir)

    torch.manual_seed(config.seed)
    model = CompositionTransformer(config.model)
    train_targets = data.targets[parts["train"]]
    # a two-stage head's value is Tc given Tc > 0: scaled by the superconductors' statistics
    scaled = train_targets[train_targets > 0] if config.model.two_stage else train_targets
    model.target_mean.fill_(float(scaled.mean()))
    model.target_std.fill_(float(scaled.std()))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(parts["train"].numel() / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, total_steps, max(1, round(config.warmup_fraction * total_steps))))
    average = WeightAverage(model, config.ema_decay)
    shuffle = torch.Generator().manual_seed(config.seed)
    # where the run stands: (epoch, batches done in it), the shuffle generator at the epoch's start, the epoch's
    # running loss, the history of finished epochs and the best of them so far
    position = {"epoch": 0, "batch": 0, "shuffle": shuffle.get_state(), "loss_sum": 0.0, "count": 0,
                "seconds": 0.0}
    history = {"epoch": [], "train_loss": [], "val_loss": [], "val_mae_K": [], "val_r2": []}
    best = {"val_loss": math.inf, "state_dict": None}
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        position, history, best = saved["position"], saved["history"], saved["best"]
        average.load(saved["average"])
        torch.set_rng_state(saved["rng"])

    def state() -> dict:
        return {"format": CHECKPOINT_FORMAT, "settings": settings, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "rng": torch.get_rng_state(),
                "position": {**position, "loss_sum": float(loss_sum),
                             "seconds": position["seconds"] + time.perf_counter() - started},
                "history": history, "best": best, "average": average.state()}

    started = time.perf_counter()
    done = position["epoch"] * steps_per_epoch + position["batch"]
    bar = progress_bar(total_steps, f"train {config.split}", unit="step", enabled=progress, initial=done)
    with deferred_interrupt() as interrupt:
        checkpoint = None if checkpoint_path is None else Checkpoint(checkpoint_path, checkpoint_interval_s)

        def save_or_stop() -> None:
            """After a whole step or epoch: the checkpoint when due, and on Ctrl-C, then stop."""
            if checkpoint is not None and (checkpoint.due() or interrupt.requested):
                checkpoint.save(state())
            if interrupt.requested:
                bar.close()
                raise Interrupted(checkpoint_path) if checkpoint is not None else KeyboardInterrupt

        while position["epoch"] < config.epochs:
            model.train()
            shuffle.set_state(position["shuffle"])
            batches = list(iterate_batches(parts["train"], config.batch_size, shuffle))
            loss_sum = torch.tensor(position["loss_sum"], device=device)  # on the device: no sync per step
            for chunk in batches[position["batch"]:]:
                batch = make_batch(data.batch(chunk).to(device), implementation)
                measured = data.targets[chunk].to(device)
                target = (measured - model.target_mean) / model.target_std
                with _autocast(device):
                    predicted, logit = model.head_outputs(batch.pooled(model))
                loss = LOSSES[config.loss]((predicted - model.target_mean) / model.target_std, target)
                if logit is not None:
                    loss = loss + F.binary_cross_entropy_with_logits(logit, (measured > 0).to(logit.dtype))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                average.update(model)
                loss_sum += loss.detach() * chunk.numel()
                position["count"] += chunk.numel()
                position["batch"] += 1
                bar.update(1)
                save_or_stop()
            position["loss_sum"] = float(loss_sum)
            with average.applied(model):
                _finish_epoch(model, data, parts, implementation, device, config, position, history, best, bar)
            position.update(epoch=position["epoch"] + 1, batch=0, shuffle=shuffle.get_state(), loss_sum=0.0,
                            count=0)
            loss_sum = torch.zeros((), device=device)
            save_or_stop()
    bar.close()
    train_seconds = position["seconds"] + time.perf_counter() - started
    model.load_state_dict(best["state_dict"])
    measured = data.targets[parts["test"]]
    members = fit_members(model, data, parts, implementation, device, config, progress) if config.members else {}
    test_pred, test_std = predict(model, data, parts["test"], implementation, device, mc_samples=16)
    metrics = {
        "split": config.split,
        "seed": config.seed,
        "implementation": implementation,
        "device": str(device),
        "sizes": {part: int(index.numel()) for part, index in parts.items()},
        "test": regression_metrics(test_pred, measured),
        "members": members,
        "best_val_loss": best["val_loss"],
        "uncertainty_error_spearman": _spearman(test_std, (test_pred - measured).abs()),
        "train_seconds": train_seconds,
        "history": history,
        "settings": settings,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_model(model, out_dir / "model.pt")
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        plot_parity(test_pred, measured, out_dir / "parity.png", metrics)
        plot_loss(history, out_dir / "loss.png", config.split, config.loss)
        checkpoint_path.unlink(missing_ok=True)  # the run is finished: a rerun finds metrics.json
    return model, metrics


def fit_members(model: CompositionTransformer, data: CompositionSet, parts: dict[str, torch.Tensor],
                implementation: str, device: torch.device, config: TrainConfig, progress: bool = True) -> dict:
    """Fits ``config.members`` (tree models on the composition features of the training rows), the blend's convex
    weights on the validation rows (the trained transformer's predictions and the members'), and attaches them to
    ``model``. Returns each part's test metrics and weight: ``{"transformer": {...}, name: {...}}``."""
    features = composition_features(data.elements, data.fractions, data.offsets)
    x = {part: features[index].numpy() for part, index in parts.items()}
    y = {part: data.targets[index].numpy() for part, index in parts.items()}
    predictions = {"transformer": {part: predict(model, data, parts[part], implementation, device)[0]
                                   for part in ("val", "test")}}
    members = {}
    bar = progress_bar(len(config.members), "tree members", unit="fit", enabled=progress)
    for name in config.members:
        fitted = fit_member(name, x, y, config.seed, config.forest_trees, torch.get_num_threads())
        members[name] = (TreeEnsemble.from_sklearn(fitted) if name == "extra_trees"
                         else TreeEnsemble.from_lightgbm(fitted.booster_))
        predictions[name] = {part: members[name].predict(features[parts[part]])[0] for part in ("val", "test")}
        bar.update(1)
    bar.close()
    weights = blend_weights(torch.stack([p["val"] for p in predictions.values()]), data.targets[parts["val"]])
    model.attach_members({name: member.to(device) for name, member in members.items()}, weights)
    measured = data.targets[parts["test"]]
    return {name: {"weight": float(weight), "test": regression_metrics(p["test"], measured)}
            for (name, p), weight in zip(predictions.items(), weights)}


def _finish_epoch(model, data, parts, implementation, device, config, position, history, best, bar) -> None:
    """Validation after an epoch: the history row, the best state so far, the bar's postfix."""
    val_pred, _ = predict(model, data, parts["val"], implementation, device)
    val_targets = data.targets[parts["val"]]
    val = regression_metrics(val_pred, val_targets)
    std, mean = float(model.target_std), float(model.target_mean)
    history["epoch"].append(position["epoch"] + 1)
    history["train_loss"].append(position["loss_sum"] / position["count"])
    history["val_loss"].append(float(LOSSES[config.loss]((val_pred - mean) / std, (val_targets - mean) / std)))
    history["val_mae_K"].append(val["mae_K"])
    history["val_r2"].append(val["r2"])
    bar.set_postfix(train_loss=f"{history['train_loss'][-1]:.4f}", val_mae=f"{val['mae_K']:.2f}K",
                    val_r2=f"{val['r2']:.3f}", refresh=False)
    if history["val_loss"][-1] < best["val_loss"]:
        best.update(val_loss=history["val_loss"][-1],
                    state_dict={k: v.detach().clone() for k, v in model.state_dict().items()})


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation (does a larger predicted std go with a larger error?)."""
    if a.numel() < 2 or float(a.std()) == 0:
        return math.nan
    ranks = [torch.empty(x.numel()).index_put_((x.argsort(),), torch.arange(x.numel(), dtype=torch.float32))
             for x in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def save_model(model: CompositionTransformer, path: Path) -> None:
    """The model as plain data (its config as a dict, its state dict): ``torch.load(..., weights_only=True)`` reads
    it, so loading never runs code from the file."""
    torch.save({"format": MODEL_FORMAT, "model_config": model.config.to_dict(), "state_dict": model.state_dict()},
               path)


def load_model(path: str | Path, device: torch.device | str = "cpu") -> CompositionTransformer:
    """A model written by :func:`save_model`, read with ``weights_only=True``; anything else is a CommandError
    saying what the file is and how to get a model."""
    path = Path(path)
    get_one = "train one with `flashmoe-science supercon train --quick --out runs/supercon`"
    if not path.is_file():
        raise CommandError(f"no such model file: {path}; {get_one}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (pickle, zip and weights-only errors alike: the file is not ours)
        raise CommandError(f"{path} is not a model file (torch cannot read it as tensors and plain data); pass the "
                           f"model.pt that `supercon train` writes, or {get_one}") from None
    kind = checkpoint.get("format") if isinstance(checkpoint, dict) else None
    if kind == CHECKPOINT_FORMAT:
        raise CommandError(f"{path} is the checkpoint of an unfinished training run, not a model: run the same "
                           "`supercon train` command again to finish it, then pass its model.pt")
    if kind != MODEL_FORMAT:
        raise CommandError(f"{path} is a torch file but not a supercon model (no format {MODEL_FORMAT!r}); pass the "
                           f"model.pt that `supercon train` writes, or {get_one}")
    try:
        model = CompositionTransformer(ModelConfig(**checkpoint["model_config"]))
        state = checkpoint["state_dict"]
        model.attach_members({name: TreeEnsemble.empty_like(state, f"members.{name}.") for name in MEMBERS
                              if f"members.{name}.feature" in state}, state["blend"])
        model.load_state_dict(state)
    except (KeyError, TypeError, RuntimeError) as error:
        raise CommandError(f"{path} is a damaged supercon model ({type(error).__name__}: "
                           f"{str(error).splitlines()[0][:120]}); {get_one}") from None
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
