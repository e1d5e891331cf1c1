"""The queries and keys of every block's self-attention, captured generically: one function
installed in transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`) for the model's own
attention implementation (sdpa, eager, flash, …) that hands the query (B, H, T, hd) and key
(B, H_kv, T, hd) tensors — after the rotary embedding, as the kernel receives them — to the sums,
then calls the kernel the model would have called.  Installed and removed in a context manager,
like the layer hooks (hooks.py), so the model and the interface are left as they were.

Which modules are whose: `attention_plan` runs one probe forward (a few tokens) with the function
in place and records which module calls it: a model is covered when every block calls it from
exactly one of its modules, once, with queries and keys over the same positions; the module's
block is its layer (0-based).  A family whose attention does not go through the interface (e.g.
BLOOM, Falcon, DeBERTa-v2 in transformers 5) is not covered: the run says so in one line and
writes no attention rows, never wrong ones.  The queries and keys are taken after the rotary
embedding only: the queries before it are a family's own intermediate (fused projections, partial
rotary), which the interface does not see.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .architectures import Layout, get_module, probe_inputs, text_config
from .models import forward_kwargs


@dataclass(frozen=True)
class AttentionPlan:
    """Where a model's attention is: `layers` maps id(attention module) → layer (0-based block),
    `shapes` per layer (H, H_kv, head_dim), `interfaces` the AttentionInterface objects the modules
    read, `implementation` the model's configured kernel name."""
    layers: dict
    shapes: list
    interfaces: tuple
    implementation: str


def _interfaces(model: torch.nn.Module) -> list:
    """The attention-interface objects the model's modules look their kernel up in (usually
    transformers' one global object; a family may declare its own)."""
    from transformers.modeling_utils import AttentionInterface

    found = {}
    for m in model.modules():
        obj = getattr(sys.modules.get(type(m).__module__), "ALL_ATTENTION_FUNCTIONS", None)
        if isinstance(obj, AttentionInterface):
            found[id(obj)] = obj
    return list(found.values())


def _eager_of(module: torch.nn.Module):
    """The eager attention function of a module's family (what `get_interface` falls back to)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


@contextlib.contextmanager
def _installed(interfaces: list, implementation: str, on_call: Callable) -> Iterator[None]:
    """`on_call(module, query, key, attention_mask, kwargs)` runs before every call of the
    attention kernel `implementation` through `interfaces`; the kernel then runs as it would have.
    Every interface is restored on exit."""
    saved = []

    def make(original):
        def attention(module, query, key, value, attention_mask, **kwargs):
            kernel = original if original is not None else _eager_of(module)
            if kernel is None:
                raise RuntimeError(f"no eager attention function for {type(module).__name__}")
            on_call(module, query, key, attention_mask, kwargs)
            return kernel(module, query, key, value, attention_mask, **kwargs)
        return attention

    try:
        for inter in interfaces:
            before = inter[implementation] if implementation in inter else None
            saved.append((inter, before))
            inter[implementation] = make(before)
        yield
    finally:
        for inter, before in reversed(saved):
            if implementation in inter:
                del inter[implementation]  # the entry installed here (a local one)
            if before is not None and (implementation not in inter or inter[implementation] is not before):
                inter[implementation] = before


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def attention_plan(model: torch.nn.Module, layout: Layout, say: Callable[[str], None] | None = None
                   ) -> tuple[AttentionPlan | None, str | None]:
    """(plan, None) for a model whose every block's attention goes through the attention interface,
    else (None, why not); probed once per loaded model (`say(why)` then, where it is not covered)."""
    if model in _PLANS:
        return _PLANS[model]
    _PLANS[model] = result = _probe(model, layout)
    if result[1] is not None and say is not None:
        say(result[1])
    return result


def _probe(model: torch.nn.Module, layout: Layout) -> tuple[AttentionPlan | None, str | None]:
    name = type(model).__name__
    config = text_config(model.config)
    implementation = getattr(config, "_attn_implementation", None) or getattr(model.config, "_attn_implementation",
                                                                              None)
    interfaces = _interfaces(model)
    if implementation is None or not interfaces:
        return None, f"{name} does not use transformers' attention interface"
    blocks = get_module(model, layout.blocks)
    block_of = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    calls: list[tuple[int, tuple, tuple]] = []
    inputs = probe_inputs(model, getattr(config, "vocab_size", 2))
    T = inputs["input_ids"].shape[1]

    def record(module, query, key, attention_mask, kwargs):
        if id(module) in block_of:
            calls.append((id(module), tuple(query.shape), tuple(key.shape)))

    with _installed(interfaces, implementation, record), torch.inference_mode():
        get_module(model, layout.base)(**inputs, **forward_kwargs(layout.head))
    per_block: dict[int, list] = {}
    for mid, qs, ks in calls:
        per_block.setdefault(block_of[mid], []).append((mid, qs, ks))
    missing = [i for i in range(len(blocks)) if i not in per_block]
    if missing:
        return None, (f"the attention of {name}'s blocks does not go through transformers' attention interface"
                      if len(missing) == len(blocks) else
                      f"block {missing[0]} of {name} does not call transformers' attention interface")
    layers, shapes = {}, []
    for i in range(len(blocks)):
        got = per_block[i]
        if len(got) != 1:
            return None, f"block {i} of {name} calls the attention interface {len(got)} times in one forward"
        mid, (_, H, tq, hd), (_, G, tk, hdk) = got[0]
        if tq != T or tk != T or hdk != hd or G < 1 or H % G:
            return None, (f"block {i} of {name} hands its attention queries {got[0][1]} and keys {got[0][2]}, "
                          f"not one position each of the {T} tokens")
        layers[mid] = i
        shapes.append((H, G, hd))
    return AttentionPlan(layers, shapes, tuple(interfaces), implementation), None


@contextlib.contextmanager
def capture_attention(plan: AttentionPlan | None, add: Callable) -> Iterator[None]:
    """`add(layer, module, query, key, attention_mask, kwargs)` for every block's attention during a
    forward (nothing where `plan` is None).  Calls from modules not in the plan (another model)
    pass through untouched."""
    if plan is None:
        yield
        return
    layers = plan.layers

    def on_call(module, query, key, attention_mask, kwargs):
        layer = layers.get(id(module))
        if layer is not None:
            add(layer, module, query, key, attention_mask, kwargs)

    with _installed(list(plan.interfaces), plan.implementation, on_call):
        yield
