"""A byte tokenizer and a local-text data loader for TorchTitan: nothing is downloaded.

The corpus is a UTF-8 text file (``--dataloader.dataset_path``) whose documents are separated by blank lines; when
the file does not exist it is written first from the docstrings of the installed numpy and torch (the corpus of
``examples/train_gpt_moe.py``). Documents are byte-tokenised, joined with an end-of-document token and packed into
rows of ``seq_len``; ``positions`` restart at 0 at every document, which is how TorchTitan's decoders build their
per-document causal masks. Each data-parallel rank reads its own strided share of the rows, forever.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

VOCAB_SIZE = 257  # 256 bytes and the end-of-document token
EXAMPLE = Path(__file__).resolve().parents[1] / "train_gpt_moe.py"


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens 0..255, end of document 256."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.eos_id = VOCAB_SIZE - 1

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, *args, **kwargs) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return VOCAB_SIZE


def write_docstring_corpus(path: Path, max_chars: int) -> None:
    spec = importlib.util.spec_from_file_location("train_gpt_moe", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, example)  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    path.parent.mkdir(parents=True, exist_ok=True)
    # every rank of a job may write it: each writes its own file and renames it into place atomically
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(example.package_docstrings(["numpy", "torch"], max_chars, progress=False), encoding="utf-8")
    os.replace(partial, path)


class LocalTextDataLoader(BaseDataLoader):
    """Packed rows of a local text file as TorchTitan batches ``({"input", "positions"}, labels)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset_path: str | None = "results/torchtitan/corpus.txt"
        max_chars: int = 40_000_000

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, seq_len: int,
                 local_batch_size: int, **kwargs) -> None:
        path = Path(config.dataset_path)
        if not path.exists():
            write_docstring_corpus(path, config.max_chars)
        ids = []
        for doc in path.read_text(encoding="utf-8").split("\n\n"):
            if doc.strip():
                ids.extend(tokenizer.encode(doc.strip()))
                ids.append(tokenizer.eos_id)
        tokens = torch.tensor(ids, dtype=torch.int64)
        rows = (tokens.numel() - 1) // seq_len
        if rows < local_batch_size * dp_world_size:
            raise ValueError(f"dataset_path={path}: {tokens.numel()} tokens are fewer than one batch of "
                             f"{local_batch_size * dp_world_size} x {seq_len}")
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, tokenizer.eos_id
        self.rows = list(range(dp_rank, rows, dp_world_size))
        self.batch = local_batch_size
        self.cursor = 0

    def _positions(self, inputs: torch.Tensor) -> torch.Tensor:
        # a document starts at the row's start and after every end-of-document token
        starts = torch.zeros_like(inputs, dtype=torch.bool)
        starts[:, 0] = True
        starts[:, 1:] = inputs[:, :-1] == self.eos_id
        index = torch.arange(inputs.shape[1]).expand_as(inputs)
        last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        return index - last_start

    def __iter__(self):
        while True:
            picked = [self.rows[(self.cursor + i) % len(self.rows)] for i in range(self.batch)]
            self.cursor += self.batch
            chunk = torch.stack([self.tokens[r * self.seq_len: r * self.seq_len + self.seq_len + 1] for r in picked])
            inputs, labels = chunk[:, :-1], chunk[:, 1:]
            yield {"input": inputs, "positions": self._positions(inputs)}, labels

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state_dict: dict) -> None:
        self.cursor = state_dict["cursor"]
