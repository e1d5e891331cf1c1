"""Leases of writers in flight: before a process writes the first file of a run id it creates
`_inflight/<run_id>.json` (host, pid and the process's identity, heartbeat refreshed every HEARTBEAT_S
by a thread), and removes it once a commit record lists those files (or at exit).  `validate --fix`
never quarantines a file of a run id whose lease is live, and moves at once the files of a writer
proven gone (`lease_state`, by the rule of store/liveness.py).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

from common import faults

from ..storage import Storage
from .liveness import HEARTBEAT_S, HOST, judge, own_identity
from .paths import INFLIGHT_DIR, lease_rel

_LEASES: dict[tuple[str, str], tuple[Storage, float]] = {}  # (warehouse, run_id) → (storage, started)
_LEASE_LOCK = threading.Lock()
_HEARTBEAT: list[threading.Thread] = []


def _lease_bytes(run_id: str, started: float) -> bytes:
    return json.dumps({"run_id": run_id, "host": HOST, **own_identity(), "started": started,
                       "heartbeat": time.time(), "interval": HEARTBEAT_S}).encode()


def hold_lease(st: Storage, run_id: str) -> None:
    """Create (once per process and run id) the lease that keeps validate --fix off this run's files."""
    key = (st.path(""), run_id)
    with _LEASE_LOCK:
        if key in _LEASES:
            return
        faults.hit("lease")
        started = time.time()
        st.replace(lease_rel(run_id), _lease_bytes(run_id, started))
        _LEASES[key] = (st, started)
        if not _HEARTBEAT or not _HEARTBEAT[0].is_alive():
            _HEARTBEAT[:] = [threading.Thread(target=_heartbeat, name="iso-lease-heartbeat", daemon=True)]
            _HEARTBEAT[0].start()


def release_leases(st: Storage, run_ids) -> None:
    """Remove the leases this process holds for `run_ids` (their files are committed or discarded)."""
    for run_id in run_ids:
        with _LEASE_LOCK:
            held = _LEASES.pop((st.path(""), run_id), None)
        if held is not None:
            faults.hit("release")
            try:
                held[0].delete(lease_rel(run_id))
            except Exception:  # left behind: stale once this process is gone
                pass


def _heartbeat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        with _LEASE_LOCK:
            held = list(_LEASES.items())
        for (_, run_id), (st, started) in held:
            try:
                with _LEASE_LOCK:
                    if (st.path(""), run_id) in _LEASES:
                        st.replace(lease_rel(run_id), _lease_bytes(run_id, started))
            except Exception:
                pass


_OWNER = os.getpid()


@atexit.register
def _release_all() -> None:
    if os.getpid() != _OWNER:  # a forked child does not own its parent's leases
        return
    for (url, run_id), (st, _) in list(_LEASES.items()):
        release_leases(st, [run_id])


def lease_state(info: dict, now: float | None = None) -> tuple[str, str]:
    """("live" | "stale" | "gone", why) of a lease's contents: live while its writer may still commit,
    gone when it is proven never to (store/liveness.py)."""
    return judge(info, now)


def read_leases(st: Storage) -> dict[str, dict | None]:
    """run id → lease contents (None: unreadable, e.g. being replaced) of every lease file."""
    out = {}
    for rel in st.list_files(INFLIGHT_DIR):
        name = rel.rsplit("/", 1)[-1]
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            out[name[:-5]] = json.loads(st.read_bytes(rel))
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError):
            out[name[:-5]] = None
    return out
