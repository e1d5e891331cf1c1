"""Files no manifest entry lists, and whether anyone may still commit them: what `validate` reports
and `validate --fix` moves to `_quarantine/` (never deletes).

A file under tables/ that the current state does not list is

* **in flight** when its run's lease is live (store.lease_state): left alone;
* **proven orphaned** — moved by --fix at once, reported in one summary line — when its run's writer
  is proven gone (same boot and pid namespace: its pid exited or is another process now), when it
  is the temporary (`.….tmp`) of a run without a lease (a writer renames its temporaries only while
  it holds its lease, and releases it after its commit or discard), or when a commit record listed
  it and a later one dropped it (a replaced file whose delete was cut short: the record proves it
  garbage);
* otherwise (no lease, a stale lease, a lease that cannot be read as proof): kept while younger
  than the grace period, moved by --fix once older.

The listing of files is taken before the leases and the state are read, so a writer that committed
meanwhile is seen as committed, and one still in flight is seen by its lease; a file that vanished
before its move (a writer renamed its temporary) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import store


@dataclass
class Orphans:
    """The files not listed, by verdict."""
    in_flight: dict[str, list[str]] = field(default_factory=dict)  # run → its files (live lease)
    in_flight_why: dict[str, str] = field(default_factory=dict)  # run → why its lease is live
    proven: list[tuple[str, str]] = field(default_factory=list)  # (rel, why it is garbage)
    young: list[str] = field(default_factory=list)  # not proven, younger than the grace period
    old: list[str] = field(default_factory=list)  # not proven, older than the grace period
    leases_gone: list[str] = field(default_factory=list)  # lease files of writers proven gone
    leases_old: list[str] = field(default_factory=list)  # lease files of stale writers, older than the grace
    unreadable: list[str] = field(default_factory=list)  # runs whose lease cannot be read


def once_listed(records: list[dict]) -> set[str]:
    """Every file some commit record listed (its changes or its snapshot)."""
    out = set()
    for rec in records:
        for e in [*rec.get("put", ()), *(rec.get("manifest") or {}).get("entries", {}).values()]:
            out.update(e.get("files", {}).values())
    return out


def classify(infos: list, lease_infos: list, leases: dict, listed: set[str], dropped: set[str],
             grace_s: float, now: float) -> Orphans:
    """The verdict on every file of `infos` ((rel, size, mtime) of tables/ and the log's temporaries)
    that `listed` does not hold, and on every lease file of `lease_infos`.  `leases`: run → lease
    contents (None: unreadable); `dropped`: files a record listed and the state no longer does."""
    out = Orphans()
    state = {}
    for run, info in leases.items():
        if info is None:
            out.unreadable.append(run)
            state[run] = (store.LIVE, "unreadable lease")  # protects its files until someone looks
        else:
            state[run] = store.lease_state(info, now)
    for rel, _, mtime in infos:
        if rel in listed:
            continue
        run = store.run_of(rel)
        verdict, why = state.get(run, (None, ""))
        name = rel.rsplit("/", 1)[-1]
        if verdict == store.LIVE:
            out.in_flight.setdefault(run, []).append(rel)
            out.in_flight_why[run] = why
        elif verdict == store.GONE:
            out.proven.append((rel, f"run {run}: {why}"))
        elif rel in dropped:
            out.proven.append((rel, "replaced by a later commit"))
        elif verdict is None and run is not None and rel.startswith("tables/") and name.endswith(".tmp"):
            out.proven.append((rel, f"run {run}: a temporary file and no lease"))
        elif now - mtime < grace_s:
            out.young.append(rel)
        else:
            out.old.append(rel)
    for rel, _, mtime in lease_infos:  # the leases themselves: bookkeeping, quarantined likewise
        run = rel.rsplit("/", 1)[-1].split(".json")[0].lstrip(".")
        verdict = state.get(run, (None, ""))[0]
        if verdict == store.LIVE:
            continue
        if verdict == store.GONE:
            out.leases_gone.append(rel)
        elif now - mtime >= grace_s:
            out.leases_old.append(rel)
    return out


def proven_line(proven: list[tuple[str, str]]) -> str:
    """One line for every proven orphan: how many, of how many writers, why, and an example."""
    whys = list(dict.fromkeys(why for _, why in proven))
    shown = "; ".join(whys[:3]) + (f"; and {len(whys) - 3} more" if len(whys) > 3 else "")
    return (f"{len(proven)} file(s) not listed in the manifest, of writers that can no longer commit them "
            f"({shown}), e.g. {proven[0][0]}")
