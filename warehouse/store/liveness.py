"""Whether the writer a lease names may still commit: the identity of a process and the heartbeat rule.

A lease records its writer's pid with the process's start time (field 22 of /proc/<pid>/stat, in
clock ticks since boot), the kernel's boot id and the inode of its pid namespace, beside a heartbeat
refreshed every `interval` seconds.  `judge` says what a lease is worth to a reader:

* **gone** (proven): the reader shares the writer's boot and pid namespace and sees, through its own
  /proc, that the pid has no process, a zombie, or a process that started at another time (the pid
  was reused) — so nothing of that writer can ever commit.
* **live**: the same test finds the writer itself; or, where it cannot be made (another host, another
  boot, another pid namespace: a second container, an Apptainer job), while the heartbeat is younger
  than STALE_AFTER intervals.
* **stale**: a heartbeat older than that, whatever process has that pid now.  Not a proof (a writer
  stopped for minutes may still wake up), so its files wait out validate's grace period.

A lease without the identity fields (written before they existed): live while its heartbeat is fresh
and, on this host, its pid exists; stale otherwise (never proven gone: its pid namespace is unknown).
Hosts that share a warehouse must agree on the time to well within an interval.
"""

from __future__ import annotations

import os
import socket
import time

HEARTBEAT_S = 60.0  # a lease's heartbeat is refreshed this often while it is held
STALE_AFTER = 3  # heartbeat intervals after which a lease that cannot be proven live is stale
HOST = socket.gethostname()  # this machine, as leases and commit records name it
LIVE, STALE, GONE = "live", "stale", "gone"
_IDENTITY: dict[int, dict] = {}  # pid → this process's identity (computed once per process, fork included)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid) -> list[str] | None:
    """Fields 3… of /proc/<pid>/stat (state, ppid, …; field 22, the start time, is [19]); None when
    there is no such process.  The command name (field 2) may hold spaces and parentheses: split after
    its last ')'."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def boot_id() -> str | None:
    """The kernel's boot id (a new one at every boot; shared by the containers of one kernel)."""
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace (unique among a boot's namespaces)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def own_identity() -> dict:
    """This process as a lease records it: pid, pid_start, boot_id, pid_ns (the last three only where
    /proc gives them)."""
    pid = os.getpid()
    if pid not in _IDENTITY:
        fields = _stat_fields("self")
        ident = {"pid": pid, "pid_start": int(fields[19]) if fields and len(fields) > 19 else None,
                 "boot_id": boot_id(), "pid_ns": pid_namespace()}
        _IDENTITY[pid] = {k: v for k, v in ident.items() if v is not None}
    return dict(_IDENTITY[pid])


def _proc_is_ours() -> bool:
    """Whether /proc shows this process's own pid namespace (a process moved into a new namespace
    without a /proc mounted for it sees another namespace's pids there)."""
    text = _read_text("/proc/self/stat")
    return bool(text) and text.split(" ", 1)[0] == str(os.getpid())


def _provable(info: dict) -> bool:
    """Whether this reader can prove the writer alive or dead: same boot, same pid namespace, a /proc of its own."""
    if not all(k in info for k in ("pid_start", "boot_id", "pid_ns")):
        return False
    me = own_identity()
    return (me.get("boot_id") is not None and info["boot_id"] == me["boot_id"] and me.get("pid_ns") is not None
            and info["pid_ns"] == me["pid_ns"] and _proc_is_ours())


def _pid_exists(pid: int) -> bool:
    """Whether a process (not a zombie) has this pid in the reader's namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    return fields is None or fields[0] not in ("Z", "X")  # no /proc entry readable: assume it exists


def judge(info: dict, now: float | None = None) -> tuple[str, str]:
    """(LIVE | STALE | GONE, why) for the lease contents `info` (see the module's docstring)."""
    try:
        pid = int(info["pid"])
        age = (time.time() if now is None else now) - float(info["heartbeat"])
        interval = float(info.get("interval") or HEARTBEAT_S)
    except (KeyError, TypeError, ValueError):
        return STALE, "a lease without pid or heartbeat"
    if _provable(info):
        fields = _stat_fields(pid)
        if not _pid_exists(pid) or fields is None:
            return GONE, f"pid {pid} has exited"
        if len(fields) > 19 and fields[19] != str(info["pid_start"]):
            return GONE, f"pid {pid} is another process now"
        return LIVE, f"pid {pid} is running"
    fresh = age < STALE_AFTER * interval
    if "pid_start" not in info and info.get("host") == HOST and not _pid_exists(pid):
        return STALE, f"pid {pid} is not running on this host (a lease without process identity)"
    if fresh:
        return LIVE, f"heartbeat {age:.0f} s old"
    return STALE, f"heartbeat {age:.0f} s old (stale after {STALE_AFTER * interval:.0f} s)"
