"""The composable registry: ``@contract`` attaches per-module state to modules in place.

A composable API (``fully_shard``, ``replicate``, ``checkpoint``) is a plain function
decorated with ``@contract(state_cls)``. The decorator

* creates one ``state_cls()`` instance per call and attaches it to the module, or to the
  root modules of a list of modules (one shared state for the whole list);
* records the API's name in a per-module registry, so an API applied twice raises and
  other APIs can ask what manages a module;
* checks after the function has run that parameter, buffer and submodule FQNs (names and
  order) are unchanged, raising ``RuntimeError`` with the differing names otherwise.

State and registry live in the module's ``__dict__`` under private keys, never as
attributes that ``nn.Module.__setattr__`` would register, so ``named_modules()``,
``state_dict()`` and ``repr`` do not see them.

This file knows nothing about sharding.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, Type, TypeVar

import torch.nn as nn
from typing_extensions import ParamSpec

__all__ = ["contract", "_State", "_get_registry", "_get_module_state", "_register_api"]

_STATE_KEY = "__composable_shard_state__"
_REGISTRY_KEY = "__composable_shard_registry__"


class _State:
    """Base class of every per-module API state attached by :func:`contract`."""


_P = ParamSpec("_P")
_S = TypeVar("_S", bound=_State)


def _get_registry(module: nn.Module) -> Optional["OrderedDict[str, _RegistryItem]"]:
    """Return the ordered ``{api_name: item}`` registry of ``module``, or ``None`` if no
    composable API has been applied to it."""
    return module.__dict__.get(_REGISTRY_KEY)


def _get_module_state(module: nn.Module, state_cls: Optional[Type[_S]] = None) -> Optional[Any]:
    """Return the first state attached to ``module`` that is an instance of ``state_cls``
    (any state if ``None``). APIs look up their own state by name via ``fn.state``."""
    states: Dict[str, _State] = module.__dict__.get(_STATE_KEY, {})
    for state in states.values():
        if state_cls is None or isinstance(state, state_cls):
            return state
    return None


def _get_api_state(module: nn.Module, api_name: str) -> Optional[Any]:
    """The state ``api_name`` attached to ``module`` (None: none), for code that may not import
    the API's module (``describe`` reads ``replicate``'s state below it in the import layers)."""
    states: Dict[str, _State] = module.__dict__.get(_STATE_KEY, {})
    return states.get(api_name)


def _register_api(module: nn.Module, api_name: str, state: Optional[_State] = None) -> None:
    """Record ``api_name`` in ``module``'s registry and attach ``state`` if given (one per API).

    Used by APIs that manage more modules than the one they were called on (a wrap policy
    makes every selected module a fully sharded module of its own).
    """
    if state is not None:
        states: Dict[str, _State] = module.__dict__.setdefault(_STATE_KEY, {})
        if api_name in states:
            raise RuntimeError(f"{type(module).__name__} already has {api_name}'s state attached; "
                               "each composable API may be applied to a module once.")
        states[api_name] = state
    module.__dict__.setdefault(_REGISTRY_KEY, OrderedDict())[api_name] = _RegistryItem(api_name)


def _unregister_api(module: nn.Module, api_name: str) -> None:
    """Undo :func:`_register_api` (used when applying an API fails)."""
    for key in (_STATE_KEY, _REGISTRY_KEY):
        entries = module.__dict__.get(key)
        if entries is not None:
            entries.pop(api_name, None)
            if not entries:
                module.__dict__.pop(key, None)


class _RegistryItem:
    """Marker stored in the registry; one per API applied to a module."""

    def __init__(self, api_name: str) -> None:
        self.api_name: str = api_name

    def __repr__(self) -> str:
        return f"_RegistryItem({self.api_name!r})"


def _root_modules(modules: Sequence[nn.Module]) -> List[nn.Module]:
    """Modules of ``modules`` that are not inside another module of the list (first
    occurrence order)."""
    members = {id(m) for m in modules}
    nested = {id(sub) for m in modules for sub in m.modules() if sub is not m and id(sub) in members}
    return list({id(m): m for m in modules if id(m) not in nested}.values())


def _fqn_snapshot(modules: Sequence[nn.Module]) -> Dict[str, List[List[str]]]:
    return {
        "parameters": [[n for n, _ in m.named_parameters(remove_duplicate=False)] for m in modules],
        "buffers": [[n for n, _ in m.named_buffers(remove_duplicate=False)] for m in modules],
        "submodules": [[n for n, _ in m.named_modules(remove_duplicate=False)] for m in modules],
    }


def _check_fqns_unchanged(api_name: str, before: Dict[str, List[List[str]]], after: Dict[str, List[List[str]]]) -> None:
    problems: List[str] = []
    for kind in ("parameters", "buffers", "submodules"):
        for old, new in zip(before[kind], after[kind]):
            if old == new:
                continue
            missing = [n for n in old if n not in new]
            added = [n for n in new if n not in old]
            if missing or added:
                problems.append(f"{kind}: removed {missing}, added {added}")
            else:
                problems.append(f"{kind}: order changed from {old} to {new}")
    if problems:
        raise RuntimeError(
            f"{api_name} changed the fully qualified names of the module it was applied to; "
            "composable APIs must keep FQNs unchanged. " + "; ".join(problems)
        )


class _ContractFn(Generic[_P, _S]):
    """Callable returned by :func:`contract`: the API function plus ``.state(module)``."""

    __name__: str  # the API's name, set with the rest of ``fn``'s metadata by ``functools.update_wrapper``

    def __init__(self, fn: Callable[..., Any], state_cls: Type[_S]) -> None:
        self._fn = fn
        self._state_cls = state_cls
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]  # instance, not function

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        api_name = self.__name__
        if isinstance(module, nn.Module):
            modules: List[nn.Module] = [module]
        elif isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
            modules = list(module)
        else:
            raise TypeError(
                f"{api_name} expects an nn.Module or a non-empty list of nn.Modules, got {type(module).__name__}"
            )
        roots = _root_modules(modules)
        for m in roots:
            registry = _get_registry(m)
            if registry is not None and api_name in registry:
                raise RuntimeError(
                    f"{api_name} has already been applied to {type(m).__name__} (registry: "
                    f"{list(registry)}); each composable API may be applied to a module only once."
                )
        state = self._state_cls()
        before = _fqn_snapshot(roots)
        for m in roots:
            _register_api(m, api_name, state)
        try:
            result = self._fn(module, *args, **kwargs)
            _check_fqns_unchanged(api_name, before, _fqn_snapshot(roots))
        except BaseException:
            for m in roots:
                _unregister_api(m, api_name)
            raise
        return module if result is None else result

    def state(self, module: nn.Module) -> Optional[_S]:
        """Return the state this API attached to ``module``, or ``None``."""
        states: Dict[str, _State] = module.__dict__.get(_STATE_KEY, {})
        return states.get(self.__name__)  # type: ignore[return-value]  # this API stored a _S


def contract(state_cls: Type[_S] = _State) -> Callable[[Callable[..., Any]], _ContractFn[Any, _S]]:  # type: ignore[assignment]  # default is the base class
    """Decorate a composable API ``fn(module_or_modules, *args, **kwargs)``.

    Example::

        class _MyState(_State):
            def __init__(self) -> None:
                self.calls = 0

        @contract(state_cls=_MyState)
        def my_api(module: nn.Module) -> nn.Module:
            my_api.state(module).calls += 1
            return module

        my_api(model)          # attaches one _MyState
        my_api.state(model)    # -> that state
        my_api(model)          # RuntimeError: already applied

    Args:
        state_cls: the ``_State`` subclass instantiated once per call.
    """
    if not (isinstance(state_cls, type) and issubclass(state_cls, _State)):
        raise TypeError(f"contract(state_cls=...) needs a subclass of _State, got {state_cls!r}")

    def decorate(fn: Callable[..., Any]) -> _ContractFn[Any, _S]:
        return _ContractFn(fn, state_cls)

    return decorate
