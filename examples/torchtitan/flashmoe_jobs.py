"""TorchTitan job configs (its ``--module`` / ``--config`` registry functions): a ~90M dense Llama 3 and a
Qwen3-MoE-style model (1.0B parameters, 0.2B active: 12 layers, hidden 1536, 64 experts top-8, 4k sequences), each
with TorchTitan's default kernels (its language models' Flex attention with per-document causal masks,
``torch._grouped_mm`` experts) and with ours (``flashmoe_science.integrations.torchtitan.flash_decoder``: our
attention on per-document metadata built in one pass, and our routed experts where the model has them).
Byte-level tokens from a local text file (``local_text``).

    PYTHONPATH=src torchrun --nproc-per-node 1 examples/torchtitan/train.py \
        --module flashmoe_jobs --config qwen3_moe_flash --debug.seed 0

TorchTitan 0.3.0 reads no TOML job files: a job is a Python function returning ``Trainer.Config``, and any field
can be changed on the command line (``--training.steps 300``, ``--compile.enable``,
``--parallelism.expert_parallel_degree 4``, ``activation-checkpoint:full``, ...).
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import OverrideConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.trainer import Trainer

from local_text import VOCAB_SIZE, ByteTokenizer, LocalTextDataLoader
from titan_models import llama3_spec, qwen3_moe_spec

FLASH = ["flashmoe_science.integrations.torchtitan.flash_decoder"]


def _job(model_spec, *, lr: float, batch: int, seq_len: int, overrides: list[str]) -> Trainer.Config:
    return Trainer.Config(
        # whole logits (a byte vocabulary makes them small); TorchTitan's ChunkedLossWrapper needs torch >= 2.12
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        model_spec=model_spec,
        tokenizer=ByteTokenizer.Config(),
        dataloader=LocalTextDataLoader.Config(),
        metrics=MetricsProcessor.Config(log_freq=10),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=20, decay_ratio=0.8, decay_type="cosine",
                                                  min_lr_factor=0.1),
        # CUDA graphs off for both kernels: TorchTitan replays one captured step and refuses inputs whose shapes or
        # host values change, and per-document varlen metadata (ours) changes with every batch
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=300, disable_cuda_graphs=True),
        # DTensor on the model-parallel axes only: our kernels are opaque to spmd_types' type propagation
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        # no activation checkpointing for either kernel set: TorchTitan's per-op selective policy keeps the outputs
        # of its own attention and grouped GEMMs but would recompute ours (custom ops it does not list)
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        override=OverrideConfig(imports=list(overrides)),
        dump_folder="results/torchtitan/outputs",
    )


def _llama_100m():
    return llama3_spec(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2560, vocab_size=VOCAB_SIZE,
                       max_seq_len=4096, attn_backend="flex")


def _qwen3_moe_1b():
    return qwen3_moe_spec(dim=1536, n_layers=12, n_heads=16, n_kv_heads=4, head_dim=128, moe_hidden_dim=256,
                          num_experts=64, top_k=8, vocab_size=VOCAB_SIZE, max_seq_len=4096,
                          attn_backend="flex")


def llama_100m_titan() -> Trainer.Config:
    return _job(_llama_100m(), lr=6e-4, batch=16, seq_len=2048, overrides=[])


def llama_100m_flash() -> Trainer.Config:
    return _job(_llama_100m(), lr=6e-4, batch=16, seq_len=2048, overrides=FLASH)


def qwen3_moe_titan() -> Trainer.Config:
    return _job(_qwen3_moe_1b(), lr=4e-4, batch=4, seq_len=4096, overrides=[])


def qwen3_moe_flash() -> Trainer.Config:
    return _job(_qwen3_moe_1b(), lr=4e-4, batch=4, seq_len=4096, overrides=FLASH)


def qwen3_moe_flash_titan_dispatch() -> Trainer.Config:
    """Our kernels behind TorchTitan's token dispatcher (flash_decoder's exchange="titan") under expert parallelism."""
    return _job(_qwen3_moe_1b(), lr=4e-4, batch=4, seq_len=4096, overrides=[(FLASH[0], {"exchange": "titan"})])
