"""Compaction: a finished checkpoint's per-partial vectors and merge state dropped, every view kept."""

from __future__ import annotations

from common import faults
from common.errors import UserError

from .. import schema, store
from ..storage import Storage, open_storage, reading_once
from ..store import Manifest
from .commits import publish_retrying, fold_pending
from .groups import ALL, data_by_pair, expected_groups, pending_pairs, stale_groups


class _Pending(Exception):
    """A partial of the checkpoints arrived after their fold: fold again, then compact."""


@reading_once
def compact(root, model: str | None = None, checkpoint: str | None = None) -> dict:
    """Drop the per-partial vectors (token_sums, moments, samples, attention_sums) and the merge state (token_vectors,
    moments_merged, samples_merged) of the matching checkpoints, keeping every table a view reads.
    Pending partials are folded first (`fold_pending`).  Afterwards the checkpoint is final: a new
    partial of it is refused.  Returns bytes before/after."""
    root = open_storage(root)
    drop_data = ("token_sums", "moments", "samples", "sequence_moments", "attention_sums")
    sizes = {}

    def make(manifest):
        stale, _ = stale_groups(manifest)
        pairs = sorted(p for p in data_by_pair(manifest)
                       if (model is None or p[0] == model) and (checkpoint is None or p[1] == checkpoint))
        if not pairs:
            raise UserError(f"no extracted checkpoint matches model={model!r} checkpoint={checkpoint!r}")
        want = expected_groups(manifest)
        if any((want[k][0], want[k][1]) in pairs for k in stale):
            raise UserError("merged tables are out of date; run `python cli.py validate --fix` before compacting")
        if set(pending_pairs(manifest)) & set(pairs):
            raise _Pending
        sizes["before"] = _token_bytes(root, manifest, pairs)
        sizes["pairs"] = pairs
        updated = []
        for e in manifest["entries"].values():
            if (e["model"], e["checkpoint"]) not in pairs or e["kind"] not in ("data", "merged"):
                continue
            drop = drop_data if e["kind"] == "data" else schema.STATE_TABLES
            updated.append({**e, "files": {t: f for t, f in e["files"].items() if t not in drop}, "compacted": True})
        faults.hit("compact")
        return updated, [], None

    for _ in range(1000):
        fold_pending(root, model, checkpoint)
        try:
            publish_retrying(root, make)
            break
        except _Pending:
            continue
    else:
        raise UserError(f"{root}: gave up compacting (other writers kept adding partials to the checkpoint)")
    after = _token_bytes(root, store.read_manifest(root), sizes["pairs"])
    return {"checkpoints": len(sizes["pairs"]), "before": sizes["before"], "after": after}


def _token_bytes(root: Storage, manifest: Manifest, pairs: list[tuple[str, str]]) -> dict:
    """Bytes of the token-level files of `pairs` and the (layer, token type) cells they cover."""
    total, cells = 0, 0
    for e in manifest["entries"].values():
        if (e["model"], e["checkpoint"]) not in pairs:
            continue
        for t in ("token_sums", "token_stats", "token_vectors"):
            if t in e["files"]:
                total += root.size(e["files"][t])
        if e["kind"] == "merged" and e["source"] == ALL:
            cells += root.parquet_file(e["files"]["token_stats"]).metadata.num_rows
    return {"bytes": total, "cells": cells, "bytes_per_cell": total / cells if cells else None}
