"""Forward hooks on the model's own modules, in a context manager that always removes them."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .architectures import Layout, block_input, block_output, get_module


def layer_kinds(model: torch.nn.Module, layout: Layout) -> list[str]:
    """The kind of every layer index: embedding, block × L, and final_norm when there is one."""
    blocks = get_module(model, layout.blocks)
    kinds = ["embedding"] + ["block"] * len(blocks)
    if get_module(model, layout.final_norm) is not None:
        kinds.append("final_norm")
    return kinds


@contextlib.contextmanager
def capture_layers(
    model: torch.nn.Module, layout: Layout, callback: Callable[[int, torch.Tensor], None]
) -> Iterator[int]:
    """Call `callback(layer, hidden)` with hidden (B, T, d) for every layer during a forward.

    layer 0 is block 1's input (pre-hook), layer i block i's output, layer L + 1 the final norm's
    output.  Yields the number of layer indices.
    """
    blocks = get_module(model, layout.blocks)
    final = get_module(model, layout.final_norm)
    handles = []

    def pre_hook(module, args, kwargs):
        callback(0, block_input(args, kwargs))

    def post_hook(index):
        return lambda module, args, output: callback(index, block_output(output))

    try:
        handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for i, block in enumerate(blocks, 1):
            handles.append(block.register_forward_hook(post_hook(i)))
        if final is not None:
            handles.append(final.register_forward_hook(post_hook(len(blocks) + 1)))
        yield len(blocks) + 1 + (final is not None)
    finally:
        for h in handles:
            h.remove()
