"""`doctor`: what the default pass costs on this machine and model, which code paths it takes, and
whether its sums are right here — one JSON file to attach to a bug report.

Steps: load the model as `extract` does; make a fixed list of batches from a source (the built-in
`stdlib-docs` by default) as `extract` makes them; one warm-up pass of each kind (the compiled step
compiles here); then, alternating so that drift in clocks and caches hits both alike, the bare
forward (the base model, no hooks) and the default pass (hooks, token sums, moments) over the same
batches until the time is up; then one batch of the default pass against a float64 reference on
the CPU (token sums, moments' covariance).  Prints the ratio, tokens per second, peak memory (the
GPU's allocator on CUDA, the process's RSS on a CPU), the paths taken (compiled or eager step,
moments' precision and products, scatter), any slower-path warnings, and versions.

Nothing is written to a warehouse.  On CUDA the timed loops synchronise only at their ends."""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError

from .accumulate.moments import Moments
from .accumulate.sums import TokenSums
from .hooks import capture_layers, layer_kinds
from .models import DTYPES, check_dtype, load, resolve_model, to_compute
from .run.provenance import package_versions
from .run.settings import Settings, SourceResult, check_moments_precision
from .run.stream import base_forward, code_paths, forward_batch, memory_budget, new_accumulator
from .run.windows import batch_limits, batches, windows
from .sources import BUILTIN, ReadStats, indexed_documents, parse_source
from .staging import stage


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_rss() -> int:
    """The process's peak resident set so far, bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def make_batches(loaded, settings: Settings, source: str, n: int) -> list[tuple]:
    """The first `n` batches `extract` would make from `source` (NAME=PATH or a built-in)."""
    src = parse_source(source if "=" in source or source in BUILTIN else f"doctor={source}")
    texts = indexed_documents(src, settings.shard, ReadStats())
    out = []
    for batch in batches(loaded, windows(loaded, texts, settings, SourceResult(src.name), None, True),
                         *batch_limits(loaded, settings), settings.special_tokens, True):
        out.append(stage(batch, settings.device))  # pinned on CUDA, as extract's batches are
        if len(out) >= n:
            break
    if not out or sum(int(b[2].sum()) for b in out) == 0:
        raise UserError(f"--source {source}: no tokens to run")
    return out


def _check(loaded, settings: Settings, batch, layers: int) -> dict:
    """One batch through the default pass and through a float64 eager reference on the CPU: the
    largest relative errors of the token sums and of the moments' covariance."""
    d = loaded.d
    acc = new_accumulator(loaded, settings, memory_budget(settings))
    V = acc.V
    ref = TokenSums(layers, V, d, "cpu", fused=False)
    ref.moments = Moments(layers, d, "cpu", precision="float64", background=False)
    input_ids, mask, counted, _ = batch
    try:
        acc.set_batch(input_ids, counted)
        ref.set_batch(input_ids, counted)

        def both(layer: int, hidden: torch.Tensor) -> None:
            acc.add(layer, hidden)
            ref.add(layer, hidden.detach().cpu())

        forward = base_forward(loaded, settings)
        with torch.inference_mode(), capture_layers(loaded.model, loaded.layout, both):
            forward(input_ids, mask)
        _sync(settings.device)
        sums_err, cov_err = 0.0, 0.0
        for layer in range(layers):
            (ids_a, n_a, S_a), (ids_r, n_r, S_r) = _rows(acc, layer), _rows(ref, layer)
            if not (np.array_equal(ids_a, ids_r) and np.array_equal(n_a, n_r)):
                sums_err = float("inf")  # other token types or counts: wrong, whatever the vectors
            elif len(ids_r):
                sums_err = max(sums_err, float(np.abs(S_a - S_r).max() / max(np.abs(S_r).max(), 1e-300)))
            if acc.moments is not None:
                k = max(float(ref.moments.n[layer]), 1.0)
                mu = ref.moments.s1[layer].numpy() / k
                C64 = ref.moments.s2(layer) / k - np.outer(mu, mu)
                mu_a = acc.moments.s1[layer].cpu().numpy() / k
                C = acc.moments.s2(layer) / k - np.outer(mu_a, mu_a)
                cov_err = max(cov_err, float(np.abs(C - C64).max() / max(np.abs(C64).max(), 1e-300)))
        return {"token_sums_max_rel_error": sums_err,
                "moments_covariance_max_rel_error": cov_err if acc.moments is not None else None}
    finally:
        acc.close()
        ref.close()


