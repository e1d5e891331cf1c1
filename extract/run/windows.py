"""Token windows and padded batches: text (or token ids) cut into windows that fit the model with
its special tokens, then packed into (B, T) batches under a window count and a token budget.

`Windower` and `Batcher` are push-style, so that one read can feed several of them (a split
source: one pair per value); `windows` and `batches` are the same as generators."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from common.errors import UserError

from ..models import Loaded
from ..sentences import SentenceSplitter
from .settings import DEFAULT_BATCH_TOKENS, DEFAULT_BATCH_WINDOWS, DEFAULT_MAX_LENGTH, Settings, SourceResult


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

