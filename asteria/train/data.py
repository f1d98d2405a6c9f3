"""Training data for `asteria.train`: a byte-level corpus that works offline everywhere.

Owns: reading the corpus (by default the Python standard library's own ``.py`` sources, which
every Python installation ships), byte-level tokenization, the fixed train/validation split, and
deterministic batches. Must not: download anything, depend on the model or the optimizer, or hold
global random state (every batch stream has its own seeded ``torch.Generator``).

Tokenization: token ids 0-255 are the bytes themselves and id 256 (``EOD``) separates documents
(files), so ``VOCAB_SIZE == 257``. There is no BOS and no padding token: every window is full.

Split: the corpus is one token stream cut into ``SLICES`` (100) equal slices; every
``VAL_EVERY``-th slice (the 20th, 40th, ..., 100th: 5 % of the tokens, spread over the whole corpus
so that validation looks like training) is validation, the rest is training, each concatenated in
order. Training windows are drawn only from the training part and validation windows only from
the validation part, so they never share a token. (A single 5 % tail would be one region of the
corpus; for the first 4 MB of the standard library that region is the codec tables of
``encodings/``, which look nothing like the rest.)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 257
EOD = 256
STDLIB = "stdlib"
DEFAULT_MAX_BYTES = 4_000_000
SLICES = 100
VAL_EVERY = 20
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split into a training and a validation token stream (int16 tensors)."""

    name: str
    num_documents: int
    train: torch.Tensor
    val: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.train.numel() + self.val.numel()


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order of their path relative to the root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(here).relative_to(root)
        found.extend((rel / f).as_posix() for f in files if f.endswith(".py"))
    return [root / rel for rel in sorted(found)]


def _files_under(directory: Path) -> list[Path]:
    """Every regular, non-hidden file under ``directory``, in sorted relative-path order."""
    rels = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    return [directory / rel for rel in rels]


def _source_files(source: str) -> tuple[str, list[Path]]:
    if source == STDLIB:
        root = sysconfig.get_paths()["stdlib"]
        return f"stdlib:{root}", stdlib_files()
    path = Path(source)
    if path.is_file():
        return str(path), [path]
    if path.is_dir():
        return str(path), _files_under(path)
    raise ValueError(
        f"data source {source!r} is neither {STDLIB!r} nor an existing file or directory"
    )


def _tokenize(files: list[Path], max_bytes: int) -> tuple[torch.Tensor, int]:
    """Concatenate the files' bytes, each followed by EOD, stopping after ``max_bytes`` bytes."""
    chunks: list[torch.Tensor] = []
    used = 0
    documents = 0
    for path in files:
        if used >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - used]
        if not data:
            continue
        used += len(data)
        documents += 1
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        chunks.append(torch.tensor([EOD], dtype=torch.int16))
    if not chunks:
        return torch.empty(0, dtype=torch.int16), 0
    return torch.cat(chunks), documents


def is_val_slice(index: int) -> bool:
    """Whether slice ``index`` (0 .. SLICES-1) of the token stream belongs to validation."""
    return index % VAL_EVERY == VAL_EVERY - 1


def split(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): slice ``j`` spans tokens ``[j*n//SLICES, (j+1)*n//SLICES)``."""
    n = tokens.numel()
    bounds = [j * n // SLICES for j in range(SLICES + 1)]
    parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for j in range(SLICES):
        parts[is_val_slice(j)].append(tokens[bounds[j] : bounds[j + 1]])
    return torch.cat(parts[False]), torch.cat(parts[True])


def load_corpus(
    source: str = STDLIB, *, max_bytes: int = DEFAULT_MAX_BYTES, min_tokens: int = 2
) -> Corpus:
    """Read, tokenize and split ``source`` ("stdlib", a text file, or a directory of text files).

    ``min_tokens`` is the shortest training and validation stream the caller can use (for example
    one window of ``seq_len`` tokens); a smaller corpus raises ``ValueError`` saying how much
    data is needed.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    name, files = _source_files(source)
    tokens, documents = _tokenize(files, max_bytes)
    train, val = split(tokens)
    if min(train.numel(), val.numel()) < min_tokens:
        raise ValueError(
            f"data source {source!r} gave {tokens.numel()} tokens from {documents} file(s); "
            f"a {1 / VAL_EVERY:.0%} validation split with windows of {min_tokens} tokens "
            f"needs at least {VAL_EVERY * min_tokens} tokens"
        )
    return Corpus(name=name, num_documents=documents, train=train, val=val)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(seq_len)
    return tokens[starts[:, None] + offsets[None, :]].long()


def train_batches(
    corpus: Corpus, *, batch_size: int, seq_len: int, seed: int
) -> Iterator[torch.Tensor]:
    """An endless stream of ``[batch_size, seq_len]`` windows at seeded random training offsets.

    The same ``seed`` gives the same sequence of batches in every run, whatever else the process
    does with random numbers, so every optimizer sees identical data in identical order.
    """
    if seq_len > corpus.train.numel():
        raise ValueError(f"seq_len {seq_len} exceeds the {corpus.train.numel()} training tokens")
    gen = torch.Generator().manual_seed(seed)
    high = corpus.train.numel() - seq_len + 1
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=gen)
        yield _windows(corpus.train, starts, seq_len)


def val_batches(
    corpus: Corpus, *, batch_size: int, seq_len: int, max_batches: int
) -> list[torch.Tensor]:
    """Consecutive non-overlapping validation windows from the start of the validation part."""
    n_windows = min(corpus.val.numel() // seq_len, batch_size * max_batches)
    if n_windows == 0:
        raise ValueError(f"seq_len {seq_len} exceeds the {corpus.val.numel()} validation tokens")
    starts = torch.arange(n_windows) * seq_len
    windows = _windows(corpus.val, starts, seq_len)
    return list(windows.split(batch_size))
