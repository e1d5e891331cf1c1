"""What a data partial covers, and which committed partials a new one replaces or conflicts with."""

from __future__ import annotations

import math

from common.errors import UserError

from ..store import Entry, Manifest
from .identity import clash_line, identities_differ, identity, settings_clash


# ---------------------------------------------------------------- what a partial covers

# A data partial covers the documents of its source (the file with the fingerprint it records) whose
# index in the source is ≡ I − 1 (mod N) for its shard I of N (extract/sources.py: indexed_documents,
# split_documents), up to --max-tokens; the model's weights are named by `model_identity`.  Two shards
# I/N and J/M of one source: J/M ⊆ I/N iff N divides M and J ≡ I (mod N); they share documents iff
# I ≡ J (mod gcd(N, M)) (Chinese remainder theorem), whatever the number of documents.


def shard_of(entry: Entry) -> tuple[int, int]:
    i, _, n = (entry.get("shard") or "1-of-1").partition("-of-")
    return int(i), int(n)


def covers(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether shard a = (I, N) holds every document of shard b = (J, M)."""
    (i, n), (j, m) = a, b
    return m % n == 0 and (j - 1) % n == i - 1


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether shards a and b share a document."""
    (i, n), (j, m) = a, b
    return (i - j) % math.gcd(n, m) == 0


def replacements(manifest: Manifest, entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """(committed entries the new `entries` replace, [(committed entry, why)] they conflict with).

    Replaced: a data partial of the same (model, checkpoint, source) whose documents the new one
    covers, from the same source file.  Conflicts: such a partial that shares documents with the new
    one without being covered (a re-shard: 1/1 then 1/2 — keeping both would count half the
    documents twice); one of another version of the source file (another fingerprint) that the new
    one does not cover (two file versions would be merged into one source); one made with another
    value of a setting that changes the numbers (identity.settings_clash: they would be folded into
    one source); any entry of the same (model, checkpoint) made from other weights (another
    `model_identity` of the same kind: identity.identities_differ)."""
    keys = {e["key"] for e in entries}
    replaced: dict[str, dict] = {}
    conflicts: dict[str, tuple[dict, str | tuple]] = {}  # why: shard | file | weights | (settings, …)
    for new in entries:
        ident = identity(new)
        for old in manifest["entries"].values():
            if old["kind"] not in ("data", "params") or (old["model"], old["checkpoint"]) != (new["model"], new["checkpoint"]):
                continue
            if identities_differ(ident, identity(old)) and old["key"] not in conflicts:
                conflicts[old["key"]] = (old, "weights")
                continue
            if new["kind"] != "data" or old["kind"] != "data" or old["source"] != new["source"] or old["key"] in keys:
                continue
            a, b = shard_of(new), shard_of(old)
            fp_new = new.get("provenance", {}).get("source_fingerprint")
            fp_old = old.get("provenance", {}).get("source_fingerprint")
            if covers(a, b):
                replaced[old["key"]] = old
            elif overlaps(a, b):
                conflicts.setdefault(old["key"], (old, "shard"))
            elif fp_new and fp_old and fp_new != fp_old:
                conflicts.setdefault(old["key"], (old, "file"))
            elif (clash := settings_clash(new, old)) is not None:
                conflicts.setdefault(old["key"], (old, ("settings", *clash)))
    return [e for k, e in replaced.items() if k not in conflicts], list(conflicts.values())


def conflict_line(conflicts: list[tuple[Entry, str]]) -> str:
    """One line naming the first conflict (and how many more), and the ways out."""
    old, why = conflicts[0]
    what = f"{old['model']}@{old['checkpoint']}"
    shard = "/".join(map(str, shard_of(old)))
    more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
    replace = "pass --replace (a sweep file: replace = true) to drop"
    if isinstance(why, tuple):  # ("settings", setting, this run's value, the committed partial's)
        return clash_line(True, old, why[1:], more, replace)
    if why == "weights":
        where = old.get("provenance", {}).get("model_location") or "another location"
        return (f"the warehouse holds {what} from other weights ({where}, identity {identity(old)}){more}; "
                f"give this model another name with --name, or {replace} what holds the other weights")
    if why == "file":
        return (f"source {old['source']} of {what} holds shard {shard} of another version of its file "
                f"(fingerprint {old.get('provenance', {}).get('source_fingerprint')}){more}; re-extract the whole "
                f"source (--shard 1/1), give it another source name, or {replace} the old shards")
    return (f"source {old['source']} of {what} holds shard {shard}, which shares documents with this shard but "
            f"is not covered by it{more}; re-extract with --shard {shard} (or one that covers it), or {replace} "
            "it (then extract the other shards of the new sharding)")


def check_conflicts(manifest: Manifest, entries: list[Entry]) -> None:
    """Before any forward pass: the conflicts `commit` would refuse (without --replace)."""
    _, conflicts = replacements(manifest, entries)
    if conflicts:
        raise UserError(conflict_line(conflicts))


def check_disjoint(entries: list[Entry]) -> None:
    """One commit's own data partials must not share documents: two overlapping shards of one source
    of one (model, checkpoint) would count those documents twice (the CLI never makes such a commit;
    the library API could)."""
    data = [e for e in entries if e["kind"] == "data"]
    for i, a in enumerate(data):
        for b in data[i + 1:]:
            if ((a["model"], a["checkpoint"], a["source"]) == (b["model"], b["checkpoint"], b["source"])
                    and overlaps(shard_of(a), shard_of(b))):
                x, y = "/".join(map(str, shard_of(a))), "/".join(map(str, shard_of(b)))
                raise UserError(f"one commit holds shards {x} and {y} of source {a['source']} of "
                                f"{a['model']}@{a['checkpoint']}: shard {y} shares documents with shard {x}; "
                                "commit one of them")
