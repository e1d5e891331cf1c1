"""Where each file of a warehouse lives, by its path relative to the root:

    tables/<table>/<key>=<value>/…/<run_id>.parquet   table files (partition_dir), one per run
    _log/<seq, 20 digits>.json                        the commit log, one immutable record per commit
    manifest.json, runs.parquet, views.sql            companions, rewritten from the log
    _inflight/<run_id>.json                           leases of writers in flight
    _quarantine/<stamp>/<rel path>                    what validate --fix moved away

and the run ids files are written under.
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
from urllib.parse import quote

from .. import schema

MANIFEST = "manifest.json"  # a copy of the current state (companion); the commit log is authoritative
LOG_DIR = "_log"
RUNS_FILE = "runs.parquet"
VIEWS_FILE = "views.sql"
INFLIGHT_DIR = "_inflight"  # leases of writers in flight: <run_id>.json
QUARANTINE_DIR = "_quarantine"  # what validate --fix moved away: <stamp>/<original rel path>
RECORD_NAME = re.compile(r"\d{20}\.json")  # a commit record's file name in LOG_DIR
_RUN_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{8}")


def new_run_id() -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(4)}"


def run_of(rel: str) -> str | None:
    """The run id a table file (or its temporary) was written under, from its name."""
    m = _RUN_ID.search(rel.rsplit("/", 1)[-1])
    return m.group(0) if m else None


def partition_dir(table: str, values: dict[str, str]) -> str:
    """Relative directory of one partition; values are percent-encoded (no '/' or '..' escape)."""
    keys = (schema.DATA_PARTITIONS if table in schema.DATA_TABLES else
            schema.MERGED_PARTITIONS if table in schema.MERGED_TABLES else schema.PARAM_PARTITIONS)
    parts = [f"{k}={quote(str(values[k]), safe='')}" for k in keys]
    return "/".join(["tables", table, *parts])


def record_name(seq: int) -> str:
    """The file name of commit record `seq` in LOG_DIR."""
    return f"{seq:020d}.json"


def lease_rel(run_id: str) -> str:
    return f"{INFLIGHT_DIR}/{run_id}.json"
