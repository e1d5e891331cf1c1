"""Extraction from Python: a model already in memory (a notebook, a training loop) into the warehouse.

`extract_model(model, tokenizer, sources, warehouse, name=…)` is `cli.py extract` without the load:
the same windows, batches, sums, parameter tables and one atomic commit (extract/run's `extract`
with a `loader` that hands it the model), and it returns the committed manifest entries.  The model
runs where it is (its device and dtype, never cast or moved) in eval mode under inference mode, the
global RNG states are restored afterwards, and every module's train/eval flag is put back: the model
is left as it was (requires_grad, .grad, weights and the user's own hooks untouched; ours are removed).

Its identity in the provenance (`model_revision`, `weights`, `model_identity`) is the tensor
fingerprint of its weights, `weights_fingerprint`: every state_dict tensor's name, dtype, shape and
bytes (a tied tensor once), as extract/fingerprint.py hashes a checkpoint's files.

`probe_isotropy(model, tokenizer, source, warehouse, name=…, step=…)` is the same pass for a
training loop: checkpoint `step{step}`, at most `max_tokens` of the source, and it returns a few
headline numbers read back from the warehouse's views (`HEADLINES`).  extract/callback.py wraps it
as a `transformers.TrainerCallback`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from common.errors import UserError
from warehouse import store
from warehouse.storage import open_storage

from .architectures import discover, text_config
from .declared import RUN_NAMES, defaults as declared_defaults
from .fingerprint import state_dict_fingerprint
from .launch import Launch
from .models import DTYPES, Loaded, ModelRef, forward_kwargs, head_of, parse_step, special_template
from .sources import NAME_RE, parse_shard

# The extract command's options by their Python names, with their declared defaults (the model, its
# checkpoints, the sources, the warehouse and the name are arguments of their own here).  `device`
# and `dtype` may only repeat the model's own.
SETTING_DEFAULTS = {name: value for name, value in declared_defaults().items() if name not in RUN_NAMES}

# Headline numbers of a probe: (key, view, column, filter) — the last layer's, and I(W) of both matrices.
HEADLINES = ("inter_sim_last", "avg_intra_sim_last", "i_w_embedding", "i_w_unembedding")


def _quiet(message: str) -> None:
    pass


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


# ---------------------------------------------------------------- the model


def unwrap(model) -> torch.nn.Module:
    """The Hugging Face model inside DistributedDataParallel (`.module`) or torch.compile (`._orig_mod`)."""
    for _ in range(4):
        wrapped = isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
        inner = model.module if wrapped else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config") or \
            not hasattr(model, "get_input_embeddings"):
        raise UserError(f"model: expected a Hugging Face model (a PreTrainedModel), not {type(model).__name__}")
    return model


def weights_fingerprint(model: torch.nn.Module) -> str:
    """The tensor fingerprint of the model's weights (`tensors <hex>`, extract/fingerprint.py): every
    state_dict tensor's name, dtype, shape and bytes (a tensor tied to an earlier name once).  The
    same as the fingerprint of a file holding exactly those tensors under those names; a checkpoint
    directory's differs where loading renames keys or drops tensors.  Copies one tensor at a time
    to the host; measured in docs/extract.md."""
    return state_dict_fingerprint(model.state_dict(keep_vars=True))


def _head(model: torch.nn.Module) -> str:
    """causal | masked | seq2seq | base, from the model's class (as `head_of` does from a config)."""
    cls = type(model).__name__
    if model.get_output_embeddings() is None:
        return "base"
    if cls.endswith("ForCausalLM"):
        return "causal"
    if cls.endswith("ForMaskedLM"):
        return "masked"
    return head_of(model.config)


def model_place(model: torch.nn.Module) -> tuple[str, str]:
    """(device, dtype) of the model's input embedding: where its pass runs and in what."""
    w = model.get_input_embeddings().weight
    names = {v: k for k, v in DTYPES.items()}
    if w.dtype not in names:
        raise UserError(f"model: its embedding is {str(w.dtype).removeprefix('torch.')}; expected one of {', '.join(DTYPES)}")
    return str(w.device), names[w.dtype]


def in_memory(model: torch.nn.Module, tokenizer, ref: ModelRef, checkpoint: str, step: int | None,
              modules: dict, identity: str) -> Loaded:
    """A `Loaded` of a model in memory (it must be in eval mode already: `discover` runs a probe)."""
    head = _head(model)
    layout = discover(model, head, modules, forward_kwargs(head))
    text = text_config(model.config)
    context = int(getattr(text, "max_position_embeddings", 0) or getattr(text, "n_positions", 0) or 2048)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise UserError(f"tokenizer has {len(tokenizer)} tokens but the model's embedding has only {rows} rows")
    prefix, suffix = special_template(tokenizer)
    return Loaded(ref=ref, checkpoint=checkpoint, step=step, layout=layout, model=model, tokenizer=tokenizer,
                  missing_keys=frozenset(), revision_hash=identity, context=context, prefix=prefix, suffix=suffix,
                  weights_id=identity)


