"""Offline byte-level text: the corpus shipped in recipes/corpus/, or any file/folder.

The default corpus is the same bytes on every machine: 19 modules of CPython 3.11.7's
standard library, 620,697 bytes shipped in recipes/corpus/ (PSF license; its README says
which), read as bytes (vocab 256) and checked against DEFAULT_SHA256. The printed file
count, byte count and sha256 say whether two runs saw the same bytes. The last
``val_fraction`` of the bytes is the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8 * 2**20  # 8 MiB: loads in well under a second, far more than CPU runs use
DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus" / "cpython-3.11.7-stdlib.txt"
DEFAULT_SHA256 = "2010028bb26c0809b4658dcf65abf39b0886542fddea51701f263c26844d99f5"


@dataclass
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    source: str
    n_files: int
    n_bytes: int
    sha256: str

    def describe(self) -> str:
        return (
            f"data: {self.source}: {self.n_files} files, {self.n_bytes:,} bytes "
            f"(train {len(self.train):,} / val {len(self.val):,}), sha256 {self.sha256[:16]}"
        )


def _list_files(root: Path, suffix: str | None) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                files.append(Path(dirpath) / f)
    # Sort by path relative to the root so the order does not depend on the filesystem.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)  # compare.py trains several modes in one process
def load_corpus(
    path: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1
) -> Corpus:
    """Reads up to ``max_bytes`` bytes and splits them into train and validation.

    Args:
        path: a text file or a folder (every file in it, recursively, sorted); None means
            the shipped corpus (DEFAULT_CORPUS), refused if its sha256 is not DEFAULT_SHA256.
        max_bytes: cap on the bytes read, so loading stays fast.
        val_fraction: the tail of the byte stream held out for validation.

    Returns:
        A Corpus. Raises OSError (unreadable path) or ValueError (empty) with a one-line
        message.
    """
    if path is None:
        root, suffix = DEFAULT_CORPUS, None
        source = f"recipes/corpus/{DEFAULT_CORPUS.name}"
    else:
        root, suffix, source = Path(path), None, path
        if not root.exists():
            raise OSError(f"--data {path}: no such file or directory")
    files = [root] if root.is_file() else _list_files(root, suffix)
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        try:
            b = f.read_bytes()[: max_bytes - total]
        except OSError as e:
            raise OSError(f"--data {f}: cannot read ({e.strerror})") from None
        chunks.append(b)
        total += len(b)
    raw = b"".join(chunks)
    if not raw:
        raise ValueError(f"--data {source}: no bytes to train on")
    sha256 = hashlib.sha256(raw).hexdigest()
    if path is None and sha256 != DEFAULT_SHA256:
        raise ValueError(
            f"{source} has sha256 {sha256[:16]}..., not the shipped {DEFAULT_SHA256[:16]}...: "
            "the default corpus was changed (git checkout recipes/corpus restores it); "
            "pass your own text with --data PATH"
        )
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return Corpus(
        train=data[: len(data) - n_val],
        val=data[len(data) - n_val :],
        source=source,
        n_files=len(chunks),
        n_bytes=len(raw),
        sha256=sha256,
    )


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows (x, y=x shifted by one) from ``data``, sharded by rank.

    Every rank draws the same global batch of ``batch_size`` windows from the same seeded
    generator and keeps its own contiguous slice: N ranks then see exactly the samples a
    single process would, so losses are comparable across world sizes and the generator
    state alone is the data state a checkpoint needs.
    """
    ix = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    per_rank = batch_size // world_size
    ix = ix[rank * per_rank : (rank + 1) * per_rank]
    x = torch.stack([data[i : i + seq_len] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1 : i + 1 + seq_len] for i in ix.tolist()]).long()
    return x, y
