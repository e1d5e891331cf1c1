"""The extract command's options, checked and turned into what a run needs.

`prepare(options)` takes every option of `cli.py extract` by its Python name (as extract/declared.py
declares them and the command receives them) and returns the model, the revisions, the sources and
the Settings, raising UserError with one line for anything wrong.  `cli.py extract` and `cli.py sweep` both go through it, so a unit
of a sweep is exactly the extract run it names.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError
from extract.launch import Launch, detect, device_for
from extract.models import DTYPES, ModelRef, resolve_model, select_checkpoints
from extract.sources import Source, parse_shard, parse_source


@dataclass
class Job:
    ref: ModelRef
    revisions: list[str]
    sources: list[Source]
    settings: object  # extract.run.settings.Settings
    launch: Launch


def parse_bytes(text: str, option: str) -> int:
    """'512MB', '2GiB', '1e9' → bytes (KB/MB/GB = 10^3…, KiB/MiB/GiB = 2^10…)."""
    import re

    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units:
        raise UserError(f"{option} {text!r}: expected a size such as 512MB or 20GiB")
    value = int(float(m.group(1)) * units[m.group(2).lower()])
    if value < 1:
        raise UserError(f"{option} {text!r}: must be positive")
    return value


def make_source(spec: str, o: dict) -> Source:
    """One --source NAME=… read with the source options in `o`."""
    return parse_source(spec, o["pile_set"], o["encoding_errors"], o["split"], o["text_column"], o["steps"],
                        o["rows_per_step"], o["seq_length"], o["split_by"])


def check_sources(sources: list[Source], o: dict) -> None:
    if o["unit"] == "sentence" and any(s.pretokenized for s in sources):
        raise UserError("--unit sentence splits text: a pythia: source holds token ids (use --unit document)")
    if len({s.name for s in sources}) != len(sources):
        raise UserError("--source names must be distinct")


def revisions(ref: ModelRef, checkpoint: list[str] | None, checkpoints: str | None) -> list[str]:
    """--checkpoint values, then --checkpoints COUNT|all; 'main' when neither is given."""
    revs = list(checkpoint or [])
    if checkpoints:
        revs += select_checkpoints(ref, checkpoints)
    return revs or ["main"]


def make_settings(o: dict, launch: Launch, cuda_available: bool):
    """The Settings of a run from the extract options `o` (source options aside)."""
    from extract.architectures import parse_module_overrides
    from extract.run.settings import Settings, check_moments_precision

    if o["unit"] not in ("document", "sentence"):
        raise UserError(f"--unit {o['unit']!r}: expected document or sentence")
    if o["vector_dtype"] not in ("float32", "float64", "float16"):
        raise UserError(f"--vector-dtype {o['vector_dtype']!r}: expected float32, float64 or float16")
    device = device_for(launch, o["device"], cuda_available)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UserError(f"--device {device!r}: expected cpu or cuda")
    if device.startswith("cuda") and not cuda_available:
        raise UserError("--device cuda: no CUDA device is available")
    dtype = o["dtype"] or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if o["sample"] < 0:
        raise UserError("--sample must be 0 (none) or a positive count")
    if o["prompt_entropy"] and o["sequences"] is False:
        raise UserError("--prompt-entropy is a per-window measure: it cannot go with --no-sequences")
    if (o["attention_moments"] or o["attention_sinks"]) and o["attention"] is False:
        which = "--attention-moments" if o["attention_moments"] else "--attention-sinks"
        raise UserError(f"{which} are per-head attention sums: they cannot go with --no-attention")
    if o["cross_moments"] and not o["moments"]:
        raise UserError("--cross-moments are moments between layers: they cannot go with --no-moments")
    precision = check_moments_precision(o["moments_precision"], o["accumulator_device"] or device, dtype)
    for name in ("batch_size", "batch_tokens", "max_length", "max_tokens"):
        if o[name] is not None and o[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if o["split_limit"] < 1:
        raise UserError("--split-limit must be at least 1")
    budget = parse_bytes(o["memory_budget"], "--memory-budget") if o["memory_budget"] is not None else None
    return Settings(unit=o["unit"], max_length=o["max_length"], max_tokens=o["max_tokens"],
                    batch_size=o["batch_size"], batch_tokens=o["batch_tokens"], device=device, dtype=dtype,
                    shard=launch.shard, read_shard=launch.reads, vector_dtype=o["vector_dtype"], trust_remote_code=o["trust_remote_code"],
                    params_only=o["params_only"], accumulator_device=o["accumulator_device"],
                    skip_done=o["skip_done"], skip_twins=bool(o.get("skip_twins")), moments=o["moments"], cross_moments=o["cross_moments"],
                    moments_precision=precision, sequences=bool(o["sequences"] or o["prompt_entropy"]),
                    prompt_entropy=o["prompt_entropy"], sample=o["sample"], special_tokens=o["special_tokens"],
                    attention=bool(o["attention"] or o["attention_moments"] or o["attention_sinks"]),
                    attention_moments=o["attention_moments"], attention_sinks=o["attention_sinks"],
                    memory_budget=budget, spill_dir=str(o["spill_dir"]) if o["spill_dir"] else None,
                    modules=parse_module_overrides(o["module"]), split_limit=o["split_limit"],
                    replace=bool(o.get("replace")), fold=bool(o.get("fold", True)))


def prepare(o: dict, launch: Launch | None = None) -> Job:
    """Every check of `cli.py extract`, in its order: settings, sources, model, revisions."""
    import torch

    launch = launch or detect(parse_shard(o["shard"]) if o["shard"] is not None else None)
    settings = make_settings(o, launch, torch.cuda.is_available())
    if not o["source"] and not o["params_only"]:
        raise UserError("give at least one --source NAME=PATH (or --params-only)")
    sources = [make_source(s, o) for s in o["source"] or []]
    check_sources(sources, o)
    ref = resolve_model(o["model"])
    if o.get("name") is not None:  # the model's name in the warehouse (default: the directory's or hub id)
        import dataclasses
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}", o["name"]) or o["name"] == "all":
            raise UserError(f"--name {o['name']!r}: expected 1-128 letters, digits, '.', '_', '-' or '/', "
                            "starting with a letter or digit")
        ref = dataclasses.replace(ref, name=o["name"])
    return Job(ref, revisions(ref, o["checkpoint"], o["checkpoints"]), sources, settings, launch)

