"""The served model's weights by Hugging Face name: the weight access a plugin's engine routes use.

A declared public module of the local engine (see :mod:`miles.engine`). A route reaches the model through
:attr:`miles.engine.state.EngineState.model` and reads or writes its parameters only on the scheduler thread
(:meth:`~miles.engine.state.EngineState.on_scheduler`), between forward passes; after writing them in place
it calls :meth:`~miles.engine.state.EngineState.weights_written`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["parameter_aliases", "served_parameters", "weights_checksum"]


def parameter_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for state-dict names that share storage with an earlier parameter (tied)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = canonical.get(id(tensor))
        if owner is not None and owner != name:
            aliases[name] = owner
    return aliases


def served_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter the engine serves by HF name, tied aliases included (an alias maps to its owner's
    parameter object; canonical names come first)."""
    params = dict(model.named_parameters())
    for alias, owner in parameter_aliases(model).items():
        params[alias] = params[owner]
    return params


def weights_checksum(model: torch.nn.Module) -> dict[str, Any]:
    """What ``/weights_checksum`` returns (besides the weight version): an XXH3-128 checksum per parameter
    (:func:`~miles.transport.verify.tensor_checksum`), the tied ``aliases`` and the served ``dtype``."""
    from miles.transport.verify import tensor_checksum

    checksums = {name: tensor_checksum(p) for name, p in model.named_parameters()}
    dtype = next(model.parameters()).dtype
    return {"checksums": checksums, "aliases": parameter_aliases(model), "dtype": str(dtype).removeprefix("torch.")}
