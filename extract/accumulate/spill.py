"""The disk tier of the token sums: runs of token-sorted float64 rows, merged as they accumulate,
read back once in bounded memory; and the sweep of spill directories a killed run left behind.

**The spill bound.**  Let W be the bytes written to disk (`bytes_written`) and E those of the
eviction runs (`bytes_evicted`).  When the runs after the first (the base) hold ≥ RATIO × its rows,
all are merged into a new base in one k-way pass by token range.  A merge writes ≤ base + the runs
it consumes ≤ (1 + 1/RATIO) × the latter, and each eviction run is consumed by one merge, so
**W ≤ (2 + 1/RATIO) E = 2.5 E** (RATIO 2).  E itself depends on the stream, not only on the types
seen: a type evicted and seen again is evicted again, and no fixed budget below the stream's working
set avoids that (a stream cycling through 2K types with room for K must write a row per re-entry),
so "W ≤ 2 × the final table" cannot hold for every stream.  Evicting by frequency (tables.py) keeps
E to the re-entries of the tail; tests/test_spill.py checks the bound, bench/bench_spill.py
measures it on Zipf streams.

**Exactness.**  Rows are float64 sums, written and read back bit for bit; a merge adds a token's
rows in run order, oldest first, so the merged sums are what adding the runs in order gives.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from common import faults
from common.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: orphaned spill directories are not swept
    fcntl = None


class SpillRun:
    """One run on disk: tokens.npy (n,) ascending; per layer counts{l}.npy (n,) and sums{l}.f64,
    (n, d) float64 raw rows, read by explicit ranges (no memory map: RSS stays bounded)."""

    def __init__(self, path: Path, ids: np.ndarray, spill: "Spill"):
        self.path, self.ids, self._spill = path, ids, spill
        self._layer, self._f, self._counts = None, None, None

    def read(self, layer: int, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        if self._layer != layer:
            self.close()
            self._counts = np.load(self.path / f"counts{layer}.npy")
            self._f = open(self.path / f"sums{layer}.f64", "rb")
            self._layer = layer
        d = self._spill.d
        self._f.seek(i * 8 * d)
        rows = np.fromfile(self._f, dtype=np.float64, count=(j - i) * d).reshape(j - i, d)
        self._spill.bytes_read += rows.nbytes + 8 * (j - i)
        return self._counts[i:j], rows

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._layer, self._f, self._counts = None, None, None


def union_ids(ids: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(ids)) if ids else np.empty(0, dtype=np.int64)


def merge_chunk(sources: list, layer: int, ids: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts (m,) and Σû (m, d) float64 of the sorted token ids `ids` (a contiguous piece of the
    sources' union), the sources' rows added in the order given."""
    S = np.zeros((len(ids), d), dtype=np.float64)
    n = np.zeros(len(ids), dtype=np.int64)
    if not len(ids):
        return n, S
    for src in sources:
        i, j = np.searchsorted(src.ids, [ids[0], ids[-1] + 1])
        if j > i:
            pos = np.searchsorted(ids, src.ids[i:j])
            c, rows = src.read(layer, i, j)
            S[pos] += rows
            n[pos] += c
    return n, S


