"""The extract command: model × checkpoints × sources → sums in the warehouse.

For each checkpoint: load the model, compute its parameter tables, then for each source
stream batches through the model with hooks that fold every layer into `TokenSums`, write
the sums, and commit the checkpoint's entries (params + every source) to the manifest in one
atomic step.  Nothing of a checkpoint is visible until all of its sources have finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

from common import faults
from common.errors import UserError
from common.progress import progress
from warehouse import merge, query, schema, store
from warehouse.storage import open_storage

from .accumulate.moments import PRECISIONS, Moments
from .accumulate.sample import Sample
from .accumulate.sums import TokenSums
from .sequences import WindowMeasures
from . import architectures as architectures_module, params as params_module
from .architectures import get_module
from .hooks import capture_layers, layer_kinds
from .models import DTYPES, Loaded, ModelRef, check_dtype, forward_kwargs, load, model_identity, to_compute
from .memory import available_memory, limit_malloc_arenas, release_memory
from .params import norm_table, partition_table, vocab_table
from .staging import Prefetch
from .sources import (ReadStats, SentenceSplitter, Source, fingerprint, indexed_documents, position_keys, source_salt,
                      split_documents, split_source)


@dataclass
class Settings:
    unit: str = "document"  # document | sentence
    max_length: int | None = None  # default: the model's context
    max_tokens: int | None = None  # per source (and shard)
    batch_size: int | None = None  # windows per batch at most (alone: exactly, as before --batch-tokens)
    batch_tokens: int | None = None  # padded tokens per batch at most (default: DEFAULT_BATCH_WINDOWS windows)
    device: str = "cpu"
    dtype: str = "float32"
    shard: tuple[int, int] = (1, 1)
    vector_dtype: str = "float32"
    trust_remote_code: bool = False
    params_only: bool = False
    accumulator_device: str | None = None
    skip_done: bool = False  # keep finished (checkpoint, source, shard) runs with the same settings
    moments: bool = True  # Σh, Σhhᵀ per layer (anisotropy, IsoScore, spectra)
    cross_moments: bool = False  # also Σ h_l h_{l+1}ᵀ per consecutive pair (linearity, CKA, Procrustes; opt-in)
    moments_precision: str = "float32"  # per-batch products: float32 (shifted), bfloat16 or float64
    sequences: bool = False  # per-window measures: sequence moments, curvature, massive activations (opt-in)
    prompt_entropy: bool = False  # per-window prompt entropy (an eigendecomposition per window and layer)
    sample: int = 0  # K: bottom-k sample of token vectors per layer (0 = none)
    special_tokens: bool = False  # count the positions of the tokenizer's special tokens (BOS, [CLS], …)
    memory_budget: int | None = None  # bytes for the token sums; None: half the memory free at the start
    spill_dir: str | None = None  # where sums beyond the budget are spilled (default: the system's temp dir)
    modules: dict = field(default_factory=dict)  # --module ROLE=PATH overrides of the discovered layout
    split_limit: int = 64  # a split source: at most this many distinct values (each holds its own sums)
    read_shard: tuple[int, int] | None = None  # the documents read, where not `shard` (a rank of a reducing torchrun job)
    replace: bool = False  # drop committed partials this run conflicts with (merge.replacements) instead of refusing
    fold: bool = True  # fold the partials into the merged tables in the commit (False: append them, pending)


# Settings that change a run's numbers: a finished run with the same ones can be kept (--skip-done).
RESULT_SETTINGS = ("unit", "max_length", "max_tokens", "dtype", "shard", "vector_dtype", "pile_set", "moments",
                   "cross_moments", "moments_precision", "sample", "special_tokens", "modules", "sequences",
                   "prompt_entropy")


def recorded_setting(settings: dict, key: str):
    """A run's recorded setting; runs from before --cross-moments stored the cross moments with
    every moments run."""
    if key == "cross_moments" and key not in settings:
        return settings.get("moments")
    return settings.get(key)


PREFETCH_BATCHES = 4  # batches made ahead on a background thread (extract/staging.py); 0: in the loop
MASK_ONLY_WITH_PADDING = True  # a batch without padding goes in with attention_mask=None (same sums)

DEFAULT_MAX_LENGTH = 4096  # windows of at most this many tokens unless --max-length says otherwise
DEFAULT_BATCH_WINDOWS = 8  # the default token budget of a batch: this many full windows,
DEFAULT_BATCH_TOKENS = 4096  # and at least this many tokens (short --max-length)


def check_moments_precision(precision: str | None, device: str, dtype: str) -> str:
    """--moments-precision as given, or its default: bfloat16 where the moments live on a GPU and the
    model computes in bfloat16 (exact products on tensor cores), else float32."""
    if precision is None:
        return "bfloat16" if device.startswith("cuda") and dtype == "bfloat16" else "float32"
    if precision not in PRECISIONS:
        raise UserError(f"--moments-precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bfloat16" and dtype != "bfloat16":
        raise UserError(f"--moments-precision bfloat16 needs --dtype bfloat16 (the products are exact only for "
                        f"bfloat16 hidden states), not {dtype}")
    return precision


@dataclass
class SourceResult:
    source: str
    tokens: int = 0
    documents: int = 0
    skipped: int = 0  # documents with no token
    windows: int = 0
    nonfinite: int = 0
    zero: int = 0
    replaced_lines: int = 0
    skipped_lines: int = 0
    filtered: int = 0
    seconds: float = 0.0
    spills: int = 0  # eviction runs written to disk to stay under the memory budget (extract/accumulate/spill.py)
    unread: int = 0  # documents read but left when --max-tokens ran out before them (not counted in `documents`)
    spill_bytes: int = 0  # bytes written to spill files (eviction runs and their merges)
    accumulator_peak_bytes: int = 0
    vector_dtype: str | None = None  # the token vectors as stored: --vector-dtype, float32 where float16 overflows
    files: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)  # code paths taken: layer_step compiled|eager, moments, scatter


# ---------------------------------------------------------------- provenance


def git_hash() -> str:
    here = Path(__file__).resolve().parent.parent
    if not (here / "queries").is_dir():  # an installed wheel (site-packages may lie in another git repository)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return "isotropy-warehouse " + importlib.metadata.version("isotropy-warehouse")
        return "unknown"
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "tokenizers", "pyarrow", "duckdb", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


# ---------------------------------------------------------------- token windows


def max_window(loaded: Loaded, settings: Settings) -> int:
    """Tokens per window, the tokenizer's special tokens included."""
    return settings.max_length or min(loaded.context, DEFAULT_MAX_LENGTH)


