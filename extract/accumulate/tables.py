"""The slot table that holds the token sums on one device, and the budget it lives under.

A token type gets a *slot* the first time a batch counts it; every layer keeps a float64 row per
slot and an int64 count.  The map token → slot is a numpy array on the host, updated from the
batch's token ids (which the host already has), so the device never reports which tokens are new.

**Budget and tiers.**  With `budget` bytes, a table grows (×1.25) only while it fits — on a GPU one
layer at a time, copying; on a CPU within one address reservation per layer (`SlotTable._reserved`,
where memory is committed only as it is touched: `lazy_memory`), copying nothing.  When the next
batch's new types would not, it *evicts* the least-counted EVICT share of its resident types —
counted over the whole stream so far (`freq`); the batch's own types never — and reuses their slots:
the frequent types stay resident and are never written.  Evicted rows go to the next tier: the
accumulator's device table → (when it is a GPU) a host-RAM table (another `SlotTable`, by default
under half the host's free memory) → disk runs (`spill.Spill`).  `TokenSums` (sums.py) wires the
tiers together; a type's final sum is its partial sums added oldest tier first.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from common.errors import UserError

from ..memory import available_memory


def check_budget(budget, slot_bytes: int, what: str) -> None:
    """A budget in bytes (None: unbounded) that holds at least one token type's `slot_bytes`."""
    if budget is None:
        return
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise UserError(f"{what} {budget!r}: expected a number of bytes")
    if budget < slot_bytes:
        raise UserError(f"{what} {budget} bytes is below one token type's {slot_bytes} bytes")


def default_host_budget() -> int:
    """The host tier's default budget: half of the host memory free now."""
    return available_memory(torch.device("cpu")) // 2


