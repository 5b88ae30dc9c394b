"""Finding and converting the tensors inside module inputs and outputs, and the local piece
inside a ``DTensor``.

Handles every container torch itself traverses: tuples and lists (namedtuples included),
dicts (``OrderedDict`` subclasses such as Hugging Face's ``ModelOutput`` included, rebuilt as
their own type) and dataclasses. Anything else is left as it is, except that an output holding
tensors in a type this module cannot traverse is an error (:func:`tensors_in`): its tensors
would get no pre-backward hook, and backward would run on freed parameters.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List, Optional, Union

import torch
from torch.distributed.tensor import DTensor

__all__ = ["tensors_in", "convert", "local_piece"]


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s elements on this rank: a ``DTensor``'s local piece (a
    tensor-parallel parameter, its gradient or optimizer state; the wrapper's own storage has no
    address), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensors_in(obj: Any, owner: Union[str, Callable[[], str], None]) -> List[torch.Tensor]:
    """Every tensor inside ``obj``. ``owner`` names the module whose output this is (or makes
    that name, called only when needed), for the error raised when ``obj`` holds tensors in a
    container this function cannot traverse; with ``owner=None`` such containers (a key/value
    cache object among a layer's inputs) are skipped."""
    out: List[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif owner is not None and isinstance(getattr(item, "__dict__", None), dict) and any(
                isinstance(v, torch.Tensor) for v in item.__dict__.values()):
            name = owner() if callable(owner) else owner
            raise TypeError(
                f"{name} returned a {type(item).__qualname__} holding tensors, which fully_shard cannot "
                "traverse to run its backward hooks. Return tensors in a tuple, list, dict, namedtuple or "
                "dataclass instead."
            )
    return out


def convert(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor, containers rebuilt as their own types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(convert(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(convert(x, fn) for x in obj)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: convert(v, fn) for k, v in obj.items()}
        rebuilt = copy.copy(obj)  # OrderedDict subclasses (ModelOutput) keep their type and fields
        for k, v in obj.items():
            rebuilt[k] = convert(v, fn)
        return rebuilt
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: convert(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