class Windower:
    """Token windows (ids, document index, position of the first token in the document's token
    stream), pushed one document at a time: documents or sentences, tokenised without special
    tokens (256 units per tokenizer call) and cut into pieces that leave room for the ones the
    tokenizer adds (`Batcher` adds them; with `specials` False — a pre-tokenised source, whose
    documents are token ids — none are added, none room left).  `exhausted` once --max-tokens
    is reached: push no more.  Push-style so that one read can feed several of them (--split-by);
    `windows` is the same as a generator."""

    CHUNK = 256  # units per tokenizer call

    def __init__(self, loaded: Loaded, settings: Settings, result: SourceResult,
                 splitter: SentenceSplitter | None, specials: bool = True):
        self.tok = loaded.tokenizer
        self.content = max_window(loaded, settings) - (len(loaded.prefix) + len(loaded.suffix) if specials else 0)
        if self.content < 1:
            raise UserError(f"--max-length {max_window(loaded, settings)} leaves no room beside the tokenizer's "
                            f"{len(loaded.prefix) + len(loaded.suffix)} special tokens")
        self.budget = settings.max_tokens
        self.result, self.splitter = result, splitter
        self.chunk: list = []  # units (text or token ids) waiting for the tokenizer
        self.docs: list[int] = []  # each unit's document
        self.doc, self.pos = -1, 0  # the document being cut and its token offset so far

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.budget <= 0

    def push(self, doc: int, text: str | np.ndarray) -> Iterator[tuple[list[int], int, int]]:
        if not isinstance(text, str):  # a pre-tokenised row: one unit of token ids
            units = [text] if len(text) else []
        else:
            units = self.splitter(text) if self.splitter else [text]
            units = units if any(u.strip() for u in units) else []
        if not units:
            self.result.skipped += 1
            return iter(())
        self.chunk.extend(units)
        self.docs.extend([doc] * len(units))
        return self._flush() if len(self.chunk) >= self.CHUNK else iter(())

    def finish(self) -> Iterator[tuple[list[int], int, int]]:
        return self._flush() if self.chunk and not self.exhausted else iter(())

    def _flush(self) -> Iterator[tuple[list[int], int, int]]:
        chunk, docs = self.chunk, self.docs
        self.chunk, self.docs = [], []
        texts_at = [i for i, c in enumerate(chunk) if isinstance(c, str)]  # token ids pass as they are
        enc = [c.tolist() if not isinstance(c, str) else None for c in chunk]
        if texts_at:
            for i, ids in zip(texts_at, self.tok([chunk[i] for i in texts_at], add_special_tokens=False)["input_ids"]):
                enc[i] = ids
        content = self.content
        for ids, doc in zip(enc, docs):
            if doc != self.doc:
                self.doc, self.pos = doc, 0
            for start in range(0, len(ids), content):
                piece = ids[start:start + content]
                if self.budget is not None:
                    piece = piece[:self.budget]
                    self.budget -= len(piece)
                if piece:
                    yield piece, doc, self.pos + start
                if self.exhausted:  # the chunk's later documents were read but not used
                    self.result.unread += len(set(docs[docs.index(doc):]) - {doc})
                    return
            self.pos += len(ids)


def windows(loaded: Loaded, texts: Iterator[tuple[int, str | np.ndarray]], settings: Settings,
            result: SourceResult, splitter: SentenceSplitter | None, specials: bool = True
            ) -> Iterator[tuple[list[int], int, int]]:
    """`Windower` over a stream of (document index, text): reading stops at --max-tokens."""
    w = Windower(loaded, settings, result, splitter, specials)
    for doc, text in texts:
        yield from w.push(doc, text)
        if w.exhausted:
            return
    yield from w.finish()


def batch_limits(loaded: Loaded, settings: Settings) -> tuple[int | None, int | None]:
    """(windows, padded tokens) a batch may hold.  --batch-size alone: that many windows, as
    before token batching; otherwise a token budget (--batch-tokens; by default 8 full windows,
    at least 4,096 tokens: 4,096 at --max-length 512, 16,384 at 2,048), with --batch-size, if
    given, as a cap on the windows."""
    if settings.batch_size is not None and settings.batch_tokens is None:
        return settings.batch_size, None
    default = max(DEFAULT_BATCH_TOKENS, DEFAULT_BATCH_WINDOWS * max_window(loaded, settings))
    return settings.batch_size, settings.batch_tokens or default