class Spill:
    """The disk tier: runs of token-sorted float64 rows in a private directory under `root` (the
    system's temp dir by default), merged as they accumulate: when the runs after the first (the
    base) hold ≥ RATIO × its rows, all are merged into a new base in one k-way pass (the rows of a
    token added in run order, oldest first), so a merge writes ≤ (1 + 1/RATIO) × the rows it
    consumes beyond the base, and bytes written ≤ (2 + 1/RATIO) × bytes evicted.

    Interrupted runs leave no garbage for long: a run is written under a temporary name and renamed
    (fault point `spill` between its layers); the directory holds a `lock` file the process keeps
    flock'ed, and the next accumulator that spills under the same root removes the directories whose
    lock nobody holds (their process is dead: the kernel drops a flock with its holder)."""

    PREFIX = "isotropy-spill-"
    RATIO = 2  # merge when the runs after the base hold RATIO × its rows

    def __init__(self, n_layers: int, d: int, root: str | Path | None):
        self.L, self.d = n_layers, d
        self.root = root
        self.chunk = max(256, (16 << 20) // (8 * d))  # rows per read/write: 16 MiB
        self.dir: Path | None = None
        self._lock = None
        self.runs: list[SpillRun] = []
        self.evictions = 0
        self.bytes_written = 0  # all runs: evicted and merged
        self.bytes_evicted = 0  # the eviction runs alone (E)
        self.bytes_read = 0
        self._seq = 0

    def _directory(self) -> Path:
        if self.dir is None:
            root = Path(self.root) if self.root is not None else Path(tempfile.gettempdir())
            try:
                root.mkdir(parents=True, exist_ok=True)
                remove_orphans(root)
                new = Path(tempfile.mkdtemp(prefix="." + self.PREFIX, dir=root))
            except OSError as e:  # a file, a read-only or full disk: one line, not "[Errno 17] File exists"
                raise UserError(f"spilling token sums: --spill-dir {root}: {e.strerror or e}; choose another "
                                f"--spill-dir or raise --memory-budget") from e
            self._lock = open(new / "lock", "w")
            if fcntl is not None:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
            self.dir = new.rename(root / new.name[1:])  # visible to the sweep only once locked
        return self.dir

    def write(self, ids: np.ndarray, fetch, evicted: bool = True) -> None:
        """A run of the token ids (n,) ascending and their rows, fetch(layer, a, b) → (counts, rows)."""
        path = self._directory() / f"{self._seq:05d}"
        self._seq += 1
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.mkdir()
            np.save(tmp / "tokens.npy", ids)
            for layer in range(self.L):
                counts = []
                with open(tmp / f"sums{layer}.f64", "wb") as f:
                    for a in range(0, len(ids), self.chunk):
                        c, rows = fetch(layer, a, min(a + self.chunk, len(ids)))
                        f.write(np.ascontiguousarray(rows, dtype=np.float64).tobytes())
                        counts.append(c)
                np.save(tmp / f"counts{layer}.npy", np.concatenate(counts) if counts else np.empty(0, np.int64))
                faults.hit("spill")
        except OSError as e:  # a full or unwritable disk: one line (the directory goes at close)
            raise UserError(f"spilling token sums to {self.dir}: {e.strerror or e}; free space there, "
                            f"choose another --spill-dir or raise --memory-budget") from e
        written = sum(p.stat().st_size for p in tmp.iterdir())
        self.bytes_written += written
        tmp.rename(path)
        self.runs.append(SpillRun(path, ids, self))
        if evicted:
            self.evictions += 1
            self.bytes_evicted += written
            self._merge()

    def _merge(self) -> None:
        if len(self.runs) < 2 or sum(len(r.ids) for r in self.runs[1:]) < self.RATIO * len(self.runs[0].ids):
            return
        runs, self.runs = self.runs, []
        union = union_ids([r.ids for r in runs])
        try:
            self.write(union, lambda layer, a, b: merge_chunk(runs, layer, union[a:b], self.d), evicted=False)
        finally:
            for r in runs:
                r.close()
        for r in runs:
            shutil.rmtree(r.path)

    def close(self) -> None:
        for r in self.runs:
            r.close()
        self.runs = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None


HIDDEN_GRACE_S = 600  # a hidden spill directory this old whose lock nobody holds (or has none) is garbage


def remove_orphans(root: Path, now: float | None = None) -> list[Path]:
    """Remove the spill directories under `root` whose lock no process holds (left by a killed
    run); returns them.  A directory whose lock file cannot be opened is kept (not provably garbage) —
    except a hidden one (`.isotropy-spill-*`: a run killed between creating it and locking it, a few
    microseconds) older than HIDDEN_GRACE_S: no live run leaves one unlocked that long."""
    removed = []
    if fcntl is None:
        return removed
    now = time.time() if now is None else now
    for d in [*root.glob(Spill.PREFIX + "*"), *root.glob("." + Spill.PREFIX + "*")]:
        hidden = d.name.startswith(".")
        try:
            if hidden and now - d.stat().st_mtime < HIDDEN_GRACE_S:
                continue
            if hidden and not (d / "lock").exists():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
                continue
            with open(d / "lock", "r+") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:  # held by a live process, or no lock file
            continue
    return removed
