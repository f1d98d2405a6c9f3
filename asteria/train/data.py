"""Training data for `asteria.train`: a byte-level corpus that works offline everywhere.

Owns: reading the corpus (by default the embedded snapshot: corpus.py, Note [Embedded corpus]),
byte-level tokenization, the corpus checksum, the fixed train/validation split, and
deterministic batches. Must not: download anything, depend on the model or the optimizer, or hold
global random state (every batch stream has its own seeded ``torch.Generator``).

Tokens: ids 0-255 are the bytes, 256 (``EOD``) separates documents (files): ``VOCAB_SIZE ==
257``, no BOS, no padding. Sources (``--data``): ``"stdlib"``; a text file or a directory of
them (a file with NUL bytes is refused, named); or a pre-tokenized file in OLMo's numpy layout
(a headerless ``uint16``/``uint32`` array read with ``token_dtype``, or a 1-D ``.npy``), whose
vocabulary is ``vocab_size`` or its largest id + 1. Split: the stream is cut into ``SLICES``
(100) slices, every ``VAL_EVERY``-th (5 %, spread over the corpus so that validation looks like
training: a 5 % tail of the standard library would be ``encodings/``' codec tables) is
validation, the rest training, and windows never cross the two. Checksum: ``Corpus.sha256``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asteria.train import corpus as embedded

VOCAB_SIZE = 257
EOD = 256
STDLIB = "stdlib"
DEFAULT_MAX_BYTES = 4_000_000
SLICES = 100
VAL_EVERY = 20
MAX_INFERRED_VOCAB = 2**20  # a larger id without --vocab-size is a misread file
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_NPY_MAGIC = b"\x93NUMPY"
_BINARY_PROBE = 65536  # bytes of each text file checked for NUL bytes


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split into a training and a validation token stream (int16 for bytes,
    int32 for token files; ``vocab_size`` the model's, ``kind`` ``"bytes"`` or ``"tokens"``,
    ``sha256`` the stream's checksum)."""

    name: str
    num_documents: int
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = VOCAB_SIZE
    kind: str = "bytes"
    sha256: str = ""

    @property
    def num_tokens(self) -> int:
        return self.train.numel() + self.val.numel()


def token_checksum(tokens: torch.Tensor) -> str:
    """SHA-256 of ``tokens`` as little-endian uint32s (corpus.py, Note [Embedded corpus])."""
    return hashlib.sha256(tokens.numpy().astype("<u4").tobytes()).hexdigest()


def _files_under(directory: Path) -> list[Path]:
    """Every regular, non-hidden file under ``directory``, in sorted relative-path order."""
    rels = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    return [directory / rel for rel in rels]


def _source_files(source: str) -> tuple[str, list[Path]]:
    path = Path(source)
    if path.is_file():
        return str(path), [path]
    if path.is_dir():
        return str(path), _files_under(path)
    raise ValueError(
        f"data source {source!r} is neither {STDLIB!r} nor an existing file or directory"
    )


def _tokenize(
    files: Iterable[Path | bytes], max_bytes: int, check_text: bool = True
) -> tuple[torch.Tensor, int]:
    """Concatenate the files' bytes (a path, or a document's bytes), each followed by EOD, up to
    ``max_bytes``; ``check_text`` refuses a file with a NUL byte in its first 64 KiB."""
    chunks: list[torch.Tensor] = []
    used = 0
    documents = 0
    for path in files:
        if used >= max_bytes:
            break
        raw = path if isinstance(path, bytes) else path.read_bytes()
        data = raw[: max_bytes - used]
        if not data:
            continue
        if check_text and b"\0" in data[:_BINARY_PROBE]:
            hint = (
                "; a pre-tokenized file needs --token-dtype uint16|uint32 (OLMo's numpy layout)"
                " or a .npy header"
            )
            raise ValueError(f"data file {str(path)!r} is not a text file (it has NUL bytes){hint}")
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