class Batcher:
    """Padded batches (input_ids, attention_mask, counted, where) on the host, (B, T) each and
    `where` (B, T, 2): each position's document index and position in the document, from windows
    pushed one at a time.  Every window gets the special tokens the tokenizer adds by default
    (`loaded.prefix`/`suffix`: BOS, [CLS] … [SEP]); their positions are not counted unless
    `count_special`, and a special token id met inside the text (e.g. a literal "<|endoftext|>") is
    not counted either: that is the tokenizer's special-tokens mask.  Counted specials get negative
    positions (−1 − k·8 − j for the j-th special of the window starting at k), never a text position.

    Packing: a batch holds at most `batch_size` windows (None: no cap) and at most `batch_tokens`
    padded tokens, B × T with T its longest window, specials included (None: no budget; a window
    longer than the budget goes alone).  Windows are sorted by length within a buffer of 32
    batches' worth (length bucketing), so padding stays small and short windows (sentences) fill
    a batch as long ones do.  `push` returns the batches a full buffer makes (consume them before
    the next push), `finish` the rest; `batches` is the same as a generator."""

    BUFFER = 32  # batches' worth of windows sorted together

    def __init__(self, loaded: Loaded, batch_size: int | None, batch_tokens: int | None = None,
                 count_special: bool = False, specials: bool = True):
        tok = loaded.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.prefix = np.array(loaded.prefix if specials else [], dtype=np.int64)  # specials=False: rows fed as they are
        self.suffix = np.array(loaded.suffix if specials else [], dtype=np.int64)
        self.special_ids = np.array(sorted(set(getattr(tok, "all_special_ids", []) or [])), dtype=np.int64)
        self.batch_size, self.batch_tokens, self.count_special = batch_size, batch_tokens, count_special
        self.buffer: list[tuple[list[int], int, int]] = []
        self.tokens = 0

    def push(self, w: tuple[list[int], int, int]) -> Iterator[tuple[torch.Tensor, ...]]:
        self.buffer.append(w)
        self.tokens += len(w[0]) + len(self.prefix) + len(self.suffix)
        full = (self.tokens >= self.BUFFER * self.batch_tokens) if self.batch_tokens is not None else \
            (len(self.buffer) >= self.BUFFER * self.batch_size)
        return self.finish() if full else iter(())

    def finish(self) -> Iterator[tuple[torch.Tensor, ...]]:
        buffer, self.buffer, self.tokens = self.buffer, [], 0
        return self._packed(buffer)

    def _make(self, group):
        prefix, suffix = self.prefix, self.suffix
        p, q = len(prefix), len(suffix)
        B = len(group)
        lens = np.fromiter((len(ids) for ids, _, _ in group), dtype=np.int64, count=B)  # (B,)
        docs = np.fromiter((doc for _, doc, _ in group), dtype=np.int64, count=B)
        starts = np.fromiter((start for _, _, start in group), dtype=np.int64, count=B)
        T = int(lens.max()) + p + q
        flat = np.fromiter((t for ids, _, _ in group for t in ids), dtype=np.int64, count=int(lens.sum()))  # (N,)
        rows = np.repeat(np.arange(B), lens)  # (N,) each text token's window
        offs = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)  # (N,) its place in the window
        input_ids = np.full((B, T), self.pad, dtype=np.int64)
        input_ids[rows, p + offs] = flat
        input_ids[:, :p] = prefix
        tail = (p + lens)[:, None] + np.arange(q)  # (B, q) the suffix's columns
        input_ids[np.arange(B)[:, None], tail] = suffix
        mask = (np.arange(T) < (lens + p + q)[:, None]).astype(np.int64)  # (B, T)
        where = np.zeros((B, T, 2), dtype=np.int64)
        where[:, :, 0] = docs[:, None]
        where[rows, p + offs, 1] = starts[rows] + offs
        if self.count_special:  # every position of the window but padding
            counted = mask.astype(bool)
            spec = np.concatenate([np.broadcast_to(np.arange(p), (B, p)), tail], axis=1)  # (B, p + q)
            where[np.arange(B)[:, None], spec, 1] = -1 - starts[:, None] * 8 - np.arange(p + q)
        else:
            counted = np.zeros((B, T), dtype=bool)
            counted[rows, p + offs] = ~np.isin(flat, self.special_ids)
        return (torch.from_numpy(input_ids), torch.from_numpy(mask), torch.from_numpy(counted),
                torch.from_numpy(where))

    def _packed(self, buffer):
        pq = len(self.prefix) + len(self.suffix)
        buffer.sort(key=lambda w: len(w[0]))
        group: list = []
        for w in buffer:  # ascending: the window joining is the batch's longest
            if group and ((self.batch_size is not None and len(group) >= self.batch_size) or
                          (self.batch_tokens is not None and (len(group) + 1) * (len(w[0]) + pq) > self.batch_tokens)):
                yield self._make(group)
                group = []
            group.append(w)
        if group:
            yield self._make(group)


