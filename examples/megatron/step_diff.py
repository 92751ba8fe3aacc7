"""Where our kernels and Megatron-core's local spec part: one training step of the example's model, layer by layer.

    PYTHONPATH=src python examples/megatron/step_diff.py --out DIR                        # 1 GPU, the 0.55B model
    PYTHONPATH=src python examples/megatron/step_diff.py --size tiny --out DIR            # CPU (gloo)

Three models from the same weights: the local spec in ``--ref-dtype`` (float64 by default: the reference), the local
spec and ours as ``train_gpt_moe.py`` trains them (``--dtype``, bf16 on a GPU, under Megatron's ``Float16Module``,
DDP and optimizer). All three take the example's first batch. Reported against the reference, per tensor, as the
max abs error and the relative error ||x - ref|| / ||ref|| (ours and the local spec side by side: the local spec's
error is what the dtype alone gives):

- forward, per layer: the core attention's output, the attention block's (after ``linear_proj``), the router's
  choice (the fraction of tokens whose top-k set differs from the reference's), the MoE layer's output, the layer's
  output; then the logits and the loss;
- gradients after one backward: every parameter's ``main_grad`` (what the optimizer reads), the local spec's
  experts stacked as ours (``weight1`` = every expert's ``linear_fc1``, ``weight2`` its ``linear_fc2``), and the
  run-to-run difference of a second backward on the same batch (the kernels' non-determinism);
- the update of one optimizer step at the schedule's peak learning rate, the optimizer as the example configures it
  (Megatron's Adam with float32 main weights, weight decay by its parameter groups, gradient clipping; bf16 has no
  loss scaling). The reference update is Adam's first step written out from the reference gradients:
  ``-lr·wd·w - lr·c·g / (c·|g| + eps)``, c = min(1, clip / (||g|| + 1e-6)), read against ``lr`` (a first Adam step
  moves each weight by about ``lr``: ``flipped`` counts the weights whose update differs from the reference's by more
  than ``lr/2``, small gradients whose sign the dtype turned);
- the settings behind the usual suspects, per model: softmax scale, mask type, attention dropout, positions
  (RoPE), router (top-k, score function, load balancing and its coefficient, z-loss, capacity, expert bias, dtype),
  dispatcher, experts, deterministic mode, DDP's gradient scaling, each parameter's learning rate, weight decay and
  optimizer (dense or expert); and the initial weights: ours as the example builds it (copied from the local model)
  and as its own spec draws them from the same seed, against the local model's.

Writes ``megatron-step-diff.json`` under ``--out`` and prints a summary. One rank (the diagnostic compares whole
tensors); the training options (``--size``, ``--seed``, ``--lr``, ``--steps``, ``--zipf``, ...) are
``train_gpt_moe.py``'s and mean the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt_moe  # noqa: E402
import train_gpt_moe as train  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<expert>\d+)\.linear_fc(?P<fc>[12])\.weight$")
NOTE = ("examples/megatron/step_diff.py: one training step of the example's model (its first batch, the "
        "optimizer at the schedule's peak lr), ours (get_gpt_layer_flash_spec) and the local spec as the example "
        "trains them against the local spec in ref_dtype from the same weights; *_max_rel: the largest "
        "||x - ref|| / ||ref|| over the layers' outputs, the parameters' gradients and their updates")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--ref-dtype", choices=("float64", "float32"), default="float64")
    own, rest = parser.parse_known_args(argv)
    args = train.parse_args(rest)
    args.ref_dtype = getattr(torch, own.ref_dtype)
    return args


# --------------------------------------------------------------------------------------------------- tensors
def unwrap(model):
    """The ``GPTModel`` inside DDP / ``Float16Module``."""
    while hasattr(model, "module"):
        model = model.module
    return model


def canonical(gpt, value) -> dict[str, torch.Tensor]:
    """``value(param)`` for every parameter under our naming: the local spec's per-expert linears stacked into
    ``<...>.mlp.experts.weight1`` / ``weight2`` as ``FlashExperts`` stores them."""
    out, experts = {}, {}
    for name, param in gpt.named_parameters():
        match = EXPERT.match(name)
        if match is None:
            out[name] = value(param)
        else:
            key = f"{match['prefix']}.weight{match['fc']}"
            experts.setdefault(key, {})[int(match["expert"])] = value(param)
    for key, per_expert in experts.items():
        values = [per_expert[e] for e in sorted(per_expert)]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        elif any(v != values[0] for v in values):
            raise ValueError(f"the experts of {key} differ: {values}")
        else:
            out[key] = values[0]
    return out


def error(value: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = value.double() - reference.double()
    norm = reference.double().norm().item()
    return {"max_abs": diff.abs().max().item(), "rel": diff.norm().item() / norm if norm else diff.norm().item()}


def first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class Recorder:
    """Forward hooks on every decoder layer (core attention, attention block, router, MoE layer, layer) and the
    output layer; keeps each output (detached) while ``on``."""

    def __init__(self, gpt):
        self.outputs, self.on, self.handles = {}, True, []
        for index, layer in enumerate(gpt.decoder.layers):
            attention = layer.self_attention
            for point, module in (("core_attention", attention.core_attention), ("attention", attention),
                                  ("router", layer.mlp.router), ("mlp", layer.mlp), ("layer", layer)):
                self._hook(module, (index, point))
        self._hook(gpt.output_layer, "logits")

    def _hook(self, module, key):
        def keep(_module, _inputs, output):
            if self.on:
                # the router returns (probs, routing_map): its choice is the map
                self.outputs[key] = (output[1] if key[1:] == ("router",) else first(output)).detach().clone()
        self.handles.append(module.register_forward_hook(keep))

    def remove(self):
        for handle in self.handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------------- models
def reference_model(local, size, args, device, config):
    """The local spec in ``args.ref_dtype`` with ``local``'s weights (bf16 values widened exactly); its SwiGLU
    unfused (the same arithmetic, without a torch.compile of its own)."""
    ref_config = dataclasses.replace(config, bf16=False, params_dtype=args.ref_dtype, bias_activation_fusion=False)
    ref = gpt_moe.draw_model("local", ref_config, size, args.seed).to(device=device, dtype=args.ref_dtype)
    ref.load_state_dict(unwrap(local).state_dict())
    return ref


def main_params(optimizer) -> dict[int, torch.Tensor]:
    """id(model parameter) -> the tensor the optimizer updates (Megatron's float32 main copy under bf16)."""
    found = {}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(part, "float16_groups"):
            for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups):
                found.update({id(p): m for p, m in zip(model_group, main_group)})
            for group in getattr(part, "fp32_from_fp32_groups", []):
                found.update({id(p): p for p in group})
        else:
            for group in getattr(part, "optimizer", part).param_groups:
                found.update({id(p): p for p in group["params"]})
    return found