def _read_token_file(
    path: Path, token_dtype: str | None, max_bytes: int
) -> tuple[np.ndarray, str] | None:
    """The token ids of ``path`` where it is a token file (a ``.npy``, or any file with
    ``token_dtype``), at most ``max_bytes`` of them, else None (a text file)."""
    with path.open("rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if head == _NPY_MAGIC:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ValueError(f"data file {str(path)!r}: unreadable .npy file ({err})") from None
        if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32):
            raise ValueError(
                f"data file {str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; a token file "
                "must be a flat uint16 or uint32 array"
            )
        if token_dtype is not None and arr.dtype != TOKEN_DTYPES[token_dtype]:
            raise ValueError(
                f"data file {str(path)!r} holds {arr.dtype} ids but --token-dtype is {token_dtype}"
            )
        return np.asarray(arr[: max_bytes // arr.itemsize]), f"npy {arr.dtype}"
    if token_dtype is None:
        return None
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"data file {str(path)!r} has {size} bytes, not a multiple of {dtype.itemsize}: "
            f"not a flat {token_dtype} token file"
        )
    count = min(size, max_bytes) // dtype.itemsize
    if count == 0:
        return np.empty(0, dtype=dtype), f"raw {token_dtype}"
    return np.array(np.memmap(path, mode="r", dtype=dtype, shape=(count,))), f"raw {token_dtype}"


def _token_corpus(
    path: Path, ids: np.ndarray, layout: str, vocab_size: int | None
) -> tuple[str, torch.Tensor, int]:
    top = int(ids.max()) if ids.size else -1
    if vocab_size is None:
        if top >= MAX_INFERRED_VOCAB:
            raise ValueError(
                f"data file {str(path)!r} read as {layout} has token id {top}: is --token-dtype "
                "right? (pass --vocab-size to train with a vocabulary this large)"
            )
        vocab_size = top + 1
    elif top >= vocab_size:
        raise ValueError(
            f"data file {str(path)!r} has token id {top}, outside --vocab-size {vocab_size}"
        )
    tokens = torch.from_numpy(ids.astype(np.int64)).to(torch.int32)
    return f"{path} ({layout} tokens)", tokens, max(vocab_size, 2)


def load_corpus(
    source: str = STDLIB,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_tokens: int = 2,
    token_dtype: str | None = None,
    vocab_size: int | None = None,
) -> Corpus:
    """Read, tokenize and split ``source`` ("stdlib", a text file, a directory of them, or a token
    file: the module doc). A corpus shorter than ``min_tokens`` in either stream raises
    ``ValueError`` saying how much is needed; ``max_bytes`` caps the bytes read."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"unknown token dtype {token_dtype!r}; choose from {', '.join(TOKEN_DTYPES)}"
        )
    if vocab_size is not None and vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    path = Path(source)
    token_file = None
    if source != STDLIB and path.is_file():
        token_file = _read_token_file(path, token_dtype, max_bytes)
    elif token_dtype is not None:
        raise ValueError(f"--token-dtype needs --data to be one token file, got {source!r}")
    if token_file is not None:
        name, tokens, vocab = _token_corpus(path, *token_file, vocab_size)
        documents, kind = 1, "tokens"
    else:
        if vocab_size is not None and vocab_size != VOCAB_SIZE:
            raise ValueError(
                f"--vocab-size {vocab_size} only applies to token files; text is byte-level "
                f"(vocab {VOCAB_SIZE})"
            )
        if source == STDLIB:
            name = f"{STDLIB} (embedded: {embedded.SOURCE})"
            files: list[Path | bytes] = [doc for _, doc in embedded.documents()]
        else:
            name, files = _source_files(source)
        tokens, documents = _tokenize(files, max_bytes, check_text=source != STDLIB)
        vocab, kind = VOCAB_SIZE, "bytes"
    train, val = split(tokens)
    if min(train.numel(), val.numel()) < min_tokens:
        raise ValueError(
            f"data source {source!r} gave {tokens.numel()} tokens from {documents} file(s); "
            f"a {1 / VAL_EVERY:.0%} validation split with windows of {min_tokens} tokens "
            f"needs at least {VAL_EVERY * min_tokens} tokens"
        )
    return Corpus(
        name=name,
        num_documents=documents,
        train=train,
        val=val,
        vocab_size=vocab,
        kind=kind,
        sha256=token_checksum(tokens),
    )


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    offsets = torch.arange(seq_len)
    return tokens[starts[:, None] + offsets[None, :]].long()


class TrainBatches(Iterator[torch.Tensor]):
    """An endless stream of ``[batch_size, seq_len]`` windows at seeded random training offsets: the
    same ``seed``, the same batches in every run, whatever else uses random numbers.
    ``state_dict()`` is the data position a checkpoint keeps; ``load_state_dict`` continues there.
    """

    def __init__(self, corpus: Corpus, *, batch_size: int, seq_len: int, seed: int) -> None:
        if seq_len > corpus.train.numel():
            raise ValueError(
                f"seq_len {seq_len} exceeds the {corpus.train.numel()} training tokens"
            )
        self.corpus, self.batch_size, self.seq_len = corpus, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0
        self._high = corpus.train.numel() - seq_len + 1

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, self._high, (self.batch_size,), generator=self.generator)
        self.position += 1
        return _windows(self.corpus.train, starts, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.position = int(state["position"])


def train_batches(corpus: Corpus, *, batch_size: int, seq_len: int, seed: int) -> TrainBatches:
    """See `TrainBatches`."""
    return TrainBatches(corpus, batch_size=batch_size, seq_len=seq_len, seed=seed)


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