def batches(loaded: Loaded, wins: Iterator[tuple[list[int], int, int]], batch_size: int | None,
            batch_tokens: int | None = None, count_special: bool = False, specials: bool = True
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`Batcher` over a stream of windows."""
    b = Batcher(loaded, batch_size, batch_tokens, count_special, specials)
    for w in wins:
        yield from b.push(w)
    yield from b.finish()


# ---------------------------------------------------------------- one source


def memory_budget(settings: Settings) -> int:
    """Bytes the token sums may hold: --memory-budget, else half of what the accumulator's device
    has free when the source starts (after the model is loaded)."""
    if settings.memory_budget is not None:
        return settings.memory_budget
    return available_memory(torch.device(settings.accumulator_device or settings.device)) // 2


def new_accumulator(loaded: Loaded, settings: Settings, budget: int) -> TokenSums:
    """The sums of one source: per-token sums and, as settings say, moments, per-window measures
    and the sample."""
    kinds = layer_kinds(loaded.model, loaded.layout)
    d = loaded.d
    emb = get_module(loaded.model, loaded.layout.embedding)
    acc = TokenSums(len(kinds), emb.weight.shape[0], d, settings.device, settings.accumulator_device,
                    budget=budget, spill_dir=settings.spill_dir)
    try:
        if settings.moments:
            acc.moments = Moments(len(kinds), d, settings.accumulator_device or settings.device,
                                  cross=settings.cross_moments, precision=settings.moments_precision)
        if settings.sequences:  # on the moments' background thread where there is one (same order)
            acc.extra = WindowMeasures(len(kinds), d, settings.accumulator_device or settings.device,
                                       precision=settings.moments_precision, prompt_entropy=settings.prompt_entropy,
                                       worker=acc.moments._worker if acc.moments is not None else None)
        if settings.sample:
            acc.sample = Sample(len(kinds), settings.sample, d)
        return acc
    except BaseException:
        acc.close()
        raise


def base_forward(loaded: Loaded, settings: Settings):
    """The base model's forward on the device, looked up once per source (not per batch)."""
    base = get_module(loaded.model, loaded.layout.base)
    kwargs = forward_kwargs(loaded.layout.head)
    device = settings.device

    def run(input_ids: torch.Tensor, mask: torch.Tensor | None) -> None:  # (B, T) each, on the host
        if mask is not None and MASK_ONLY_WITH_PADDING and bool(mask.all()):  # a host tensor: no device sync
            mask = None  # no padding: no mask, so transformers' mask code has nothing to test on the device
        base(input_ids=input_ids.to(device, non_blocking=True),
             attention_mask=None if mask is None else mask.to(device, non_blocking=True), **kwargs)

    return run


def _forward(run, acc: TokenSums, batch, salt: int, result: SourceResult) -> int:
    """One batch through the base model (`run`: `base_forward`), its layers folded into `acc` by the hooks."""
    input_ids, mask, counted, where = batch
    n = acc.set_batch(input_ids, counted, where)
    if acc.sample is not None:
        w = where[counted]  # (M, 2): document, position
        keys = torch.from_numpy(position_keys(salt, w[:, 0].numpy(), w[:, 1].numpy()))
        acc.sample.set_batch(keys, torch.cat([w, input_ids[counted][:, None]], 1))
    run(input_ids, mask)
    faults.hit("forward")
    result.tokens += n
    result.windows += input_ids.shape[0]
    return n


def _finish(result: SourceResult, acc: TokenSums, stats: ReadStats) -> None:
    result.replaced_lines = stats.replaced_lines
    result.skipped_lines = stats.skipped_lines
    result.nonfinite = int(acc.nonfinite.sum())
    result.zero = int(acc.zero.sum())
    result.spills = acc.spill_count
    result.spill_bytes = acc.spill_bytes
    result.accumulator_peak_bytes = acc.peak_bytes
    result.paths = code_paths(acc)


def code_paths(acc: TokenSums) -> dict[str, str]:
    """The code paths a source's sums took (a slower one also warned when it was taken)."""
    if acc.moments is not None:
        acc.moments.finish()  # its background thread decides each layer's rows at the layer's first batch
    return {**acc.paths, **(acc.moments.paths if acc.moments is not None else {})}


def _bar(loaded: Loaded, name: str, settings: Settings):
    return progress(f"{loaded.ref.name}@{loaded.checkpoint} {name}", unit="tok", unit_scale=True,
                    total=settings.max_tokens, mininterval=1.0)  # a bar on a terminal, else plain lines


def accumulate_source(loaded: Loaded, source: Source, settings: Settings, result: SourceResult
                      ) -> TokenSums:
    """Stream one source through the model; the caller must `close()` the returned sums."""
    acc = new_accumulator(loaded, settings, memory_budget(settings))
    try:
        salt = source_salt(source.name)
        stats = ReadStats()
        splitter = SentenceSplitter() if settings.unit == "sentence" else None
        texts = indexed_documents(source, settings.read_shard or settings.shard, stats)
        bar = _bar(loaded, source.name, settings)
        forward = base_forward(loaded, settings)
        start = time.perf_counter()
        specials = not source.pretokenized  # training rows are fed as the model saw them
        made = Prefetch(lambda: batches(  # tokenised and packed on a background thread, ≤ PREFETCH_BATCHES ahead
            loaded, windows(loaded, texts, settings, result, splitter, specials), *batch_limits(loaded, settings),
            settings.special_tokens, specials), settings.device, PREFETCH_BATCHES)
        with made, torch.inference_mode(), capture_layers(loaded.model, loaded.layout, acc.add):
            for batch in made:
                bar.update(_forward(forward, acc, batch, salt, result))
        bar.close()
        result.seconds = time.perf_counter() - start
        result.documents = stats.documents - result.unread
        result.filtered = stats.filtered
        _finish(result, acc, stats)
        return acc
    except BaseException:
        acc.close()
        raise


@dataclass
class SplitPart:
    """One value of a split: its source, result, sums and its own windows and batches — the same
    ones a filtered run of that value makes, so its numbers are that run's."""
    source: Source
    result: SourceResult
    acc: TokenSums
    windower: Windower
    batcher: Batcher
    salt: int


def accumulate_split(loaded: Loaded, source: Source, settings: Settings) -> list[SplitPart]:
    """Stream a split source (--split-by, several --pile-set) through the model in one read: each
    document goes to its value's windows, batches and sums; a batch holds one value's windows.
    The memory budget is shared equally by the values seen so far (a value's sums spill exactly
    when its share is exceeded).  The caller must `close()` every part's sums."""
    parts: dict[str, SplitPart] = {}
    names: dict[str, str] = {}  # source name → value
    total_budget = memory_budget(settings)
    current: list[TokenSums | None] = [None]
    stats = ReadStats()
    splitter = SentenceSplitter() if settings.unit == "sentence" else None
    limits = batch_limits(loaded, settings)
    wanted = set(source.split_values) if source.split_values is not None else None

    def add(layer: int, hidden: torch.Tensor) -> None:
        current[0].add(layer, hidden)

    def part_of(value: str) -> SplitPart:
        sub = split_source(source, value)
        if sub.name in names:
            raise UserError(f"--split-by {source.split_by}: the values {names[sub.name]!r} and {value!r} both make "
                            f"the source name {sub.name!r}; split by another field or filter one with --pile-set")
        if len(parts) >= settings.split_limit:
            raise UserError(f"--split-by {source.split_by}: more than {settings.split_limit} distinct values in "
                            f"--source {source.name} (each holds its own sums); raise --split-limit or split by "
                            "a field with fewer values")
        share = total_budget // (len(parts) + 1)
        for other in parts.values():  # the budget is shared: each value's sums spill beyond its share
            other.acc.budget = share
            if other.acc.table_bytes() > share:
                other.acc.spill()
        result = SourceResult(sub.name)
        acc = new_accumulator(loaded, settings, share)
        names[sub.name] = value
        parts[value] = SplitPart(sub, result, acc, Windower(loaded, settings, result, splitter),
                                 Batcher(loaded, *limits, settings.special_tokens), source_salt(sub.name))
        return parts[value]

    def run(part: SplitPart, batch) -> None:
        current[0] = part.acc
        t = time.perf_counter()
        bar.update(_forward(forward, part.acc, batch, part.salt, part.result))
        part.result.seconds += time.perf_counter() - t

    forward = base_forward(loaded, settings)
    bar = _bar(loaded, f"{source.name} (split by {source.split_by})", settings)
    try:
        with torch.inference_mode(), capture_layers(loaded.model, loaded.layout, add):
            for index, value, text in split_documents(source, settings.read_shard or settings.shard, stats):
                part = parts.get(value) or part_of(value)
                if part.windower.exhausted:  # --max-tokens of this value reached
                    if wanted is not None and len(parts) == len(wanted) and \
                            all(p.windower.exhausted for p in parts.values()):
                        break
                    continue
                part.result.documents += 1
                for w in part.windower.push(index, text):
                    for batch in part.batcher.push(w):
                        run(part, batch)
            for part in parts.values():
                for w in part.windower.finish():
                    for batch in part.batcher.push(w):
                        run(part, batch)
                for batch in part.batcher.finish():
                    run(part, batch)
        bar.close()
        for value, part in parts.items():
            part.result.documents -= part.result.unread
            part.result.filtered = stats.rows - stats.value_rows.get(value, 0)
            _finish(part.result, part.acc, stats)
        if stats.unassigned:
            print(f"warning: {source.name}: {stats.unassigned} rows have no {source.split_by}; left out",
                  file=sys.stderr)
        return sorted(parts.values(), key=lambda p: p.source.name)
    except BaseException:
        for part in parts.values():
            part.acc.close()
        raise


class _Float16Overflow(Exception):
    """A token sum has a component beyond float16's range."""


def _token_rows(writer: store.TableWriter, acc: TokenSums, n_layers: int, key: dict, vector_dtype: str
                ) -> list[tuple[np.ndarray, int]]:
    """Writes every layer's token rows (vectors in `vector_dtype`); returns per layer Σ_t Σû (d,)
    float64 and the vectors counted.  Raises _Float16Overflow at the first float16 vector with an
    infinite component (a token type counted more than 65,504 times can reach it: |Σû| ≤ n_t)."""
    vec_np = {"float64": np.float64, "float32": np.float32, "float16": np.float16}[vector_dtype]
    totals = []
    for layer in range(n_layers):
        total = np.zeros(acc.d, dtype=np.float64)  # (d,)
        n_total = 0
        for ids, counts, S in acc.layer_rows(layer):  # (m,), (m,), (m, d) float64
            m = len(ids)
            with np.errstate(over="ignore"):
                V = S.astype(vec_np)  # (m, d)
            if vec_np is np.float16 and np.isinf(V).any():
                raise _Float16Overflow
            writer.write({
                **{k: [v] * m for k, v in key.items()},
                "layer": np.full(m, layer, np.int16), "token_id": ids.astype(np.int32),
                "n": counts, "sum_sq": np.einsum("ij,ij->i", S, S), "vec": store.list_array(V),
            })
            total += S.sum(0)
            n_total += int(counts.sum())
        totals.append((total, n_total))
    return totals


def write_sums(root, loaded: Loaded, source: Source, settings: Settings, acc: TokenSums,
               run_id: str) -> tuple[dict[str, str], str]:
    """token_sums and layer_sums of one (checkpoint, source, shard), one Parquet file each,
    written in chunks of token types (memory bounded whatever V and d are).  Returns the files and
    the dtype the token vectors were stored in: --vector-dtype, except float16 where a sum would
    overflow it (then float32, the file written again; the entry's stats say so)."""
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint, "source": source.name,
              "shard": f"{settings.shard[0]}-of-{settings.shard[1]}"}
    key = {**values, "step": loaded.step}
    kinds = layer_kinds(loaded.model, loaded.layout)

    def token_writer(vector_dtype: str) -> store.TableWriter:
        return store.TableWriter(root, "token_sums", values, run_id, schema.TOKEN_SUMS.set(
            schema.TOKEN_SUMS.get_field_index("vec"),
            pa.field("vec", schema.vector_type(vector_dtype), nullable=False)))

    stored = settings.vector_dtype
    writers = [token_writer(stored)]
    try:
        try:
            totals = _token_rows(writers[0], acc, len(kinds), key, stored)
        except _Float16Overflow:
            writers[0].abort()
            stored = "float32"
            writers[0] = token_writer(stored)
            totals = _token_rows(writers[0], acc, len(kinds), key, stored)
        writers.append(store.TableWriter(root, "layer_sums", values, run_id))
        layer_rows = {k: [] for k in ("layer", "layer_kind", "n_layers", "n", "sum_sq", "n_nonfinite",
                                      "n_zero", "vec", "sum_h", "sum_u2", "windows", "window_cos",
                                      *schema.WINDOW_SCALARS)}
        ex = acc.extra
        scalars = ex.scalars() if ex is not None else {k: [None] * len(kinds) for k in schema.WINDOW_SCALARS}
        nonfinite, zero = acc.nonfinite.cpu(), acc.zero.cpu()
        sum_h, sum_u2 = acc.sum_h.cpu().numpy(), acc.sum_u2.cpu().numpy()
        windows, window_cos = acc.windows.cpu().numpy(), acc.window_cos.cpu().numpy()
        for layer, kind in enumerate(kinds):
            total, n_total = totals[layer]
            layer_rows["layer"].append(layer)
            layer_rows["layer_kind"].append(kind)
            layer_rows["n_layers"].append(len(kinds))
            layer_rows["n"].append(n_total)
            layer_rows["sum_sq"].append(float(total @ total))
            layer_rows["n_nonfinite"].append(int(nonfinite[layer]))
            layer_rows["n_zero"].append(int(zero[layer]))
            layer_rows["vec"].append(total.tolist())
            layer_rows["sum_h"].append(sum_h[layer].tolist())
            layer_rows["sum_u2"].append(sum_u2[layer].tolist())
            layer_rows["windows"].append(int(windows[layer]))
            layer_rows["window_cos"].append(float(window_cos[layer]))
            for k, v in scalars.items():
                layer_rows[k].append(v[layer])
        writers[1].write({**{k: [v] * len(kinds) for k, v in key.items()}, **layer_rows})
        files = {"token_sums": writers[0].close(), "layer_sums": writers[1].close()}
        if acc.moments is not None:
            w = store.TableWriter(root, "moments", values, run_id)
            writers.append(w)
            m = acc.moments
            for layer in range(len(kinds)):  # one row group per layer: d×d matrices are large
                last = layer == len(kinds) - 1 or not m.has_cross
                w.write({**{k: [v] for k, v in key.items()}, "layer": [layer], "n": [int(m.n[layer])],
                         "s1": [m.s1[layer].cpu().numpy()], "s2": [m.s2(layer).reshape(-1)],
                         "n_pair": [None if last else int(m.n_pair[layer])],
                         "s_cross": [None if last else m.cross(layer).reshape(-1)]})
            files["moments"] = w.close()
        if ex is not None:
            w = store.TableWriter(root, "sequence_moments", values, run_id)
            writers.append(w)
            for layer in range(len(kinds)):
                for pooling, mo in ex.pooled.items():
                    w.write({**{k: [v] for k, v in key.items()}, "layer": [layer], "pooling": [pooling],
                             "n": [int(mo.n[layer])], "s1": [mo.s1[layer].cpu().numpy()],
                             "s2": [mo.s2(layer).reshape(-1)]})
            files["sequence_moments"] = w.close()
            w = store.TableWriter(root, "massive", values, run_id)
            writers.append(w)
            for layer in range(len(kinds)):
                top = ex.top(layer)
                if top["rank"]:
                    w.write({**{k: [v] * len(top["rank"]) for k, v in key.items()},
                             "layer": [layer] * len(top["rank"]), **top})
            files["massive"] = w.close()
        if acc.sample is not None:
            w = store.TableWriter(root, "samples", values, run_id)
            writers.append(w)
            smp = acc.sample
            for layer in range(len(kinds)):
                k = len(smp.keys)
                w.write({**{kk: [v] * k for kk, v in key.items()}, "layer": np.full(k, layer, np.int16),
                         "key": smp.keys.numpy(), "document": smp.meta[:, 0].numpy(),
                         "position": smp.meta[:, 1].numpy(), "token_id": smp.meta[:, 2].numpy().astype(np.int32),
                         "vec": list(smp.vecs[layer].numpy())})
            files["samples"] = w.close()
        return files, stored
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _params_code() -> str:
    """What the parameter tables' numbers depend on besides the weights: their code and torch."""
    h = hashlib.blake2b(digest_size=8)
    for module in (params_module, architectures_module):
        h.update(Path(module.__file__).read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()


PARAMS_CODE = _params_code()


def params_kept(manifest: dict, loaded: Loaded, prov: dict) -> bool:
    """Whether the warehouse already holds this checkpoint's parameter tables computed from the same
    weights (hub commit, or a local directory's files by name, size and mtime), the same layout and the
    same code: then they are kept, not computed again (each source, shard, rank or sweep unit of a
    checkpoint would otherwise recompute them: 3·V·d² float64 multiply-adds per matrix)."""
    entry = manifest["entries"].get(store.entry_key("params", loaded.ref.name, loaded.checkpoint))
    if entry is None or loaded.weights_id is None:
        return False
    old = entry.get("provenance", {})
    return all(old.get(k) == prov[k] for k in ("weights", "params_code", "layout", "model_location", "model_revision"))


def write_params(root, loaded: Loaded, run_id: str) -> dict[str, str]:
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint}
    key = {**values, "step": loaded.step}
    files = {}
    written = []
    try:
        for table, rows in (("partition_fn", partition_table(loaded)), ("norm_params", norm_table(loaded)),
                            ("vocab", vocab_table(loaded))):
            w = store.TableWriter(root, table, values, run_id)
            written.append(w)
            n = len(next(iter(rows.values()))) if rows else 0
            w.write({**{k: [v] * n for k, v in key.items()}, **rows} if n else
                    {f.name: [] for f in schema.TABLES[table]})
            files[table] = w.close()
        return files
    except BaseException:
        for w in written:
            w.abort()
        raise