def param_settings(optimizer) -> dict[int, dict]:
    """id(main parameter) -> its group's lr, weight decay, eps and which optimizer holds it."""
    found = {}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(part, "optimizer", part).param_groups:
            settings = {"lr": group["lr"], "weight_decay": group["weight_decay"], "eps": group.get("eps", 1e-8),
                        "optimizer": "expert" if group.get("is_expert_parallel", False) else "dense"}
            found.update({id(p): settings for p in group["params"]})
    return found


def clip_of(optimizer) -> float:
    config = getattr(optimizer, "config", None)
    return float(getattr(config, "clip_grad", 0.0) or 0.0)


def reference_update(weights, grads, settings, clip: float) -> dict[str, torch.Tensor]:
    """Adam's (AdamW's) first step from the reference gradients, clipped by their global norm as Megatron
    clips: ``-lr·wd·w - lr·c·g / (c·|g| + eps)``."""
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    coeff = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    out = {}
    for name, g in grads.items():
        s = settings[name]
        g = coeff * g.double()
        out[name] = -s["lr"] * s["weight_decay"] * weights[name].double() - s["lr"] * g / (g.abs() + s["eps"])
    return out


# ------------------------------------------------------------------------------------------------ the runs
def run_reference(local, size, args, device, config, batch, mask):
    ref = reference_model(local, size, args, device, config)
    recorder = Recorder(ref)
    loss = ref(*batch[:2], mask, labels=batch[2]).double().mean()
    loss.backward()
    recorder.remove()
    found = {"loss": loss.item(), "outputs": recorder.outputs,
             "grads": canonical(ref, lambda p: p.grad.detach().clone()),
             "weights": canonical(ref, lambda p: p.detach().clone())}
    del ref
    return found


def settings_of(gpt, config, ddp) -> dict:
    """The settings behind the usual suspects, as this model's modules hold them."""
    layer = gpt.decoder.layers[0]
    core, mlp = layer.self_attention.core_attention, layer.mlp
    dropout = getattr(core, "attention_dropout", None)
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return {
        "core_attention": type(core).__name__, "softmax_scale": float(core.softmax_scale),
        "attn_mask_type": str(getattr(core, "attn_mask_type", None)),
        "attention_dropout": dropout.p if isinstance(dropout, torch.nn.Dropout) else config.attention_dropout,
        "attention_softmax_in_fp32": config.attention_softmax_in_fp32,
        "position_embedding_type": gpt.position_embedding_type, "rotary_base": getattr(gpt, "rotary_base", None),
        "rotary_percent": getattr(gpt, "rotary_percent", None),
        "rotary_interleaved": config.rotary_interleaved, "apply_rope_fusion": config.apply_rope_fusion,
        "router": type(mlp.router).__name__, "topk": mlp.router.topk,
        "score_function": config.moe_router_score_function,
        "load_balancing": config.moe_router_load_balancing_type, "aux_loss_coeff": config.moe_aux_loss_coeff,
        "z_loss_coeff": config.moe_z_loss_coeff, "capacity_factor": config.moe_expert_capacity_factor,
        "expert_bias": config.moe_router_enable_expert_bias, "router_dtype": config.moe_router_dtype,
        "dispatcher": type(mlp.token_dispatcher).__name__, "experts": type(mlp.experts).__name__,
        "bias_activation_fusion": config.bias_activation_fusion, "deterministic_mode": config.deterministic_mode,
        "ddp_gradient_scaling": sorted({float(getattr(b, "gradient_scaling_factor", 1.0)) for b in buffers}),
    }