def _rows(acc: TokenSums, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, counts, Σû) of one layer, all rows (one batch's worth: small)."""
    parts = list(acc.layer_rows(layer))
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, acc.d))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def doctor(model: str, device: str | None = None, dtype: str | None = None, seconds: float = 30.0,
           source: str = "stdlib-docs", n_batches: int = 8, max_length: int | None = None,
           batch_tokens: int | None = None, trust_remote_code: bool = False, log=None) -> dict:
    """Measure and check the default pass; returns the report (a JSON-able dict).  `log` (a callable
    taking one line) hears what it is doing, phase by phase: the warm-up may compile for a minute."""
    say = log or (lambda line: None)
    if seconds <= 0:
        raise UserError(f"--seconds {seconds}: expected a positive number")
    if n_batches < 1:
        raise UserError(f"--batches {n_batches}: expected at least 1")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"--device {device!r}: expected cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():  # else torch's AssertionError, a traceback
        raise UserError(f"--device {device}: no CUDA device is available")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    check_dtype(DTYPES[dtype], device)
    settings = Settings(device=device, dtype=dtype, max_length=max_length, batch_tokens=batch_tokens,
                        moments_precision=check_moments_precision(None, device, dtype),
                        trust_remote_code=trust_remote_code)
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        loaded = load(resolve_model(model), "main", DTYPES[dtype], device, trust_remote_code)
        to_compute(loaded, DTYPES[dtype], device)
        load_s = time.perf_counter() - t0
        say(f"doctor: {model} loaded on {device} in {load_s:.1f} s; making {n_batches} batches of {source}")
        layers = len(layer_kinds(loaded.model, loaded.layout))
        data = make_batches(loaded, settings, source, n_batches)
        tokens_per_pass = sum(int(b[2].sum()) for b in data)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        bare = base_forward(loaded, settings)
        acc = new_accumulator(loaded, settings, memory_budget(settings))
        result = SourceResult("doctor")

        def bare_pass() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                for input_ids, mask, _, _ in data:
                    bare(input_ids, mask)
            _sync(device)
            return time.perf_counter() - start

        def default_pass() -> float:
            start = time.perf_counter()
            with torch.inference_mode(), capture_layers(loaded.model, loaded.layout, acc.add):
                for batch in data:
                    forward_batch(bare, acc, batch, 0, result)
            if acc.moments is not None:
                acc.moments.finish()
            _sync(device)
            return time.perf_counter() - start

        try:
            say("doctor: warm-up: one bare forward pass, then one default pass (the accumulation step "
                "compiles here: up to a minute)")
            t = time.perf_counter()
            bare_pass()
            warm = {"bare_s": time.perf_counter() - t}
            t = time.perf_counter()
            default_pass()  # the compiled step compiles here
            warm["default_s"] = time.perf_counter() - t
            peak_bare = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
            times = {"bare": [], "default": []}
            say(f"doctor: warm-up {warm['bare_s'] + warm['default_s']:.1f} s; alternating the bare forward and "
                f"the default pass for {seconds:g} s")
            deadline = time.perf_counter() + seconds
            while not times["bare"] or time.perf_counter() < deadline:
                times["bare"].append(bare_pass())
                times["default"].append(default_pass())
            paths = code_paths(acc)
            peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else _peak_rss()
        finally:
            acc.close()
        say("doctor: checking the first batch's sums against float64 on the CPU")
        check = _check(loaded, settings, data[0], layers)
        caught = [f"{x.category.__name__}: {x.message}" for x in w
                  if issubclass(x.category, (RuntimeWarning, UserWarning))]
    bare_s, default_s = sum(times["bare"]), sum(times["default"])
    passes = len(times["bare"])
    report = {
        "model": model, "device": device, "dtype": dtype, "source": source,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or platform.machine(),
        "layers": layers, "hidden_size": loaded.d, "batches": len(data),
        "batch_shapes": sorted({tuple(b[0].shape) for b in data}), "tokens_per_pass": tokens_per_pass,
        "passes": passes, "load_s": round(load_s, 3), "warm_up_s": {k: round(v, 3) for k, v in warm.items()},
        "bare_tok_s": tokens_per_pass * passes / bare_s, "default_tok_s": tokens_per_pass * passes / default_s,
        "ratio": default_s / bare_s,
        "pass_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "peak_memory_bytes": peak, "peak_memory_kind": "cuda max_memory_allocated" if device.startswith("cuda") else "process peak RSS",
        "peak_memory_bare_bytes": peak_bare,
        "paths": paths, "warnings": caught, "check": check,
        "settings": {k: v for k, v in asdict(settings).items() if k in ("device", "dtype", "moments", "moments_precision",
                                                                          "max_length", "batch_tokens")},
        "versions": {**package_versions(), "cuda": torch.version.cuda, "platform": platform.platform(),
                     "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
    }
    return report


def summary(report: dict) -> str:
    """The report in a few lines for the terminal."""
    gib = report["peak_memory_bytes"] / 2 ** 30
    lines = [
        f"doctor: {report['model']} on {report['device']} ({report['device_name']}), {report['dtype']}, "
        f"{report['layers']} layer indices, d {report['hidden_size']}, {report['batches']} batches "
        f"{report['batch_shapes']}, {report['passes']} passes of {report['tokens_per_pass']} tokens",
        f"bare forward {report['bare_tok_s']:,.0f} tok/s, default pass {report['default_tok_s']:,.0f} tok/s: "
        f"ratio {report['ratio']:.3f}; peak memory {gib:.2f} GiB ({report['peak_memory_kind']})",
        "paths: " + ", ".join(f"{k} {v}" for k, v in report["paths"].items()),
        f"check against float64 on the CPU: token sums {report['check']['token_sums_max_rel_error']:.1e}, "
        f"moments' covariance " + (f"{report['check']['moments_covariance_max_rel_error']:.1e}"
                                   if report["check"]["moments_covariance_max_rel_error"] is not None else "off"),
        "versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if k != "platform"),
    ]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def check_out(out: str | Path) -> Path:
    """The report's path, checked before anything is measured (not after a minute of it)."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name (e.g. {out / 'doctor.json'})")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no directory {out.parent}")
    return out


def write_report(report: dict, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return out