# ---------------------------------------------------------------- the command


def _entry(kind: str, loaded: Loaded, run_id: str, files: dict, settings: Settings, d: int,
           source: Source | None = None, result: SourceResult | None = None, prov: dict | None = None
           ) -> dict:
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}" if source else None
    s = asdict(settings)
    s["shard"] = shard
    s.pop("read_shard")  # how a job divided its share among its ranks is not a setting of the result
    s["pile_set"] = source.pile_set if source else None
    s["split_by"] = source.split_by if source else None
    s["split_value"] = source.split_value if source else None
    return {
        "key": store.entry_key(kind, loaded.ref.name, loaded.checkpoint, source and source.name, shard),
        "kind": kind, "model": loaded.ref.name, "checkpoint": loaded.checkpoint, "step": loaded.step,
        "source": source and source.name, "shard": shard, "run_id": run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": files,
        "stats": ({k: v for k, v in asdict(result).items() if k not in ("files", "source")}
                  if result else {}),
        "settings": s, "provenance": prov or {},
    }


def _done(manifest: dict, ref: ModelRef, checkpoint: str, source: Source, settings: Settings,
          source_fingerprint: str, identity: str | None = None) -> bool:
    """Whether the warehouse holds this (checkpoint, source, shard) with the same data and settings.
    A split source is done when any of its values is: a checkpoint's sources commit together."""
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}"
    if source.split_by is None:
        entries = [manifest["entries"].get(store.entry_key("data", ref.name, checkpoint, source.name, shard))]
    else:
        entries = [e for e in manifest["entries"].values()
                   if e["kind"] == "data" and e["model"] == ref.name and e["checkpoint"] == checkpoint
                   and e["shard"] == shard and e["source"].startswith(source.name + ".")
                   and e["settings"].get("split_by") == source.split_by]
    want = {**asdict(settings), "shard": shard, "pile_set": source.pile_set}
    for entry in entries:
        if entry is None or entry["provenance"].get("source_fingerprint") != source_fingerprint:
            continue
        if entry["provenance"].get("model_location") != ref.location:
            continue
        if identity and entry["provenance"].get("model_identity") not in (None, identity):
            continue  # the same directory holds other weights now (retrained): not done
        if source.split_values is not None and entry["settings"].get("split_value") not in source.split_values:
            continue
        if all(recorded_setting(entry["settings"], k) == want[k] for k in RESULT_SETTINGS):
            return True
    return False