def run_kernels(kernels, model, config, size, args, reference, batch, mask) -> dict:
    """One model as the example trains it: forward/backward twice, one optimizer step; errors against
    ``reference``."""
    ddp, optimizer, scheduler = train.make_trainer(model, config, args)
    scheduler.step(increment=scheduler.lr_warmup_steps)  # the schedule's peak learning rate
    gpt = unwrap(model)
    recorder = Recorder(gpt)
    loss = train.forward_backward(ddp, optimizer, *batch, mask).item()
    recorder.on = False
    first_grads = canonical(gpt, lambda p: p.main_grad.detach().clone())
    train.forward_backward(ddp, optimizer, *batch, mask)  # the same batch again: run-to-run differences
    grads = canonical(gpt, lambda p: p.main_grad.detach().clone())
    mains = main_params(optimizer)
    by_main = param_settings(optimizer)
    settings = canonical(gpt, lambda p: by_main[id(mains[id(p)])])
    before = canonical(gpt, lambda p: mains[id(p)].detach().double().clone())
    optimizer.step()
    after = canonical(gpt, lambda p: mains[id(p)].detach().double())
    recorder.remove()
    expected = reference_update(reference["weights"], reference["grads"], settings, clip_of(optimizer))
    result = {"loss": loss, "settings": settings_of(gpt, config, ddp),
              "grad_norm": torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item(),
              "activations": compare_outputs(recorder.outputs, reference["outputs"]),
              "grads": {name: {**error(g, reference["grads"][name]),
                               "repeat_max_abs": (g - first_grads[name]).abs().max().item()}
                        for name, g in first_grads.items()},
              "updates": {name: update_error(after[name] - before[name], expected[name], settings[name])
                          for name in expected},
              "param_settings": {name: {k: s[k] for k in ("lr", "weight_decay", "optimizer")}
                                 for name, s in settings.items()}}
    del ddp, optimizer, scheduler
    return result


def update_error(update, expected, settings) -> dict:
    lr = settings["lr"]
    diff = (update - expected).abs()
    return {**error(update, expected), "max_abs_over_lr": diff.max().item() / lr if lr else None,
            "flipped": (diff > lr / 2).double().mean().item() if lr else None}


def compare_outputs(outputs, reference) -> dict:
    found = {}
    for key, ref in reference.items():
        value = outputs[key]
        name = key if isinstance(key, str) else f"layer{key[0]}.{key[1]}"
        if isinstance(key, tuple) and key[1] == "router":
            found[name] = {"routing_differs": (value != ref).any(-1).double().mean().item()}
        else:
            found[name] = error(value, ref)
    return found


def initial_weights(local, flash, config, size, args, device) -> dict:
    """Ours as built (copied) and as drawn by its own spec from the seed, against the local model's weights:
    the largest difference over tensors, and the tensors that differ."""
    theirs = canonical(unwrap(local), lambda p: p.detach())
    drawn = gpt_moe.draw_model("flashmoe", config, size, args.seed)
    if config.bf16:  # as the example casts its models (Float16Module): every weight in bf16
        drawn = Float16Module(config, drawn)
    drawn = drawn.to(device)
    found = {}
    for label, model in (("copied", unwrap(flash)), ("drawn_by_own_spec", unwrap(drawn))):
        ours = canonical(model, lambda p: p.detach())
        diffs = {name: (ours[name].double() - theirs[name].double()).abs().max().item() for name in theirs}
        found[label] = {"max_abs": max(diffs.values()), "differing": sorted(n for n, d in diffs.items() if d > 0)}
    del drawn
    return found