@contextlib.contextmanager
def as_it_was(model: torch.nn.Module):
    """Eval mode, no autograd and no autocast inside (a caller's mixed-precision context would change
    the numbers); afterwards every module's training flag as it was and the global RNG states (CPU,
    CUDA) restored, so a training run goes on exactly as without the pass."""
    modes = [(m, m.training) for m in model.modules()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = [torch.cuda.current_device()] if cuda else []
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.no_grad())
            for kind in ("cpu", "cuda") if cuda else ("cpu",):
                stack.enter_context(torch.autocast(kind, enabled=False))
            model.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


# ---------------------------------------------------------------- settings and sources


def job_options(settings: dict, model_device: str, model_dtype: str, what: str = "extract_model") -> dict:
    """The extract options of a call: defaults, then `settings`; device and dtype the model's."""
    unknown = sorted(set(settings) - set(SETTING_DEFAULTS))
    if unknown:
        raise UserError(f"{what}: unknown setting {unknown[0]!r} (settings are cli.py extract's options by their "
                        f"Python names: {', '.join(k for k in SETTING_DEFAULTS if k not in ('device', 'dtype'))})")
    o = {**SETTING_DEFAULTS, **settings}
    for key, actual in (("device", model_device), ("dtype", model_dtype)):
        given = o[key]
        if given is not None and str(given) != actual and not (key == "device" and given == "cuda"
                                                                and actual.startswith("cuda")):
            raise UserError(f"{what}: {key}={given!r}, but the model's weights are {actual}: the model runs where "
                            f"it is (move or cast it first)")
        o[key] = actual
    if o["trust_remote_code"]:
        raise UserError(f"{what}: trust_remote_code: the model is already loaded (its code is yours)")
    return o


def make_job_settings(o: dict):
    """Settings from options `o`; shard from `shard` only (never from torchrun's environment: a
    probe on rank 0 reads the whole probe set)."""
    from .options import make_settings

    shard = parse_shard(o["shard"]) if o["shard"] is not None else (1, 1)
    return make_settings(o, Launch(shard, "explicit" if o["shard"] is not None else "single"),
                         torch.cuda.is_available())


def _texts_file(directory: Path, name: str, texts: Iterable[str]) -> Path:
    """(name, texts) as a JSON-lines file, one document per text (newlines kept)."""
    path = directory / f"{name}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise UserError(f"source {name!r}: text {i} is a {type(t).__name__}, not a str")
            f.write(json.dumps({"text": t}) + "\n")
    return path


def _is_pair(s) -> bool:
    """(name, iterable of texts): two items, a name (no '=', not a built-in source) and texts that are
    no str/bytes — so ("a=x", "b=y") and ["a=x", ("b", texts)] are two sources each."""
    from .sources import BUILTIN

    return (isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[0], str) and "=" not in s[0]
            and s[0] not in BUILTIN and not isinstance(s[1], (str, bytes)))


def make_sources(sources, o: dict, directory: Path, what: str = "extract_model") -> list:
    """NAME=PATH strings (as --source) or (name, iterable of texts) pairs → Sources.  An iterable is
    read once, in full, into a JSON-lines file in `directory` (its provenance `source_path`)."""
    from .options import check_sources, make_source

    if isinstance(sources, str) or (isinstance(sources, tuple) and _is_pair(sources)):  # one source
        sources = [sources]
    out = []
    for s in sources or []:
        if isinstance(s, str):
            out.append(make_source(s, o))
        elif _is_pair(s):
            name, texts = s
            try:
                texts = iter(texts)
            except TypeError:
                raise UserError(f"{what}: source {name!r}: expected an iterable of texts, not {type(s[1]).__name__}") from None
            if not NAME_RE.match(name) or name == "all":  # before the texts are read
                raise UserError(f"{what}: source name {name!r}: expected 1-64 letters, digits, '.', '_' or '-' "
                                "(not starting with '.' or '-', and not 'all')")
            out.append(make_source(f"{name}={_texts_file(directory, name, texts)}", o))
        elif (isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[0], str) and "=" not in s[0]
              and isinstance(s[1], (str, bytes))):
            raise UserError(f"{what}: source {s[0]!r}: expected an iterable of texts, not a single "
                            f"{type(s[1]).__name__} (one text: [text])")
        else:
            raise UserError(f"{what}: a source is a NAME=PATH string or a (name, iterable of texts) pair, "
                            f"not {type(s).__name__}")
    check_sources(out, o)
    if not out and not o["params_only"]:
        raise UserError(f"{what}: give at least one source (or params_only=True)")
    return out


def open_warehouse(warehouse, what: str):
    """The warehouse's storage, checked now (not at the first write, minutes or N steps later): a local
    path that is a file, or a manifest that cannot be read, is one line."""
    if "://" not in str(warehouse) and Path(warehouse).exists() and not Path(warehouse).is_dir():
        raise UserError(f"{what}: warehouse {warehouse}: not a directory")
    root = open_storage(warehouse)
    store.read_manifest(root)
    return root