class Interrupted(Exception):
    """SIGINT (Ctrl-C) during extract, with a line saying what was committed; the command line
    prints it and exits 130."""


def after_commit(root, what: str, exc: BaseException, log) -> None:
    """A failure after the commit record was created: the data is in the warehouse.  What follows
    the record (manifest.json, runs.parquet, views.sql: caches a query rewrites; removing replaced
    files: orphans `validate --fix` removes) is not needed for correct answers, so a failure there
    is a warning; an interrupt there ends the run, saying the commit landed."""
    try:
        generation = f"generation {store.read_state(root)[0]}"
    except Exception:  # noqa: BLE001 - the line is what matters
        generation = "its commit record"
    if isinstance(exc, KeyboardInterrupt):
        raise Interrupted(f"interrupted after {what} was committed ({generation}); its data is in the warehouse "
                          "(views.sql, runs.parquet and manifest.json are rewritten by the next query)") from None
    if not isinstance(exc, (OSError, UserError)):
        raise exc
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    log(f"warning: {what} was committed ({generation}), but a step after its record failed ({reason}); "
        "views.sql, runs.parquet and manifest.json are rewritten by the next query (or `cli.py views`), "
        "left-over files are removed by `cli.py validate --fix`")


def remove_empty_dirs(root, model: str, checkpoint: str) -> None:
    """After a failed checkpoint: the partition folders of (model, checkpoint) that hold nothing (its
    writers created them; their files were removed), bottom-up; folders with any file stay."""
    import os
    from urllib.parse import quote

    if not getattr(root, "local", False):
        return  # object stores have no folders
    tables = Path(root.path("tables"))
    if not tables.is_dir():
        return
    for table in tables.iterdir():
        top = table / f"model={quote(model, safe='')}"
        for folder, _, _ in os.walk(top / f"checkpoint={quote(checkpoint, safe='')}", topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        for d in (top, table):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    with contextlib.suppress(OSError):
        os.rmdir(tables)


def check_coverage(root, ref: ModelRef, checkpoint: str, sources: list[Source], settings: Settings,
                   prints: dict[str, str], identity: str | None) -> None:
    """Before any forward pass: what `merge.commit` would refuse for these sources' partials (an
    overlapping shard, another version of a source file, other weights under this name), unless
    --replace.  A split source's partials are named by values not read yet: the committed values of
    that split stand for them."""
    if settings.replace:
        return
    manifest = store.read_manifest(root)
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}"
    prov = {"model_identity": identity}
    probes = [{"key": store.entry_key("params", ref.name, checkpoint), "kind": "params", "model": ref.name,
               "checkpoint": checkpoint, "source": None, "shard": None, "provenance": prov}]
    for source in sources:
        names = [source.name] if source.split_by is None else sorted(
            {e["source"] for e in manifest["entries"].values() if e["kind"] == "data" and e["model"] == ref.name
             and e["checkpoint"] == checkpoint and (e["source"] or "").startswith(source.name + ".")
             and e["settings"].get("split_by") == source.split_by})
        for name in names:
            probes.append({"key": store.entry_key("data", ref.name, checkpoint, name, shard), "kind": "data",
                           "model": ref.name, "checkpoint": checkpoint, "source": name, "shard": shard,
                           "provenance": {**prov, "source_fingerprint": prints.get(source.name)}})
    merge.check_conflicts(manifest, probes)


