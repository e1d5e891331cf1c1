"""What a run records beside its numbers: the code (git commit or package version), the packages,
the model's revision, weights, layout and identity, the parameter tables' code, and the manifest
entry of each table set it writes (its settings, identity settings and statistics)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import torch

from warehouse import store

from .. import architectures as architectures_module, params as params_module
from ..declared import IDENTITY_SETTINGS
from ..models import Loaded, ModelRef
from ..sources import Source
from .settings import Settings, SourceResult
from .windows import max_window

REPO = Path(__file__).resolve().parents[2]  # a checkout's root (or site-packages, installed)


def git_hash() -> str:
    if not (REPO / "queries").is_dir():  # an installed wheel (site-packages may lie in another git repository)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return "isotropy-warehouse " + importlib.metadata.version("isotropy-warehouse")
        return "unknown"
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "tokenizers", "pyarrow", "duckdb", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def _params_code() -> str:
    """What the parameter tables' numbers depend on besides the weights: their code and torch."""
    h = hashlib.blake2b(digest_size=8)
    for module in (params_module, architectures_module):
        h.update(Path(module.__file__).read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()


PARAMS_CODE = _params_code()


def run_provenance(ref: ModelRef) -> dict:
    """What every checkpoint of a run shares: the code, the packages, where the model came from."""
    return {"git_hash": git_hash(), "packages": package_versions(), "model_location": ref.location}


def checkpoint_provenance(run: dict, loaded: Loaded, checkpoint: str, identity: str | None, settings: Settings
                          ) -> dict:
    """One checkpoint's provenance: the run's, then the model's revision, weights, identity and layout,
    the parameter tables' code, the special tokens fed (and whether counted) and the window length."""
    return {**run, "model_revision": loaded.revision_hash or checkpoint,
            "weights": loaded.weights_id, "model_identity": identity, "params_code": PARAMS_CODE,
            "layout": loaded.layout.describe(),
            "special_tokens": {"prefix": list(loaded.prefix), "suffix": list(loaded.suffix),
                               "counted": settings.special_tokens},
            "max_length": max_window(loaded, settings)}


def recorded_settings(settings: Settings, source: Source | None) -> dict:
    """The settings a manifest entry records: every field of `settings` but how a job divided its
    share among its ranks, with the shard and the source's filter and split."""
    s = asdict(settings)
    s["shard"] = f"{settings.shard[0]}-of-{settings.shard[1]}" if source else None
    s.pop("read_shard")  # how a job divided its share among its ranks is not a setting of the result
    s["pile_set"] = source.pile_set if source else None
    s["split_by"] = source.split_by if source else None
    s["split_value"] = source.split_value if source else None
    return s


def identity_settings(recorded: dict, window: int | None) -> dict:
    """What a data partial records under `identity`: the value of each setting that changes its
    numbers (IDENTITY_SETTINGS), the window as run (`window`: None when not known yet, then left out)."""
    out = {k: recorded.get(k) for k in IDENTITY_SETTINGS}
    out.pop("max_length", None)
    if window is not None:
        out["max_length"] = window
    return out


def manifest_entry(kind: str, loaded: Loaded, run_id: str, files: dict, settings: Settings, d: int,
                   source: Source | None = None, result: SourceResult | None = None, prov: dict | None = None
                   ) -> dict:
    """The manifest entry of one table set: the parameter tables (`kind` "params") or one source's
    sums ("data"), with the run's settings as recorded (a data entry's identity settings also under
    `identity`), the source's statistics and the provenance."""
    s = recorded_settings(settings, source)
    shard = s["shard"]
    entry = {
        "key": store.entry_key(kind, loaded.ref.name, loaded.checkpoint, source and source.name, shard),
        "kind": kind, "model": loaded.ref.name, "checkpoint": loaded.checkpoint, "step": loaded.step,
        "source": source and source.name, "shard": shard, "run_id": run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": files,
        "stats": ({k: v for k, v in asdict(result).items() if k not in ("files", "source")}
                  if result else {}),
        "settings": s, "provenance": prov or {},
    }
    if kind == "data":
        entry["identity"] = identity_settings(s, max_window(loaded, settings))
    return entry
