"""Where a model's layers are: found by looking at the model, not by a table of families.

For any `PreTrainedModel` the layout is discovered:

* **base**: `model.base_model` (the module without the LM head: it is what is run, so the
  head's (B, T, V) logits are never computed); for an encoder-decoder (T5, BART, …) the
  **encoder** (`model.get_encoder()`): its layers are measured, numbered like any model's, and
  the decoder never runs (docs/extract.md, "Encoder-decoder models");
* **embedding**: `model.get_input_embeddings()`; **unembedding**: `model.get_output_embeddings()`
  (tied or not; None for a model loaded without a head);
* **blocks**: the `nn.ModuleList` inside the base whose length is the config's
  `num_hidden_layers` and whose children share one class;
* **final norm**: one probe forward over a few tokens with hooks on every module of the base
  records the execution order; the final norm is the LayerNorm/RMSNorm that runs after the
  last block and whose output *is* the base model's `last_hidden_state`.  A model whose last
  hidden state is the last block's own output (post-LN encoders) has none.

`OVERRIDES` is the short table of families where discovery is wrong; each entry has a test.
A user names modules with `--module ROLE=PATH` (roles: embedding, blocks, final_norm,
unembedding; `none` for "there is none"), which wins over both.

Layer numbering (the same for every model):
  layer 0      = what block 1 receives (captured by a pre-hook on block 1),
  layer i      = the output of block i, i = 1 … L,
  layer L + 1  = the output of the final norm, where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.errors import UserError

ROLES = ("embedding", "blocks", "final_norm", "unembedding")

# model_type → {role: path or None}: only where discovery gets a family wrong (each with a test).
# Paths are relative to the head model, like every path here.
OVERRIDES: dict[str, dict[str, str | None]] = {}


@dataclass(frozen=True)
class Layout:
    model_type: str
    head: str  # causal | masked | base: which Auto class loaded the checkpoint
    base: str  # dotted path of the module that is run ("" = the loaded model itself)
    embedding: str
    blocks: str
    final_norm: str | None  # None: the model has none (post-LN encoders)
    unembedding: str | None  # None: the checkpoint has no LM head
    d: int = 0  # width of the hidden states the blocks exchange (may differ from the embedding's)
    how: dict = field(default_factory=dict, compare=False)  # role → discovered | override | user

    def describe(self) -> dict:
        return {"model_type": self.model_type, "head": self.head, "base": self.base,
                **{r: getattr(self, r) for r in ROLES}, "d": self.d, "how": dict(self.how)}


def get_module(model: torch.nn.Module, path: str | None) -> torch.nn.Module | None:
    """Follow a dotted attribute path ('' = the model); None when the path or a module on it is absent."""
    if path is None:
        return None
    obj = model
    for part in path.split(".") if path else []:
        obj = obj[int(part)] if part.isdigit() and isinstance(obj, (torch.nn.ModuleList, torch.nn.Sequential)) \
            else getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.nn.Module) else None


def is_norm(module: torch.nn.Module) -> bool:
    """LayerNorm and RMSNorm modules, by type or by their own class names (HF defines many)."""
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


def _path_of(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    if module is None:
        return None
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def text_config(config):
    """The language model's part of a config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def n_layers_of(config) -> int | None:
    cfg = text_config(config)
    for attr in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _find_blocks(base: torch.nn.Module, n_layers: int | None) -> str | None:
    """The ModuleList of the base whose children (all of one class) are the blocks."""
    candidates = []
    for name, m in base.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1:
            candidates.append((name, len(m)))
    exact = [c for c in candidates if c[1] == n_layers]
    pool = exact or ([] if n_layers else candidates)
    if not pool:
        return None
    return max(pool, key=lambda c: c[1])[0]  # the longest; ties: the first in module order


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a block is called with: the first positional argument, else the
    `hidden_states` keyword, else the first 3-D tensor keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and v.dim() == 3:
            return v
    raise RuntimeError("cannot find the hidden states among the block's inputs")


def block_output(output) -> torch.Tensor:
    """A block's (or the base model's) hidden states: the tensor, or the first item of a tuple or
    ModelOutput."""
    return output if isinstance(output, torch.Tensor) else output[0]


def probe_inputs(model: torch.nn.Module, vocab: int) -> dict:
    device = next(model.parameters()).device
    ids = (torch.arange(5, device=device) * 7 + 3) % max(vocab, 1)
    return {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None]}


def _probe(model: torch.nn.Module, base: torch.nn.Module, blocks: torch.nn.ModuleList,
           vocab: int, forward_kwargs: dict) -> tuple[torch.nn.Module | None, int]:
    """Run one probe forward: (the norm after the last block whose output is the last hidden
    state, or None; the width d of the hidden states the blocks receive)."""
    block_ids = {id(m) for b in blocks for m in b.modules()}
    order: list[torch.nn.Module] = []
    outputs: dict[int, torch.Tensor] = {}
    last_block_end = [-1]
    width = []
    handles = []

    def pre(module, args):
        order.append(module)

    def first(module, args, kwargs):
        width.append(block_input(args, kwargs).shape[-1])

    def post(module, args, output):
        if module is blocks[-1]:
            last_block_end[0] = len(order)
        elif is_norm(module) and isinstance(output, torch.Tensor):
            outputs[id(module)] = output

    try:
        for m in base.modules():
            if m is base or (id(m) in block_ids and m is not blocks[-1]):
                continue
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        handles.append(blocks[0].register_forward_pre_hook(first, with_kwargs=True))
        with torch.inference_mode():
            out = base(**probe_inputs(model, vocab), **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    last = block_output(out)
    after = [m for m in order[last_block_end[0]:] if is_norm(m) and id(m) in outputs]
    if not width:
        raise UserError(f"the probe forward never ran block 1 of {type(model).__name__}; name the blocks "
                        f"with --module blocks=PATH")
    for m in reversed(after):
        if outputs[id(m)].shape == last.shape and torch.equal(outputs[id(m)], last):
            return m, width[0]
    return None, width[0]


def parse_module_overrides(specs: list[str] | None) -> dict[str, str | None]:
    """--module ROLE=PATH (PATH 'none' for no such module)."""
    out: dict[str, str | None] = {}
    for spec in specs or []:
        role, sep, path = spec.partition("=")
        role = role.strip().replace("-", "_")
        if not sep or role not in ROLES or not path.strip():
            raise UserError(f"--module {spec!r}: expected ROLE=PATH with ROLE one of {', '.join(ROLES)}")
        out[role] = None if path.strip().lower() == "none" else path.strip()
    return out


def discover(model: torch.nn.Module, head: str, user: dict[str, str | None] | None = None,
             forward_kwargs: dict | None = None) -> Layout:
    """The layout of a loaded head model (see the module docstring)."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    user = dict(user or {})
    fixed = {**OVERRIDES.get(model_type, {})}
    how = {r: "override" for r in fixed}
    for role, path in user.items():
        fixed[role] = path
        how[role] = "user"
    for role, path in fixed.items():
        if path is not None and get_module(model, path) is None:
            raise UserError(f"--module {role}={path}: {type(model).__name__} has no module at {path!r}")

    base_mod = getattr(model, "base_model", model)
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        base_mod = model.get_encoder()  # the encoder stack: the decoder is never run
    base = _path_of(model, base_mod) or ""
    vocab = getattr(text_config(config), "vocab_size", 2)

    def found(role: str, value):
        if role in fixed:
            return fixed[role]
        how[role] = "discovered"
        return value

    emb = found("embedding", _path_of(model, model.get_input_embeddings()))
    unemb = found("unembedding", _path_of(model, model.get_output_embeddings()) if head != "base" else None)
    n_layers = n_layers_of(config)
    rel = _find_blocks(base_mod, n_layers)
    blocks = found("blocks", None if rel is None else ".".join(p for p in (base, rel) if p))
    missing = [r for r, v in (("embedding", emb), ("blocks", blocks)) if v is None]
    if missing:
        hint = f" (config.num_hidden_layers = {n_layers})" if "blocks" in missing else ""
        raise UserError(
            f"cannot find the {' and the '.join(missing)} of {type(model).__name__} ({model_type}){hint}; "
            f"name them with --module ROLE=PATH, e.g. --module blocks=model.layers"
        )
    block_list = get_module(model, blocks)
    if not isinstance(block_list, (torch.nn.ModuleList, torch.nn.Sequential)) or len(block_list) == 0:
        raise UserError(f"--module blocks={blocks}: not a non-empty ModuleList")
    if get_module(model, emb) is None or not hasattr(get_module(model, emb), "weight"):
        raise UserError(f"embedding {emb!r} of {type(model).__name__} has no weight matrix")
    norm, d = _probe(model, base_mod, block_list, vocab, forward_kwargs or {})
    final = found("final_norm", _path_of(model, norm))
    return Layout(model_type, head, base, emb, blocks, final, unemb, d, how)