def extract(ref: ModelRef, checkpoints: list[str], sources: list[Source], root,
            settings: Settings, log=print, prints: dict[str, str] | None = None, loader=None, reducer=None,
            compact: bool = False) -> list[SourceResult]:
    """Every checkpoint over every source, one commit per checkpoint.  `prints`: the sources' data
    fingerprints where the caller has them already (a sweep's plan), so no file is hashed twice.
    `loader(ref, checkpoint)`: a `Loaded` instead of `load` (an in-memory model, extract/api.py),
    run in its own dtype and device (not cast).  `reducer` (extract/reduce.py, a rank of a torchrun
    job): the ranks' sums are added before the write, and only rank 0 writes and commits.  `compact`:
    each checkpoint is compacted after its commit (`cli.py compact`; it then takes no new partial).
    SIGINT (KeyboardInterrupt) anywhere ends in `Interrupted`, whose line says what was committed."""
    committed: list[str] = []  # "model@checkpoint" of the commits that landed
    current: list[str] = []  # the checkpoint being worked on
    try:
        return _extract(ref, checkpoints, sources, root, settings, log, prints, committed, current, loader, reducer,
                        compact)
    except KeyboardInterrupt:  # outside a checkpoint's own handler: loading, checks, logging
        what = f"{ref.name}@{(current or checkpoints or ['?'])[0]}"
        if what in committed:
            raise Interrupted(f"interrupted after {what} was committed; its data is in the warehouse") from None
        raise Interrupted(f"interrupted: nothing of {what} was committed" +
                          (f"; committed before it: {', '.join(committed)}" if committed else "")) from None


