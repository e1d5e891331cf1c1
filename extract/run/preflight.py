"""What the warehouse already holds and what it would refuse, checked on one read of the manifest
before a checkpoint's forward passes: runs already done with the same data and settings
(--skip-done), parameter tables that can be kept, and the conflicts `merge.commit` would refuse
(an overlapping shard, another version of a source file, other weights under the model's name).

These checks fail early; they are not the last word.  The commit checks conflicts, compatibility and
compaction again on the manifest as it is then, so a writer that commits in between is still
refused exactly as strictly."""

from __future__ import annotations

from dataclasses import asdict

from warehouse import merge, store

from ..declared import RESULT_SETTINGS
from ..models import Loaded, ModelRef
from ..sources import Source
from .provenance import identity_settings, recorded_settings
from .settings import Settings, recorded_setting

PARAMS_SAME = ("weights", "params_code", "layout", "model_location", "model_revision")  # provenance keys


def already_done(manifest: dict, ref: ModelRef, checkpoint: str, source: Source, settings: Settings,
                 source_fingerprint: str, identity: str | None = None) -> bool:
    """Whether the warehouse holds this (checkpoint, source, shard) with the same data and settings.
    A split source is done when any of its values is: a checkpoint's sources commit together."""
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}"
    if source.split_by is None:
        entries = [manifest["entries"].get(store.entry_key("data", ref.name, checkpoint, source.name, shard))]
    else:
        entries = [e for e in manifest["entries"].values()
                   if e["kind"] == "data" and e["model"] == ref.name and e["checkpoint"] == checkpoint
                   and e["shard"] == shard and e["source"].startswith(source.name + ".")
                   and e["settings"].get("split_by") == source.split_by]
    want = {**asdict(settings), "shard": shard, "pile_set": source.pile_set}
    for entry in entries:
        if entry is None or entry["provenance"].get("source_fingerprint") != source_fingerprint:
            continue
        if entry["provenance"].get("model_location") != ref.location:
            continue
        if merge.identities_differ(identity, entry["provenance"].get("model_identity")):
            continue  # the same directory holds other weights now (retrained): not done
        if source.split_values is not None and entry["settings"].get("split_value") not in source.split_values:
            continue
        if all(recorded_setting(entry["settings"], k) == want[k] for k in RESULT_SETTINGS):
            return True
    return False


def sources_to_run(manifest: dict, ref: ModelRef, checkpoint: str, sources: list[Source], settings: Settings,
                   prints: dict[str, str], identity: str | None, reducer=None) -> tuple[list[Source], bool]:
    """--skip-done: the sources of this checkpoint not done yet, and whether the whole checkpoint is
    (no source left and its parameter tables in).  Under a reducing torchrun job every rank takes
    what rank 0 decided."""
    todo = [s for s in sources if not already_done(manifest, ref, checkpoint, s, settings, prints[s.name], identity)]
    skip = not todo and store.entry_key("params", ref.name, checkpoint) in manifest["entries"]
    if reducer is not None:  # every rank runs what rank 0 runs
        names, skip = reducer.agree(([s.name for s in todo], skip))
        todo = [s for s in sources if s.name in names]
    return todo, skip


def params_kept(manifest: dict, loaded: Loaded, prov: dict) -> bool:
    """Whether the warehouse already holds this checkpoint's parameter tables computed from the same
    weights (hub commit, or a local directory's files by name, size and mtime), the same layout and the
    same code: then they are kept, not computed again (each source, shard, rank or sweep unit of a
    checkpoint would otherwise recompute them: 3·V·d² float64 multiply-adds per matrix)."""
    entry = manifest["entries"].get(store.entry_key("params", loaded.ref.name, loaded.checkpoint))
    if entry is None or loaded.weights_id is None:
        return False
    old = entry.get("provenance", {})
    return all(old.get(k) == prov[k] for k in PARAMS_SAME)


def check_coverage(manifest: dict, ref: ModelRef, checkpoint: str, sources: list[Source], settings: Settings,
                   prints: dict[str, str], identity: str | None, window: int | None = None) -> None:
    """Before any forward pass: what `merge.commit` would refuse for these sources' partials (an
    overlapping shard, another version of a source file, other settings that change the numbers,
    other weights under this name), unless --replace.  `window`: tokens per window, once the model is
    loaded (before, a default window is not known and not compared).  A split source's partials are
    named by values not read yet: the committed values of that split stand for them."""
    if settings.replace:
        return
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}"
    prov = {"model_identity": identity}
    probes = [{"key": store.entry_key("params", ref.name, checkpoint), "kind": "params", "model": ref.name,
               "checkpoint": checkpoint, "source": None, "shard": None, "provenance": prov}]
    for source in sources:
        names = [source.name] if source.split_by is None else sorted(
            {e["source"] for e in manifest["entries"].values() if e["kind"] == "data" and e["model"] == ref.name
             and e["checkpoint"] == checkpoint and (e["source"] or "").startswith(source.name + ".")
             and e["settings"].get("split_by") == source.split_by})
        for name in names:
            recorded = recorded_settings(settings, source)
            probes.append({"key": store.entry_key("data", ref.name, checkpoint, name, shard), "kind": "data",
                           "model": ref.name, "checkpoint": checkpoint, "source": name, "shard": shard,
                           "settings": recorded, "identity": identity_settings(recorded, window or settings.max_length),
                           "provenance": {**prov, "source_fingerprint": prints.get(source.name)}})
    merge.check_conflicts(manifest, probes)
