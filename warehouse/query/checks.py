"""What connect() checks before it binds the views: every listed local file against its commit
record's checksum (each file version hashed once, then remembered in the verified-files cache),
and which committed partials the views do not count yet (PendingPartials).
"""

from __future__ import annotations

import os

from common.errors import UserError

from .. import merge, store
from ..storage import MissingFile, open_storage, verify
from ..store import Manifest


class PendingPartials(UserWarning):
    """Partials committed without a fold (`extract --no-fold`, a sweep's checkpoint still running): the
    views hold every group's folded partials exactly, and not these until `cli.py merge` folds them."""


def pending_line(manifest: Manifest) -> str | None:
    """One line saying which partials the views do not count yet (None: every partial is folded)."""
    todo = {merge.partial_id(e): e for group in merge.pending(manifest).values() for e in group}
    if not todo:
        return None
    pairs = sorted({f"{e['model']}@{e['checkpoint']}" for e in todo.values()})
    where = ", ".join(pairs[:3]) + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")
    return (f"{len(todo)} committed partial(s) of {where} are not folded into the views yet "
            "(`python cli.py merge` folds them; view runs: folded = false)")


def verify_listed(root, manifest: Manifest) -> int:
    """Verify every local file the views read — each file the manifest lists that has a recorded
    checksum — against its commit record (size and blake2b), but each file version only once: a
    verified file is remembered in the warehouse's own cache (store.verified_cache_file) by absolute
    path, size, mtime_ns, ctime_ns, inode and recorded hash, so a later connect only stat()s it, and after a commit hashes
    only the new files.  A file whose bytes changed is re-hashed; if they differ from the record,
    one UserError line names it and how to repair it (merge.repair_hint).  A cache that cannot be
    read or written means hashing every time: slower, never wrong.  Files of records written before
    checksums existed are skipped.  A warehouse on S3 is not verified here (a listing for sizes and
    times would cost every start-up): `validate` and the store's own integrity checks cover it.
    Returns the number of files hashed."""
    st = open_storage(root)
    if not st.local:
        return 0
    cache, lines = store.read_verified_cache(st)
    hashed, current, new = 0, {}, {}
    for e in manifest["entries"].values():
        sums = e.get("checksums") or {}
        for rel in e["files"].values():
            want = sums.get(rel)
            if not want:
                continue
            path = os.path.abspath(st.path(rel))
            key = store.file_key(path, want)
            if key is None or cache.get(path) != key:
                try:
                    verify(st, rel, want, merge.repair_hint(e))
                except MissingFile:
                    raise UserError(f"{st.display(rel)}: listed in the manifest but missing; "
                                    f"{merge.repair_hint(e)}") from None
                hashed += 1
                if store.file_key(path, want) != key:  # changed while it was hashed: hashed again next time
                    continue
                new[path] = key
            current[path] = key
    if lines > 2 * len(current) + 1000:  # replaced files' lines piled up: keep the listed ones only
        store.rewrite_verified(st, current)
    else:
        store.append_verified(st, new)
    return hashed