def _extract(ref: ModelRef, checkpoints: list[str], sources: list[Source], root, settings: Settings, log,
             prints: dict[str, str] | None, committed: list[str], current: list[str], loader=None, reducer=None,
             compact: bool = False) -> list[SourceResult]:
    root = open_storage(root)  # a directory or s3://bucket/prefix; S3 is probed here, before any model loads
    limit_malloc_arenas()
    dtype = DTYPES[settings.dtype]
    check_dtype(dtype, settings.device)
    store.read_manifest(root)  # fails early on a warehouse of another schema version
    prints = {s.name: (prints or {}).get(s.name) or fingerprint(s) for s in sources}
    results: list[SourceResult] = []
    base_prov = {"git_hash": git_hash(), "packages": package_versions(), "model_location": ref.location}
    for checkpoint in checkpoints:
        current[:] = [checkpoint]
        todo = list(sources)
        identity = model_identity(ref, checkpoint)  # a local directory's weights: known before loading
        if settings.skip_done:
            manifest = store.read_manifest(root)
            todo = [s for s in sources if not _done(manifest, ref, checkpoint, s, settings, prints[s.name],
                                                    identity)]
            params_key = store.entry_key("params", ref.name, checkpoint)
            skip = not todo and params_key in manifest["entries"]
            if reducer is not None:  # every rank runs what rank 0 runs
                names, skip = reducer.agree(([s.name for s in todo], skip))
                todo = [s for s in sources if s.name in names]
            if skip:
                log(f"{ref.name}@{checkpoint}: already in the warehouse with these settings; skipped")
                continue
        if not settings.params_only:
            merge.check_open(store.read_manifest(root), ref.name, checkpoint)  # before hours of forward passes
        data_todo = [] if settings.params_only else todo
        check_coverage(root, ref, checkpoint, data_todo, settings, prints, None)  # shards and files: before loading
        t0 = time.perf_counter()
        loaded = (load(ref, checkpoint, dtype, settings.device, settings.trust_remote_code, settings.modules)
                  if loader is None else loader(ref, checkpoint))
        if identity is None and loaded.revision_hash:  # a hub model's commit (an in-memory model's weights), once loaded
            identity = model_identity(ref, checkpoint, loaded.revision_hash)
        spent = {"load": time.perf_counter() - t0}  # seconds of each phase, logged per checkpoint
        if settings.max_length is not None and settings.max_length > loaded.context:
            raise UserError(f"--max-length {settings.max_length} exceeds the model's context of {loaded.context} tokens")
        d = loaded.d
        manifest = store.read_manifest(root)
        store.check_compatible(manifest, ref.name, d)
        check_coverage(root, ref, checkpoint, data_todo, settings, prints, identity)  # other weights, this name
        run_id = store.new_run_id()
        prov = {**base_prov, "model_revision": loaded.revision_hash or checkpoint,
                "weights": loaded.weights_id, "model_identity": identity, "params_code": PARAMS_CODE,
                "layout": loaded.layout.describe(),
                "special_tokens": {"prefix": list(loaded.prefix), "suffix": list(loaded.suffix),
                                   "counted": settings.special_tokens},
                "max_length": max_window(loaded, settings)}
        written: list[str] = []
        entries: list[dict] = []
        done_here = 0  # results of this checkpoint (a split source gives one per value)
        try:
            t = time.perf_counter()
            if params_kept(manifest, loaded, prov) or (reducer is not None and not reducer.writes):
                spent["parameter tables (kept)" if reducer is None or reducer.writes else "parameter tables (rank 0)"] = 0.0
            else:
                params_files = write_params(root, loaded, run_id)
                spent["parameter tables"] = time.perf_counter() - t
                written += params_files.values()
                entries = [_entry("params", loaded, run_id, params_files, settings, d, prov=prov)]
            if loader is None:  # an in-memory model is left in its own dtype and device
                to_compute(loaded, dtype, settings.device)
            for source in ([] if settings.params_only else todo):
                if source.split_by is None:
                    result = SourceResult(source.name)
                    parts = [(source, result, accumulate_source(loaded, source, settings, result))]
                else:
                    parts = [(p.source, p.result, p.acc) for p in accumulate_split(loaded, source, settings)]
                release_memory()  # the forward's freed temporaries, before the write allocates
                if reducer is not None:  # the job's sums, on rank 0 ([] on the others)
                    t = time.perf_counter()
                    parts = reducer.reduce(parts, lambda name, value, source=source: (
                        split_source(source, value) if value is not None else source, SourceResult(name),
                        new_accumulator(loaded, settings, memory_budget(settings))))
                    spent["reduce"] = spent.get("reduce", 0.0) + time.perf_counter() - t
                    if not parts:
                        continue
                try:
                    if sum(r.tokens for _, r, _ in parts) == 0:
                        raise UserError(f"--source {source.name}: {source.describe()}: no tokens to process "
                                        f"({sum(r.documents for _, r, _ in parts)} documents after filters)")
                    for sub, result, acc in parts:  # one value's sums written, then freed
                        spent["forward"] = spent.get("forward", 0.0) + result.seconds
                        t = time.perf_counter()
                        result.files, result.vector_dtype = write_sums(root, loaded, sub, settings, acc, run_id)
                        spent["write"] = spent.get("write", 0.0) + time.perf_counter() - t
                        written += result.files.values()
                        acc.close()
                finally:
                    for _, _, acc in parts:
                        acc.close()
                parts = [(sub, result) for sub, result, _ in parts]
                release_memory()
                for sub, result in parts:
                    entries.append(_entry("data", loaded, run_id, result.files, settings, d, sub, result,
                                          {**prov, "source_fingerprint": prints[source.name],
                                           "source_path": str(sub.path.resolve()) if sub.path is not None else sub.describe()}))
                    results.append(result)
                    if result.replaced_lines:
                        log(f"warning: {sub.name}: {result.replaced_lines} lines had bytes that are not UTF-8 (replaced with U+FFFD)")
                    if result.skipped_lines:
                        log(f"warning: {sub.name}: {result.skipped_lines} lines had bytes that are not UTF-8 (skipped)")
                    if result.nonfinite:
                        log(f"warning: {sub.name}: {result.nonfinite} NaN/inf activations counted and excluded")
                    if result.vector_dtype != settings.vector_dtype:
                        log(f"warning: {sub.name}: a token's sum of unit vectors exceeds {settings.vector_dtype}'s range "
                            f"(it occurs more than 65,504 times): its vectors are stored in {result.vector_dtype}")
                done_here += len(parts)
            t = time.perf_counter()
            if entries:  # nothing when the parameter tables were kept and no source was left
                merge.commit(root, entries, replace=settings.replace, fold=settings.fold)  # one record
            spent["commit"] = time.perf_counter() - t
        except BaseException as exc:
            kept = merge.committed_files(root, entries)
            for rel in written:  # files of a commit that did not happen (never of one that did)
                if rel not in kept:
                    with contextlib.suppress(Exception):  # a storage fault: an orphan for validate --fix
                        root.delete(rel)
            store.release_leases(root, [run_id])  # its files are gone (or orphans, which --fix may now move)
            if not (entries and kept >= {f for e in entries for f in e["files"].values()}):
                remove_empty_dirs(root, ref.name, checkpoint)  # nothing of this checkpoint landed
                if isinstance(exc, KeyboardInterrupt):
                    raise Interrupted(f"interrupted: nothing of {ref.name}@{checkpoint} was committed" +
                                      (f"; committed before it: {', '.join(committed)}" if committed else "")
                                      ) from None
                raise
            after_commit(root, f"{ref.name}@{checkpoint}", exc, log)  # the record landed: say so
        finally:
            del loaded
        committed.append(f"{ref.name}@{checkpoint}")
        if compact and (reducer is None or reducer.writes) and any(e["kind"] == "data" for e in entries):
            t = time.perf_counter()
            merge.compact(root, ref.name, checkpoint)
            spent["compact"] = time.perf_counter() - t
        if reducer is None or reducer.writes:
            try:
                query.refresh_companions(root)  # views.sql for the DuckDB shell (a query would rewrite it too)
            except BaseException as exc:
                after_commit(root, f"{ref.name}@{checkpoint}", exc, log)
        log(f"{ref.name}@{checkpoint}: {time.perf_counter() - t0:.1f} s: " +
            ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()))
        for r in results[len(results) - done_here:]:
            log(f"{ref.name}@{checkpoint} {r.source}: {r.tokens} tokens, {r.documents} documents, "
                f"{r.skipped} skipped, {r.windows} windows, {r.nonfinite} non-finite, "
                f"{r.seconds:.1f} s ({r.tokens / max(r.seconds, 1e-9):.0f} tok/s)")
    return results


def summary_line(results: list[SourceResult], seconds: float) -> str:
    tokens = sum(r.tokens for r in results)
    return (f"done: {tokens} tokens, {sum(r.documents for r in results)} documents, "
            f"{sum(r.skipped for r in results)} skipped, {sum(r.nonfinite for r in results)} non-finite, "
            f"{seconds:.1f} s")

