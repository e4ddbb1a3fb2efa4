"""Forward hooks on the target decoder layers, as a context manager that always removes them.

A hook sees the layer's output (a bare tensor in transformers 5; a tuple in older code, hence the unwrap) before
anything later touches it; no decoder layer in the verified architectures changes the residual stream in place,
so the stored tensor stays valid for the whole forward (checked in transformers 5). Hooks give the pre-norm output
of the last layer too, which `output_hidden_states` cannot (its hidden_states[N] is after the final norm).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hsx.target.model import decoder_layers


@contextmanager
def capture(base: torch.nn.Module, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Yields a dict that each forward fills with {layer index: (batch, seq, hidden) output}."""
    store: dict[int, torch.Tensor] = {}
    modules = decoder_layers(base)
    handles = [modules[i].register_forward_hook(_storer(store, i)) for i in layers]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()
        store.clear()


def _storer(store: dict[int, torch.Tensor], index: int):
    def hook(module, args, output):
        store[index] = output[0] if isinstance(output, tuple) else output

    return hook