# ---------------------------------------------------------------------------------------------------- report
def summary(report) -> dict:
    """The worst tensor of each kind by ours' error over the local spec's (both against the reference)."""
    ours, local = report["flashmoe"], report["local"]
    found = {"loss": {k: report[k]["loss"] for k in ("reference", "flashmoe", "local")},
             "grad_norm": {"reference": report["reference"]["grad_norm"], "flashmoe": ours["grad_norm"],
                           "local": local["grad_norm"]},
             "settings_differ": {k: [ours["settings"][k], local["settings"][k]] for k in ours["settings"]
                                 if ours["settings"][k] != local["settings"][k]},
             "param_settings_differ": sorted(n for n in ours["param_settings"]
                                             if ours["param_settings"][n] != local["param_settings"][n])}
    for kind, field in (("activations", "rel"), ("grads", "rel"), ("updates", "rel")):
        rows = [(name, ours[kind][name].get(field), local[kind][name].get(field)) for name in ours[kind]
                if field in ours[kind][name]]
        name, a, b = max(rows, key=lambda row: row[1] / max(row[2], 1e-12))
        found[f"{kind}_worst"] = {"tensor": name, "flashmoe_rel": a, "local_rel": b}
        found[f"{kind}_max_rel"] = {"flashmoe": max(r[1] for r in rows), "local": max(r[2] for r in rows)}
    routing = [(n, ours["activations"][n]["routing_differs"], local["activations"][n]["routing_differs"])
               for n in ours["activations"] if "routing_differs" in ours["activations"][n]]
    found["routing_differs_max"] = {"flashmoe": max(r[1] for r in routing), "local": max(r[2] for r in routing)}
    found["flipped_max"] = {k: max(v["flipped"] or 0 for v in report[k]["updates"].values())
                            for k in ("flashmoe", "local")}
    found["grad_repeat_max_abs"] = {k: max(v["repeat_max_abs"] for v in report[k]["grads"].values())
                                    for k in ("flashmoe", "local")}
    return found


def records(report, args) -> list[dict]:
    """One record per kernel set (op ``megatron-step-diff``): the summary's largest errors against the reference."""
    found, summary_ = [], report["summary"]
    for kernels in ("flashmoe", "local"):
        found.append({
            "op": "megatron-step-diff", "kernels": kernels, "gpus": 1 if torch.cuda.is_available() else 0,
            "dtype": args.dtype, "ref_dtype": report["ref_dtype"], "loss": report[kernels]["loss"],
            "loss_error": report[kernels]["loss"] - report["reference"]["loss"],
            "grad_norm": report[kernels]["grad_norm"],
            **{f"{kind}_max_rel": summary_[f"{kind}_max_rel"][kernels] for kind in ("activations", "grads", "updates")},
            "routing_differs_max": summary_["routing_differs_max"][kernels],
            "update_flipped_max": summary_["flipped_max"][kernels],
            "grad_repeat_max_abs": summary_["grad_repeat_max_abs"][kernels],
            "initial_weights_equal": (kernels == "local" or report["initial_weights"]["copied"]["max_abs"] == 0)})
    return found


def print_table(report) -> None:
    ours, local = report["flashmoe"], report["local"]
    print(f"{'tensor':58s} {'ours rel':>10s} {'local rel':>10s}")
    for kind in ("activations", "grads", "updates"):
        print(f"-- {kind}")
        for name, row in ours[kind].items():
            field = "routing_differs" if "routing_differs" in row else "rel"
            print(f"{name:58s} {row[field]:10.3e} {local[kind][name][field]:10.3e}")
    print("step-diff summary:", json.dumps(report["summary"]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = train.init_distributed(args)
    try:
        if dist.get_world_size() != 1:
            raise ValueError(f"step_diff.py runs on one rank, got a world of {dist.get_world_size()}")
        size = gpt_moe.SIZES[args.size]
        batch = train.batch(0, size, args, device)
        mask = train.causal_mask(size, device)
        began = time.perf_counter()
        local, config = train.build("local", size, args, device)
        flash, _ = train.build("flashmoe", size, args, device)
        report = {**train.envelope(args, size), "ref_dtype": str(args.ref_dtype).removeprefix("torch."),
                  "note": NOTE, "records": [],
                  "initial_weights": initial_weights(local, flash, config, size, args, device)}
        reference = run_reference(local, size, args, device, config, batch, mask)
        report["reference"] = {"loss": reference["loss"], "grad_norm": torch.sqrt(
            sum(g.pow(2).sum() for g in reference["grads"].values())).item()}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for kernels, model in (("local", local), ("flashmoe", flash)):
            report[kernels] = run_kernels(kernels, model, config, size, args, reference, batch, mask)
            report["seconds"] = time.perf_counter() - began
            # after each kernel set: a run stopped by a time limit leaves what it measured
            (out / "megatron-step-diff.json").write_text(json.dumps(report, indent=1) + "\n")
        report["summary"] = summary(report)
        report["records"] = records(report, args)
        (out / "megatron-step-diff.json").write_text(json.dumps(report, indent=1) + "\n")
        print_table(report)
        return report
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