@functools.cache
def lazy_memory() -> bool:
    """Whether a large CPU allocation only reserves addresses until its pages are touched, at no cost to a
    limit later allocations need: Linux without strict overcommit (`vm.overcommit_memory` 2 counts every
    allocation against a commit limit) and without an address-space limit (`ulimit -v`).  Elsewhere (another
    system may commit on allocation) no."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() == "2":
                return False
        import resource

        return resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY
    except (OSError, ValueError, ImportError):
        return False


class SlotTable:
    """A float64 slot table of token sums on one device: sums[layer] (capacity, d), counts[layer]
    (capacity,), the maps token → slot (V,) and slot → token (capacity,) on the host, and the free
    slots (evicted, reused first).  It grows ×1.25 within `budget`; when full, `admit` evicts the
    least-counted EVICT of the resident types (by `freq`, the occurrences seen over the stream)."""

    EVICT = 0.25  # share of the resident types evicted when the table is full
    RESERVE = True  # on a CPU, grow within one reservation per layer (`_reserved`); False: copy, as on a GPU

    def __init__(self, n_layers: int, vocab: int, d: int, device, budget: int | None, freq: np.ndarray):
        self.L, self.V, self.d = n_layers, vocab, d
        self.device = torch.device(device)
        self.budget = budget
        self.freq = freq
        self.slot_of = np.full(vocab, -1, dtype=np.int64)  # (V,) token → slot
        self.peak_bytes = 0
        self._refused = False  # the CPU's reservation was refused once: growth copies from then on
        self.reset()

    def reset(self) -> None:
        """Empty and release the table (nothing may be resident)."""
        self.tokens = np.empty(0, dtype=np.int64)  # (capacity,) slot → token, −1 where free
        self.used = 0  # slots handed out so far (high-water mark); free ones below it are in `free`
        self.free = np.empty(0, dtype=np.int64)
        self.sums = [torch.zeros(0, self.d, dtype=torch.float64, device=self.device) for _ in range(self.L)]
        self.counts = [torch.zeros(0, dtype=torch.int64, device=self.device) for _ in range(self.L)]
        self._res: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # the CPU's reservation (`_reserved`)

    @property
    def capacity(self) -> int:
        return len(self.tokens)

    @property
    def resident(self) -> int:
        return self.used - len(self.free)

    def table_bytes(self) -> int:
        return self.capacity * (self.L * (8 * self.d + 8) + 8)

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.tokens[: self.used] >= 0)

    def grow(self, need: int) -> bool:
        """Make room for `need` slots (as far as the budget allows); whether they fit."""
        cap = self.capacity
        if need <= cap:
            return True
        new = min(max(cap + cap // 4, need, 1024), self.V)
        row = 8 * self.d + 8
        if self.budget is not None:
            # where growth copies, one layer at a time, the old and the new copy of the last layer
            # coexist; the same schedule everywhere, so evictions fall alike with a reservation or without
            new = min(new, (self.budget - cap * row) // (self.L * row + 8))
        if new > cap:
            outgrown = self._res is not None and self._res[0][0].shape[0] < new  # its rows move, all layers at once
            views = self._reserved(new, row)
            copy = cap * row if views is None else self.L * cap * row if outgrown else 0
            self.peak_bytes = max(self.peak_bytes, self.L * new * row + copy + 8 * new)  # ≥ table_bytes()
            for layer in range(self.L):
                if views is not None:  # the reservation's first `new` rows: the old ones are its first `cap`
                    grown, counts = views[0][layer][:new], views[1][layer][:new]
                else:
                    grown = torch.empty(new, self.d, dtype=torch.float64, device=self.device)
                    grown[:cap] = self.sums[layer]
                    counts = torch.empty(new, dtype=torch.int64, device=self.device)
                    counts[:cap] = self.counts[layer]
                grown[cap:].zero_()  # only the new rows
                counts[cap:].zero_()
                self.sums[layer], self.counts[layer] = grown, counts
            self.tokens = np.concatenate([self.tokens, np.full(new - cap, -1, dtype=np.int64)])
        return new >= need

    def _reserved(self, new: int, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """On a CPU, per layer one allocation of the most rows this table may reach (the vocabulary, or
        what the budget holds), the table's sums and counts being views of its first rows: growing
        copies nothing, and the pages of rows never reached are never touched, so never resident
        (the allocation only reserves addresses).  Made at the first growth (or again, the rows
        copied once, where a raised budget outgrows it).  None where there is none: a GPU (its
        allocator commits what it is asked for), a system where reserving would spend a limit that later
        allocations need (`lazy_memory`), or the allocation was refused — then each growth copies."""
        if self.device.type != "cpu" or not self.RESERVE or self._refused or not lazy_memory():
            return None
        if self._res is not None and self._res[0][0].shape[0] >= new:
            return self._res
        most = self.V if self.budget is None else min(self.V, self.budget // (self.L * row + 8))
        rows = max(new, most)
        try:
            res = ([torch.empty(rows, self.d, dtype=torch.float64) for _ in range(self.L)],
                   [torch.empty(rows, dtype=torch.int64) for _ in range(self.L)])
        except (RuntimeError, MemoryError):
            self._refused = True
            self._res = None  # an outgrown reservation goes once the copies replace its views
            return None
        cap = self.capacity
        for layer in range(self.L):  # rows of an outgrown reservation (none at the first growth)
            res[0][layer][:cap] = self.sums[layer]
            res[1][layer][:cap] = self.counts[layer]
        self._res = res
        return res

    def admit(self, ids: np.ndarray, evict) -> bool:
        """Give every token of `ids` (distinct) a slot; when the table is full, the least-counted
        EVICT share of the other resident types (at least as many as needed) is passed to `evict(slots)`
        (token-ascending) and released.  False (nothing changed) when `ids` alone do not fit."""
        new = ids[self.slot_of[ids] < 0]
        if not len(new):
            return True
        short = len(new) - len(self.free)
        if short > 0 and not self.grow(self.used + short):
            room = self.capacity - self.resident
            occupied = self.occupied()
            cand = occupied[~np.isin(self.tokens[occupied], ids)]
            need = len(new) - room
            if need > len(cand):
                return False
            k = min(max(need, int(self.EVICT * len(occupied))), len(cand))
            if k < len(cand):  # the k least counted (ties: the lower slot, deterministic)
                order = np.lexsort((cand, self.freq[self.tokens[cand]]))
                cand = cand[order[:k]]
            victims = cand[np.argsort(self.tokens[cand])]
            evict(victims)
            self.release(victims)
        k = min(len(new), len(self.free))
        slots = np.concatenate([self.free[:k], np.arange(self.used, self.used + len(new) - k)])
        self.free = self.free[k:]
        self.used += len(new) - k
        self.slot_of[new] = slots
        self.tokens[slots] = new
        return True

    def release(self, slots: np.ndarray) -> None:
        """Zero the rows at `slots` and make them free."""
        idx = torch.from_numpy(slots).to(self.device)
        for layer in range(self.L):
            self.sums[layer].index_fill_(0, idx, 0)
            self.counts[layer].index_fill_(0, idx, 0)
        self.slot_of[self.tokens[slots]] = -1
        self.tokens[slots] = -1
        self.free = np.concatenate([self.free, slots])

    def fetcher(self, slots: np.ndarray):
        """fetch(layer, a, b) → (counts (b−a,), rows (b−a, d)) of slots[a:b], on the host."""
        idx = torch.from_numpy(slots).to(self.device)

        def fetch(layer: int, a: int, b: int):
            return (self.counts[layer].index_select(0, idx[a:b]).cpu().numpy(),
                    self.sums[layer].index_select(0, idx[a:b]).cpu().numpy())
        return fetch

    def source(self) -> "TableSource":
        occupied = self.occupied()
        order = np.argsort(self.tokens[occupied], kind="stable")
        return TableSource(self.tokens[occupied][order], self.fetcher(occupied[order]))


class TableSource:
    """A slot table's rows in token order, for merging: ids (n,) ascending, read(layer, i, j)."""

    def __init__(self, ids: np.ndarray, fetch):
        self.ids, self.read = ids, fetch

    def close(self) -> None:
        pass
