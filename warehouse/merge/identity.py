"""Whether two entries are made of the same things: the weights (model identity) and the settings
that decide the numbers (settings identity).

**Weights.** `provenance.model_identity` names the weights an entry was made from: `tensors <hex>`,
the fingerprint of every tensor's name, dtype, shape and bytes (extract/fingerprint.py), or
`commit <hash>` (a hub model whose files were not in the cache), or — entries of older warehouses —
a sampled `weights <hex>` or `commit blake2b <hex>`.  Identities are compared only within one
kind: two of one kind that differ are other weights; a kind that differs says nothing.  Checkpoints
of one model whose `tensors` fingerprints are equal are *twins* (the `checkpoint_twins` view).

**Settings.** A data entry records under `identity` each setting that changes its numbers and the
value it ran with (the list is extract's: extract/declared.py `IDENTITY_SETTINGS`; the window
length as the run used it).  Partials of one source of one (model, checkpoint) are folded together
only when every setting both record is equal.  An entry written before `identity` was recorded
counts as having its `settings` values (its window: `provenance.max_length`, unknown where only the
default None is recorded), and a setting neither records (added since) is unknown: never a reason
to refuse.
"""

from __future__ import annotations

import json

from common.errors import UserError

from ..store import Entry, Manifest

TENSORS = "tensors "
UNKNOWN = object()


# ---------------------------------------------------------------- weights


def identity(entry: Entry) -> str | None:
    return entry.get("provenance", {}).get("model_identity")


def identities_differ(a: str | None, b: str | None) -> bool:
    """Whether two model identities name other weights: both known, of one kind, and unequal."""
    return bool(a and b and a.split(" ", 1)[0] == b.split(" ", 1)[0] and a != b)


def twin_checkpoints(manifest: Manifest, model: str, checkpoint: str, ident: str | None) -> list[str]:
    """The other checkpoints of `model` in the warehouse whose weights' tensor fingerprint is
    `ident`, by step (then name)."""
    if not ident or not ident.startswith(TENSORS):
        return []
    found = {}
    for e in manifest["entries"].values():
        if (e["kind"] in ("data", "params") and e["model"] == model and e["checkpoint"] != checkpoint
                and identity(e) == ident):
            found[e["checkpoint"]] = e.get("step")
    return sorted(found, key=lambda c: (found[c] is None, found[c] or 0, c))


# ---------------------------------------------------------------- settings


def recorded(entry: Entry, key: str):
    """The value of identity setting `key` a data entry ran with (UNKNOWN: not recorded)."""
    if "identity" in entry:
        return entry["identity"].get(key, UNKNOWN)
    if key == "max_length":  # the window as run; settings hold None for the default (the model's context)
        window = entry.get("provenance", {}).get("max_length", entry.get("settings", {}).get("max_length"))
        return UNKNOWN if window is None else window
    return entry.get("settings", {}).get(key, UNKNOWN)


def settings_clash(a: Entry, b: Entry) -> tuple[str, object, object] | None:
    """(setting, value in a, value in b) of the first identity setting both entries record with
    different values; None when none."""
    keys = sorted(set(a.get("identity") or ()) | set(b.get("identity") or ()))
    for key in keys:
        va, vb = recorded(a, key), recorded(b, key)
        if va is UNKNOWN or vb is UNKNOWN:
            continue
        if json.dumps(va, sort_keys=True) != json.dumps(vb, sort_keys=True):
            return key, va, vb
    return None


def shown(value) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def clash_line(this_run: bool, old: Entry, clash: tuple[str, object, object], more: str = "",
               replace: str | None = None) -> str:
    """One line for partials of one source made with different settings (`clash`: the setting, the
    other partial's value — this run's where `this_run` —, `old`'s value), and the ways out."""
    key, here, there = clash
    shard = (old.get("shard") or "1-of-1").replace("-of-", "/")
    what = f"{old['model']}@{old['checkpoint']}"
    this = "this run has" if this_run else "another partial has"
    out = (f"source {old['source']} of {what} holds shard {shard} made with {key} = {shown(there)}; {this} "
           f"{key} = {shown(here)}{more}: partials of one source made with different settings are never merged. "
           f"Extract with {key} = {shown(there)}, or keep the runs apart under another source name "
           f"(--source OTHER=…) or model name (--name)")
    return out + (f", or {replace} the old shards" if replace else "")


def check_settings(members: list[Entry]) -> None:
    """The partials of one source group must agree on every identity setting any of them records
    (a value not recorded is unknown): else one line naming the setting and two of its values."""
    keys = sorted({k for e in members for k in e.get("identity") or ()})
    for key in keys:
        first: dict[str, Entry] = {}  # each value seen (as JSON) → the first partial with it
        for e in members:
            value = recorded(e, key)
            if value is not UNKNOWN:
                first.setdefault(json.dumps(value, sort_keys=True), e)
        if len(first) > 1:
            a, b = list(first.values())[:2]
            raise UserError(clash_line(False, a, (key, recorded(b, key), recorded(a, key))))
