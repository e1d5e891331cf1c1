"""The single table that maps each architecture family to its modules.

Paths are attribute paths on the *head* model that `from_pretrained` returns
(`AutoModelForCausalLM` for decoders, `AutoModelForMaskedLM` for encoders), as transformers 5
names them (it renamed GPT-NeoX's `embed_out` to `lm_head` and converts old checkpoints).
Nothing here dispatches on classes: a family is chosen by `config.model_type`.

Layer numbering (the same for every family):
  layer 0      = what block 1 receives (captured by a pre-hook on block 1),
  layer i      = the output of block i, i = 1 … L,
  layer L + 1  = the output of the final norm, for families that have one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class Family:
    name: str
    head: str  # "causal" or "masked": which Auto class loads the checkpoint
    base: str  # the module that is run (the head's logits are never needed)
    embedding: str
    blocks: str
    final_norm: str | None  # None: the family has no final norm (post-LN encoders)
    unembedding: str | None
    special_tokens: bool  # feed [CLS]/[SEP] (excluded from the statistics)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("gpt_neox", "causal", "gpt_neox", "gpt_neox.embed_in", "gpt_neox.layers",
               "gpt_neox.final_layer_norm", "lm_head", False),
        Family("gpt2", "causal", "transformer", "transformer.wte", "transformer.h",
               "transformer.ln_f", "lm_head", False),
        Family("opt", "causal", "model", "model.decoder.embed_tokens", "model.decoder.layers",
               "model.decoder.final_layer_norm", "lm_head", False),
        Family("llama", "causal", "model", "model.embed_tokens", "model.layers",
               "model.norm", "lm_head", False),
        Family("mistral", "causal", "model", "model.embed_tokens", "model.layers",
               "model.norm", "lm_head", False),
        Family("falcon", "causal", "transformer", "transformer.word_embeddings", "transformer.h",
               "transformer.ln_f", "lm_head", False),
        Family("bert", "masked", "bert", "bert.embeddings.word_embeddings", "bert.encoder.layer",
               None, "cls.predictions.decoder", True),
        Family("roberta", "masked", "roberta", "roberta.embeddings.word_embeddings",
               "roberta.encoder.layer", None, "lm_head.decoder", True),
    ]
}


def family_for(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UserError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def get_module(model: torch.nn.Module, path: str | None) -> torch.nn.Module | None:
    """Follow a dotted attribute path; None when the path (or a module on it) is absent."""
    if path is None:
        return None
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_norm(module: torch.nn.Module) -> bool:
    """LayerNorm and RMSNorm modules, by their own class names (HF defines many)."""
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )
