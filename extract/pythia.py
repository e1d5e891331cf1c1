"""Pythia's exact training batches: the pre-tokenised Megatron `MMapIndexedDataset` files that
EleutherAI publishes (`document.bin` + `document.idx`), read with numpy memory maps (no torch,
no Megatron).

The `.idx` file: the magic b"MMIDIDX\\x00\\x00", version (<Q, 1), the token dtype's code (<B), the
number of sequences (<Q) and of document boundaries (<Q), then the sequences' sizes (int32), their
byte offsets into `.bin` (int64) and the document index (int64).  In Pythia's preshuffled data each
sequence is one training row of 2,049 tokens, and training step N used rows
`rows_per_step · N … rows_per_step · N + rows_per_step − 1`; the model saw a row's first
`seq_length − 1` tokens as input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from common.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float64, 8: np.uint16}


@dataclass(frozen=True)
class PythiaBatches:
    prefix: str  # PREFIX.bin / PREFIX.idx
    steps: tuple[int, int]  # inclusive
    rows_per_step: int = 1024
    seq_length: int = 2049

    def describe(self) -> str:
        a, b = self.steps
        return (f"pythia:{self.prefix} steps {a}:{b}, {self.rows_per_step} rows per step, "
                f"sequence length {self.seq_length}")

    @property
    def rows(self) -> range:
        a, b = self.steps
        return range(a * self.rows_per_step, (b + 1) * self.rows_per_step)


def parse_steps(spec: str | None) -> tuple[int, int]:
    if spec is None:
        raise UserError("a pythia: source needs --steps A:B (training steps, inclusive)")
    parts = spec.split(":")
    try:
        a, b = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (-1, -1)
    except ValueError:
        a, b = -1, -1
    if a < 0 or b < a:
        raise UserError(f"--steps {spec!r}: expected A:B with 0 ≤ A ≤ B (or one step N)")
    return a, b


class IndexedTokens:
    """The sequences of one MMapIndexedDataset (memory-mapped; nothing read until asked)."""

    def __init__(self, prefix: str | Path, where: str = ""):
        idx, bin_ = Path(f"{prefix}.idx").expanduser(), Path(f"{prefix}.bin").expanduser()
        where = where or str(prefix)
        for p in (idx, bin_):
            if not p.is_file():
                raise UserError(f"{where}: {p}: no such file")
        head = idx.open("rb").read(34)
        if len(head) < 34 or head[:9] != MAGIC:
            raise UserError(f"{where}: {idx} is not a Megatron MMapIndexedDataset index (bad header)")
        version = int.from_bytes(head[9:17], "little")
        code = head[17]
        if version != 1 or code not in DTYPES:
            raise UserError(f"{where}: {idx}: unsupported index version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        count, docs = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
        need = 34 + count * 12 + docs * 8
        if idx.stat().st_size < need:
            raise UserError(f"{where}: {idx} is truncated ({idx.stat().st_size} bytes, the header says {need})")
        self.sizes = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(count,))
        self.pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=34 + 4 * count, shape=(count,))
        self.count = count
        self.idx_path, self.bin_path = idx, bin_
        end = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if count else 0
        if bin_.stat().st_size < end:
            raise UserError(f"{where}: {bin_} is shorter than its index says ({bin_.stat().st_size} < {end} bytes)")
        self.data = np.memmap(bin_, dtype=np.uint8, mode="r") if count else np.zeros(0, np.uint8)

    def row(self, i: int) -> np.ndarray:
        start, n = int(self.pointers[i]), int(self.sizes[i])
        return self.data[start: start + n * self.dtype.itemsize].view(self.dtype)


def open_batches(spec: PythiaBatches, where: str) -> IndexedTokens:
    """The dataset, its steps checked against the number of rows (one line when out of range)."""
    ds = IndexedTokens(spec.prefix, where)
    rows = spec.rows
    if rows.stop > ds.count:
        last = ds.count // spec.rows_per_step - 1
        raise UserError(f"{where}: --steps {spec.steps[0]}:{spec.steps[1]} needs rows up to {rows.stop - 1}, the "
                        f"dataset has {ds.count} (steps 0:{last} at {spec.rows_per_step} rows per step)")
    return ds


def training_rows(spec: PythiaBatches, where: str) -> Iterator[np.ndarray]:
    """Each selected row as the model saw it: its first seq_length − 1 token ids (int64)."""
    ds = open_batches(spec, where)
    for i in spec.rows:
        yield ds.row(i)[: spec.seq_length - 1].astype(np.int64)


def fingerprint(spec: PythiaBatches, where: str) -> str:
    """blake2b of the index file and of the selected rows' tokens, with the step settings."""
    ds = open_batches(spec, where)
    h = hashlib.blake2b(digest_size=16)
    with open(ds.idx_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    for i in spec.rows:
        h.update(np.ascontiguousarray(ds.row(i)).tobytes())
    h.update(spec.describe().encode())
    return h.hexdigest()
