"""Dynamic subclassing shared by ``fully_shard`` (``FSDP<Orig>``) and ``replicate``
(``Replicate<Orig>``).

Applying an API swaps ``module.__class__`` for a class created once per original class with
bases ``(Mixin, Orig)``. Nothing is constructed: the original ``__init__`` never runs again and
the instance keeps its ``__dict__``. Constructing the dynamic class directly (as a container
does when it re-creates itself, e.g. ``nn.Sequential.__getitem__`` with a slice) builds an
instance of the *original* class, because a copy has none of the API's state.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch.nn as nn

__all__ = ["make_subclass"]

_ORIG_CLS_ATTR = "_composable_shard_orig_cls"
_CLASS_CACHE: Dict[Tuple[str, type, type], type] = {}


def _new_as_original(cls: type, *args: Any, **kwargs: Any) -> Any:
    orig: type = getattr(cls, _ORIG_CLS_ATTR)
    if cls.__dict__.get(_ORIG_CLS_ATTR) is orig:
        # Exactly the dynamic class: build the original class instead. Python then skips
        # ``cls.__init__`` because the result is not an instance of ``cls``.
        return orig(*args, **kwargs)
    return object.__new__(cls)  # a user's subclass of a dynamic class: construct normally


def make_subclass(module: nn.Module, prefix: str, mixin: type) -> type:
    """Swap ``module.__class__`` for the cached ``<prefix><Orig>`` class with bases
    ``(mixin, Orig)`` and return it. Idempotent per (prefix, mixin)."""
    orig = type(module)
    if orig.__dict__.get(_ORIG_CLS_ATTR) is not None:
        if issubclass(orig, mixin):
            return orig
        # Already subclassed by another API: stack one more level on the current class.
    key = (prefix, mixin, orig)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = type(
            f"{prefix}{orig.__name__}",
            (mixin, orig),
            {_ORIG_CLS_ATTR: orig, "__new__": _new_as_original, "__module__": orig.__module__},
        )
        _CLASS_CACHE[key] = cls
    module.__class__ = cls
    return cls


def _reject_copy(self: nn.Module, api_name: str) -> None:
    raise RuntimeError(
        f"cannot copy or pickle {type(self).__name__}: it is managed by {api_name}, whose state "
        "(process groups, sharded storage, hooks) cannot be duplicated. Save and load its weights "
        "instead: get_model_state_dict(module) / set_model_state_dict(module, sd), or "
        "module.state_dict() / load_state_dict() on a freshly built model."
    )


class _NoCopyMixin:
    """Defines copy behaviour for API-managed modules: ``copy.deepcopy`` and pickling raise a
    ``RuntimeError`` that points to the state-dict APIs."""

    _api_name: str = "a composable API"

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        _reject_copy(self, self._api_name)  # type: ignore[arg-type]  # self is an nn.Module

    def __reduce_ex__(self, protocol: Any) -> Any:
        _reject_copy(self, self._api_name)  # type: ignore[arg-type]  # self is an nn.Module
