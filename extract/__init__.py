"""Extraction: run a Hugging Face model over text and stream mergeable sums into the warehouse.

From Python (docs/extract.md, "From Python and from a training loop"): `extract_model` (a model in
memory), `probe_isotropy` (the same in a custom training loop), `IsotropyCallback` (a Trainer
callback), `weights_fingerprint`.  Imported on first use, so `import extract.options` stays light.
"""

_EXPORTS = {"extract_model": "api", "probe_isotropy": "api", "weights_fingerprint": "api",
            "IsotropyCallback": "callback"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
