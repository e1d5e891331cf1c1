"""Files and the manifest: table files written atomically, and a commit log without locks that says
which of them the views see.  The public face of nine modules, one role each:

- paths.py       where each file lives (tables/, _log/, companions, _inflight/, _quarantine/); run ids
- entries.py     the shape of the manifest, its entries and commit records; entry keys
- tables.py      TableWriter: one table file, visible under its name only once closed
- verified.py    files known to hold their recorded bytes: hashed on write, the verified-files cache
- leases.py      leases of writers in flight, which keep validate --fix off their files
- liveness.py    whether a lease's writer may still commit: process identity and heartbeat
- companions.py  manifest.json, runs.parquet, views.sql's generation line
- log.py         the commit log: records, the state (read_state), publish
- after_record.py  a commit whose record landed but a step after it failed: a warning, not an error

A run writes its Parquet files under `tables/<table>/<partition dirs>/<run_id>.parquet`; they become
visible to queries only when a commit record lists them (`publish`), with each file's checksum
({"size", "blake2b"}, computed while its bytes went out).  Files of runs that never committed are
moved to `_quarantine/` by `validate --fix` (never deleted there), unless their run's lease is live.

Above warehouse.storage (bytes and names), this knows files and the manifest, not what the tables
mean (warehouse.merge folds partials, warehouse.query makes views; neither is imported here).
"""

from .after_record import AfterRecord, after_record_line, collect_after_record
from .companions import (companion_generations, companions_ahead, generation_tag, runs_table, views_generation,
                         write_companions, write_runs_table)
from .entries import Checksum, CommitRecord, Entry, EntryCore, Manifest, check_compatible, entry_key, partial_id
from .leases import hold_lease, lease_state, read_leases, release_leases
from .liveness import GONE, HEARTBEAT_S, HOST, LIVE, STALE, STALE_AFTER, own_identity
from .log import (RESTORE_HINT, SNAPSHOT_EVERY, DerivedAhead, changes_since, check_contiguous, latest_seqs, publish,
                  read_manifest, read_record, read_state, record_bytes, record_digest, record_seqs)
from .paths import (INFLIGHT_DIR, LOG_DIR, MANIFEST, QUARANTINE_DIR, RECORD_NAME, RUNS_FILE, VIEWS_FILE, lease_rel,
                    new_run_id, partition_dir, record_name, run_of)
from .tables import TableWriter, atomic_write_bytes, list_array
from .verified import (VERIFIED_DIR, append_verified, cache_dir, file_key, known_good, note_verified, note_written,
                       read_verified_cache, remember_written, rewrite_verified, verified_cache_file, with_checksums,
                       written_checksum)

__all__ = [
    "AfterRecord", "after_record_line", "collect_after_record", "DerivedAhead",
    "companion_generations", "companions_ahead", "generation_tag", "runs_table", "views_generation",
    "write_companions", "write_runs_table",
    "Checksum", "CommitRecord", "Entry", "EntryCore", "Manifest", "check_compatible", "entry_key", "partial_id",
    "hold_lease", "lease_state", "read_leases", "release_leases",
    "GONE", "HEARTBEAT_S", "HOST", "LIVE", "STALE", "STALE_AFTER", "own_identity",
    "RESTORE_HINT", "SNAPSHOT_EVERY", "changes_since", "check_contiguous", "latest_seqs", "publish",
    "read_manifest", "read_record", "read_state", "record_bytes", "record_digest", "record_seqs",
    "INFLIGHT_DIR", "LOG_DIR", "MANIFEST", "QUARANTINE_DIR", "RECORD_NAME", "RUNS_FILE", "VIEWS_FILE", "lease_rel",
    "new_run_id", "partition_dir", "record_name", "run_of",
    "TableWriter", "atomic_write_bytes", "list_array",
    "VERIFIED_DIR", "append_verified", "cache_dir", "file_key", "known_good", "note_verified", "note_written",
    "read_verified_cache", "remember_written", "rewrite_verified", "verified_cache_file", "with_checksums",
    "written_checksum",
]
