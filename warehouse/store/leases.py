"""Leases of writers in flight: before a process writes the first file of a run id it creates
`_inflight/<run_id>.json` (host, pid, heartbeat, refreshed every HEARTBEAT_S by a thread), and removes
it once a commit record lists those files (or at exit).  `validate --fix` never quarantines a file of
a run id whose lease is live (`lease_alive`).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time

from common import faults

from ..storage import Storage
from .paths import INFLIGHT_DIR, lease_rel

HEARTBEAT_S = 60.0  # a lease's heartbeat is refreshed this often while it is held
HOST = socket.gethostname()  # this machine, as leases and commit records name it
_LEASES: dict[tuple[str, str], tuple[Storage, float]] = {}  # (warehouse, run_id) → (storage, started)
_LEASE_LOCK = threading.Lock()
_HEARTBEAT: list[threading.Thread] = []


def _lease_bytes(run_id: str, started: float) -> bytes:
    return json.dumps({"run_id": run_id, "host": HOST, "pid": os.getpid(), "started": started,
                       "heartbeat": time.time()}).encode()


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped is a zombie: dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def lease_alive(info: dict, grace_s: float, now: float | None = None) -> bool:
    """A lease protects its run's files while its writer may still commit them: on this host, while
    its pid is alive; from another host, while its heartbeat is younger than the grace period (at
    least 3 heartbeats)."""
    try:
        if info.get("host") == HOST:
            return _pid_alive(int(info["pid"]))
        age = (now if now is not None else time.time()) - float(info["heartbeat"])
        return age < max(grace_s, 3 * HEARTBEAT_S)
    except (KeyError, TypeError, ValueError):
        return False


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
