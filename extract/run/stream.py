"""One source through the model: read, window, batch, forward, and fold every layer's hidden states
into the sums (`TokenSums` with, as the settings say, moments, per-window measures and a sample).

`accumulate_source` streams a plain source; `accumulate_split` streams a split source (--split-by,
several --pile-set) in one read, each value into its own windows, batches and sums.  Batches are made
on a background thread (`Prefetch`) while the model runs; the hooks (extract/hooks.py) hand each
layer's output to the sums."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch

from common import faults
from common.errors import UserError
from common.progress import progress

from ..accumulate import AttentionSums, EmbeddingRows, Moments, Sample, TokenSums
from ..architectures import get_module
from ..attention import attention_plan, capture_attention
from ..hooks import capture_layers, layer_kinds
from ..masks import known_batch
from ..memory import available_memory
from ..models import Loaded, forward_kwargs
from ..sequences import WindowMeasures
from ..sentences import SentenceSplitter
from ..sources import (ReadStats, Source, indexed_documents, position_keys, source_salt,
                       split_documents, split_source)
from ..staging import Prefetch, stage
from .settings import Settings, SourceResult
from .windows import Batcher, Windower, batch_limits, batches, windows

PREFETCH_BATCHES = 4  # batches made ahead on a background thread (extract/staging.py); 0: in the loop
PREFETCH_ENV = "ISO_PREFETCH"  # overrides PREFETCH_BATCHES (benchmarks: the thread budget's variants)


def prefetch_batches() -> int:
    """Batches made ahead: $ISO_PREFETCH, else PREFETCH_BATCHES."""
    value = os.environ.get(PREFETCH_ENV, "").strip()
    if not value:
        return PREFETCH_BATCHES
    if not value.isdigit():
        raise UserError(f"{PREFETCH_ENV}={value!r}: expected a number of batches (0: made in the loop)")
    return int(value)
MASK_ONLY_WITH_PADDING = True  # a batch without padding goes in with attention_mask=None (same sums)


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
            acc.layer0 = EmbeddingRows(emb.weight)  # layer 0's moments by token type where its rows are the embedding's
        if settings.sequences:  # on the moments' background thread where there is one (same order)
            acc.extra = WindowMeasures(len(kinds), d, settings.accumulator_device or settings.device,
                                       precision=settings.moments_precision, prompt_entropy=settings.prompt_entropy,
                                       worker=acc.moments.worker if acc.moments is not None else None)
        if settings.sample:
            acc.sample = Sample(len(kinds), settings.sample, d)
        plan = attention_for(loaded, settings)
        if plan is not None:
            acc.attention = AttentionSums(plan.shapes, settings.device, moments=settings.attention_moments,
                                          sinks=settings.attention_sinks)
        return acc
    except BaseException:
        acc.close()
        raise


def attention_for(loaded: Loaded, settings: Settings):
    """The attention plan (extract/attention.py) where --attention is on and the model is covered;
    a model that is not gets one line, once."""
    if not settings.attention:
        return None
    plan, why = attention_plan(loaded.model, loaded.layout,
                               say=lambda why: print(f"note: {loaded.ref.name}@{loaded.checkpoint}: no per-head "
                                                     f"attention sums ({why})", file=sys.stderr))
    return plan


def base_forward(loaded: Loaded, settings: Settings):
    """The base model's forward on the device, looked up once per source (not per batch)."""
    base = get_module(loaded.model, loaded.layout.base)
    kwargs = forward_kwargs(loaded.layout.head)
    device = settings.device

    def run(input_ids: torch.Tensor, mask: torch.Tensor | None) -> None:  # (B, T) each, on the host
        if mask is not None and MASK_ONLY_WITH_PADDING and mask.numpy().all():  # a host tensor: no device sync
            mask = None  # no padding: no mask, so transformers' mask code has nothing to test on the device
        # padding or none, known here: transformers' questions about the batch answered from the host (masks.py)
        with known_batch(mask is not None) if MASK_ONLY_WITH_PADDING else contextlib.nullcontext():
            base(input_ids=input_ids.to(device, non_blocking=True),
                 attention_mask=None if mask is None else mask.to(device, non_blocking=True), **kwargs)

    return run


def forward_batch(run, acc: TokenSums, batch, salt: int, result: SourceResult) -> int:
    """One batch through the base model (`run`: `base_forward`), its layers folded into `acc` by the hooks."""
    input_ids, mask, counted, where = batch
    n = acc.set_batch(input_ids, counted, where)
    if acc.attention is not None:
        acc.attention.set_batch(counted, mask)
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
    by_type = acc.layer0.path() if acc.layer0 is not None else None  # layer 0's moments (by_type.py)
    return {**acc.paths, **(acc.moments.paths if acc.moments is not None else {}),
            **({"moments_by_type": by_type} if by_type is not None else {}),
            **(acc.attention.paths if acc.attention is not None else {})}


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
            settings.special_tokens, specials), settings.device, prefetch_batches())
        plan = attention_for(loaded, settings) if acc.attention is not None else None  # probed before the hooks
        with made, torch.inference_mode(), capture_layers(loaded.model, loaded.layout, acc.add), \
                capture_attention(plan, acc.attention.add if plan is not None else None):
            for batch in made:
                bar.update(forward_batch(forward, acc, batch, salt, result))
            if acc.moments is not None:  # the work left for the end (a queue's tail, the products by type)
                acc.moments.finish()
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

    def add_attention(*args) -> None:
        current[0].attention.add(*args)

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
        batch = stage(batch, settings.device)  # pinned on CUDA, so the copies to the device do not wait
        current[0] = part.acc
        t = time.perf_counter()
        bar.update(forward_batch(forward, part.acc, batch, part.salt, part.result))
        part.result.seconds += time.perf_counter() - t

    forward = base_forward(loaded, settings)
    plan = attention_for(loaded, settings)  # its probe forward before the layer hooks are in place
    bar = _bar(loaded, f"{source.name} (split by {source.split_by})", settings)
    try:
        with torch.inference_mode(), capture_layers(loaded.model, loaded.layout, add), \
                capture_attention(plan, add_attention):
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
            if part.acc.moments is not None:  # the work left for the end, in the value's seconds
                t = time.perf_counter()
                part.acc.moments.finish()
                part.result.seconds += time.perf_counter() - t
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

