"""`cli.py pull`: a local copy of a warehouse (typically one on S3) for tools that read local files.

The DuckDB shell reads an S3 warehouse only with its httpfs extension; where that cannot be
installed, or to work offline, `pull` copies the current state into a new local directory: by
default only the files the metric views read (the merged tables, layer sums and parameter tables —
about 42 B per (layer, token type) per group), marked compacted so that no extract folds into the
copy; with `full`, every file (a mirror that takes new partials like the original).  The copy gets
one commit record listing exactly what was copied, written last: an interrupted pull leaves no
visible state, and running it again finishes it.
"""

from __future__ import annotations

from common.errors import UserError

from . import merge, query, schema, store
from .storage import HashingStream, Storage, open_storage, reading_once
from .store import Checksum

COPY_CHUNK = 8 << 20
VIEW_ONLY_DROPS = {"data": ("token_sums", "moments", "samples", "sequence_moments", "attention_sums"),
                   "merged": schema.STATE_TABLES}


def _copy(src: Storage, dest: Storage, rel: str, want: Checksum | None = None) -> int:
    """Copy one file, hashing it on the way: a copy that differs from its commit record's checksum
    (`want`) is refused with one line, before the copy's record is written."""
    store.hold_lease(dest, store.run_of(rel) or "pull")  # validate --fix leaves the copy alone
    out = dest.output(rel)
    h = HashingStream(out.stream)
    try:
        with src.input_stream(rel) as f:
            while chunk := f.read(COPY_CHUNK):
                h.write(chunk)
        if want and h.checksum() != {"size": want["size"], "blake2b": want["blake2b"]}:
            raise UserError(f"{src.display(rel)}: content differs from its commit record's checksum; "
                            "not copied (run `python cli.py validate` on the source)")
        out.commit()
    except BaseException:
        out.abort()
        raise
    return h.size


@reading_once
def pull(src, dest, model: str | None = None, checkpoint: str | None = None, full: bool = False) -> dict:
    """Copy the state of warehouse `src` (restricted to `model`/`checkpoint`) into the new warehouse
    `dest`; returns {"entries", "files", "bytes"}."""
    src, dest = open_storage(src, must_exist=True), open_storage(dest)
    if store.read_state(dest)[0]:
        raise UserError(f"{dest}: already a warehouse; pull into a new directory")
    manifest = query.refresh_companions(src)
    stale, extra = merge.stale_groups(manifest)
    if stale or extra:
        raise UserError(f"{src}: merged tables are out of date; run `python cli.py validate --fix` on it first")
    entries = [e for e in manifest["entries"].values()
               if (model is None or e["model"] == model) and (checkpoint is None or e["checkpoint"] == checkpoint)]
    if not entries:
        raise UserError(f"{src}: nothing matches model={model!r} checkpoint={checkpoint!r}")
    copied, nbytes = [], 0
    for e in entries:
        drop = () if full else VIEW_ONLY_DROPS.get(e["kind"], ())
        files = {t: f for t, f in e["files"].items() if t not in drop}
        for rel in files.values():
            nbytes += _copy(src, dest, rel, (e.get("checksums") or {}).get(rel))
        compacted = e.get("compacted") or (not full and e["kind"] in VIEW_ONLY_DROPS)
        copied.append({**e, "files": files, **({"compacted": True} if compacted else {})})
    if store.publish(dest, 0, store.read_manifest(dest), copied) is None:
        raise UserError(f"{dest}: another process wrote a warehouse there meanwhile")
    query.refresh_companions(dest)
    return {"entries": len(copied), "files": sum(len(e["files"]) for e in copied), "bytes": nbytes}