def _check_name(value, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or value != value.strip() or "\n" in value:
        raise UserError(f"{what} {value!r}: expected a non-empty name")
    return value


# ---------------------------------------------------------------- the calls


def committed(root, name: str, checkpoint: str, results) -> list[dict]:
    """The manifest entries this extract committed: its data entries and the parameter tables'."""
    manifest = store.read_manifest(root)
    data = [e for e in manifest["entries"].values()
            if e["kind"] == "data" and e["model"] == name and e["checkpoint"] == checkpoint
            and e["source"] in {r.source for r in results}]
    runs = {e["run_id"] for e in data}
    params = manifest["entries"].get(store.entry_key("params", name, checkpoint))
    return ([params] if params is not None and (params["run_id"] in runs or not data) else []) + \
        sorted(data, key=lambda e: e["key"])


def extract_model(model, tokenizer, sources, warehouse, *, name: str, checkpoint: str = "main",
                  step: int | None = None, log=_stderr, **settings) -> list[dict]:
    """Run `cli.py extract` on a model in memory; returns the committed manifest entries.

    `sources`: NAME=PATH strings as on the command line, or (name, iterable of texts) pairs;
    `settings`: the extract command's options by their Python names (max_tokens=…, unit="sentence",
    cross_moments=True, …).  `step`: default parsed from `checkpoint` (stepN).

    Example: extract_model(model, tok, ["wiki=wiki.txt"], "warehouse", name="my-gpt", max_tokens=50_000)
    """
    from .run import extract

    what = "extract_model"
    _check_name(name, f"{what}: name")
    _check_name(checkpoint, f"{what}: checkpoint")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise UserError(f"{what}: step {step!r}: expected a non-negative integer")
    model = unwrap(model)
    if not callable(tokenizer) or not hasattr(tokenizer, "__len__"):
        raise UserError(f"{what}: tokenizer: expected a Hugging Face tokenizer, not {type(tokenizer).__name__}")
    device, dtype = model_place(model)
    o = job_options(settings, device, dtype, what)
    job = make_job_settings(o)
    root = open_warehouse(warehouse, what)
    log = log or _quiet
    ref = ModelRef(name, f"in-memory {type(model).__name__} {getattr(model.config, '_name_or_path', '') or ''}".strip(),
                   False)
    with tempfile.TemporaryDirectory(prefix="iso-texts-") as tmp:
        srcs = make_sources(sources, o, Path(tmp), what)
        with as_it_was(model):
            identity = weights_fingerprint(model)
            loaded = in_memory(model, tokenizer, ref, checkpoint, parse_step(checkpoint) if step is None else step,
                               job.modules, identity)
            results = extract(ref, [checkpoint], srcs, root, job, log=log, loader=lambda r, c: loaded,
                              compact=bool(o["compact"]))
    return committed(root, name, checkpoint, results)


def headlines(warehouse, name: str, checkpoint: str) -> dict[str, float]:
    """The last layer's Inter-Sim and average Intra-Sim, and I(W) of the embedding and unembedding
    (raw, not centred), of one (model, checkpoint), from the warehouse's views (one query: `sql`, whose
    failures are one line)."""
    from warehouse.query import sql, sql_literal

    where = f"model = {sql_literal(name)} AND checkpoint = {sql_literal(checkpoint)}"
    columns = {
        "inter_sim_last": f"SELECT inter_sim FROM inter_sim WHERE {where} ORDER BY layer DESC LIMIT 1",
        "avg_intra_sim_last": f"SELECT avg_intra_sim FROM avg_intra_sim WHERE {where} ORDER BY layer DESC LIMIT 1",
        "i_w_embedding": f"SELECT i_w FROM isotropy WHERE {where} AND matrix = 'embedding' AND NOT centered LIMIT 1",
        "i_w_unembedding": f"SELECT i_w FROM isotropy WHERE {where} AND matrix = 'unembedding' AND NOT centered LIMIT 1",
    }
    row = sql("SELECT " + ", ".join(f"({q}) AS {k}" for k, q in columns.items()), warehouse).row(0, named=True)
    return {k: float(v) for k, v in row.items() if v is not None}


def probe_isotropy(model, tokenizer, source, warehouse, *, name: str, step: int, max_tokens: int | None = None,
                   checkpoint: str | None = None, log=_quiet, **settings) -> dict[str, float]:
    """The default extract pass on a live model over a probe set (`source`: NAME=PATH or (name,
    texts), at most `max_tokens`), committed as checkpoint `step{step}` with that step; returns
    the headline numbers (`headlines`).  For custom training loops and Lightning; the model is left
    as it was (train mode, RNG states, grads).

    Example: probe_isotropy(model, tok, "probe=probe.txt", "warehouse", name="my-run", step=step, max_tokens=20_000)
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"probe_isotropy: step {step!r}: expected a non-negative integer")
    checkpoint = checkpoint or f"step{step}"
    extract_model(model, tokenizer, [source], warehouse, name=name, checkpoint=checkpoint, step=step, log=log,
                  max_tokens=max_tokens, **settings)
    return headlines(warehouse, name, checkpoint)
