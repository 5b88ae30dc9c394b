"""Policies that pick which submodules a module-level API (``fully_shard``) is applied to,
plus the manual ``enable_wrap``/``wrap`` annotation.

Semantics follow PyTorch FSDP's ``wrap`` module, so that a policy written for torch FSDP
selects the same modules here. Two kinds of policy are accepted wherever a policy is taken:

* a :class:`_Policy` object (:class:`ModuleWrapPolicy`, :class:`CustomPolicy`), which maps the
  whole tree to ``{target module: kwargs}`` in one call;
* a *function policy* ``fn(module, recurse, nonwrapped_numel) -> bool`` (usually one of the
  ``*_auto_wrap_policy`` functions bound with :func:`functools.partial`), which
  :func:`_as_policy` turns into a :class:`_Policy` by the traversal of [Note: Function policy
  traversal].

[Note: Function policy traversal]
  Post-order (children before their parent), as torch's ``_recursive_wrap``:
  1. ``fn(module, recurse=True, nonwrapped_numel=total)`` with ``total`` the numel of the
     module's subtree parameters (each parameter once, ignored ones excluded). ``False`` stops
     here: neither the module nor anything below it becomes a target.
  2. Otherwise visit each child not ignored; the parameters of every target chosen in the
     subtree are *claimed*.
  3. ``fn(module, recurse=False, nonwrapped_numel=remainder)`` with ``remainder`` the numel of
     the subtree parameters not yet claimed. ``True`` makes the module a target, claiming its
     whole subtree.
  A module reachable from two parents is visited once. The root goes through the same steps,
  so it may be a target; the caller applies the API to the root in any case.

Ignored modules, and every module below them, are never targets and their parameters never
count towards any ``nonwrapped_numel``, under every policy.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Set, Tuple, Type, Union

import torch.nn as nn

__all__ = [
    "ModuleWrapPolicy",
    "CustomPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]

_Kwargs = Dict[str, Any]  # keyword arguments of the API applied to a module
_Targets = Dict[nn.Module, _Kwargs]  # {target module: its kwargs}
_FunctionPolicy = Callable[..., bool]  # (module, recurse, nonwrapped_numel) -> bool


def _expand_ignored(ignored_modules: Iterable[nn.Module]) -> Set[nn.Module]:
    """Ignored modules plus everything below them: a subtree is ignored as a whole."""
    return {m for ignored in ignored_modules for m in ignored.modules()}


def _selectable_named_modules(root_module: nn.Module, ignored: Set[nn.Module]) -> Iterator[Tuple[str, nn.Module]]:
    """``root_module.named_modules()`` (each module once) minus the ignored subtrees."""
    expanded = _expand_ignored(ignored)
    return ((fqn, module) for fqn, module in root_module.named_modules() if module not in expanded)


class _Policy(ABC):
    """A policy for applying a module-level API to selected modules of a tree. Users pass one to
    ``fully_shard(..., policy=...)``; they do not call :meth:`_run_policy` themselves."""

    @abstractmethod
    def _run_policy(self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: _Kwargs) -> _Targets:
        """Return ``{target module: kwargs}`` for every module of ``root_module``'s tree the API
        should be applied to. ``kwargs`` is a fresh copy of ``root_kwargs``, possibly with some
        values overridden, so callers may mutate it. Modules in ``ignored_modules`` and below
        them are never keys. The root may be a key; key order carries no meaning."""


class ModuleWrapPolicy(_Policy):
    """Select every module that is an instance of one of ``module_classes`` (subclasses
    included), each with the root's kwargs.

    Args:
        module_classes: classes whose instances become fully sharded modules, typically the
            transformer block class.

    Example::

        >>> policy = ModuleWrapPolicy({TransformerBlock})
        >>> fully_shard(model, policy=policy)  # each block, then the root, gets a handle
    """

    def __init__(self, module_classes: Iterable[Type[nn.Module]]) -> None:
        if isinstance(module_classes, type) or not isinstance(module_classes, Iterable):
            name = getattr(module_classes, "__name__", type(module_classes).__name__)
            raise TypeError(f"ModuleWrapPolicy: module_classes must be an iterable of nn.Module classes, got "
                            f"{name!r}; for one class write ModuleWrapPolicy({{{name}}})")
        self._module_classes: Set[Type[nn.Module]] = set(module_classes)
        for cls in self._module_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"ModuleWrapPolicy: module_classes must contain nn.Module subclasses, got {cls!r}")

    def _run_policy(self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: _Kwargs) -> _Targets:
        classes = tuple(self._module_classes)
        return {module: copy.copy(root_kwargs) for _, module in _selectable_named_modules(root_module, ignored_modules)
                if isinstance(module, classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """Act as the equivalent function policy (as torch's class does), so this object
        also works where only function policies are accepted."""
        return _select_by_class(module, recurse, self._module_classes)

    def __repr__(self) -> str:
        names = sorted(cls.__qualname__ for cls in self._module_classes)
        return f"{type(self).__name__}({{{', '.join(names)}}})"


class CustomPolicy(_Policy):
    """Select modules by a function called once per module (pre-order, ignored subtrees
    skipped).

    ``lambda_fn(module)`` returns:

    * ``False`` (or an empty dict): not a target;
    * ``True``: a target with the root's kwargs;
    * a non-empty dict: a target with the root's kwargs updated by the dict.

    Any other return value raises :class:`ValueError` naming the module.

    Args:
        lambda_fn: the per-module decision described above.

    Example::

        >>> def lambda_fn(module: nn.Module) -> bool | dict[str, Any]:
        ...     if module is model.lm_head:
        ...         return {"strategy": ShardingStrategy.SHARD_GRAD_OP}
        ...     return isinstance(module, TransformerBlock)
        >>> fully_shard(model, policy=CustomPolicy(lambda_fn))
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, Dict[str, Any]]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy: lambda_fn must be callable as lambda_fn(module) -> bool | dict, got "
                            f"{type(lambda_fn).__name__} ({lambda_fn!r})")
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: _Kwargs) -> _Targets:
        targets: _Targets = {}
        for fqn, module in _selectable_named_modules(root_module, ignored_modules):
            result = self._lambda_fn(module)
            # bool is checked exactly: an int such as 1 is a mistake, not a "yes".
            if not isinstance(result, (bool, dict)):
                raise ValueError(f"CustomPolicy: lambda_fn returned {type(result).__name__} ({result!r}) for module "
                                 f"'{fqn}' ({type(module).__name__}); it must return True, False or a dict of kwargs "
                                 "overrides.")
            if result:
                targets[module] = {**root_kwargs, **(result if isinstance(result, dict) else {})}
        return targets


class _FunctionPolicyAdapter(_Policy):
    """Runs a function policy by the traversal of [Note: Function policy traversal]."""

    def __init__(self, fn: _FunctionPolicy) -> None:
        self._fn = fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: Set[nn.Module], root_kwargs: _Kwargs) -> _Targets:
        ignored = _expand_ignored(ignored_modules)
        if root_module in ignored:
            return {}
        ignored_params = {p for module in ignored for p in module.parameters(recurse=False)}
        targets: _Targets = {}
        # module -> parameters claimed by targets in its subtree; doubles as the visited set.
        claimed_by_subtree: Dict[nn.Module, Set[nn.Parameter]] = {}

        def visit(module: nn.Module) -> Set[nn.Parameter]:
            if module in claimed_by_subtree:
                return claimed_by_subtree[module]
            # parameters() yields a parameter shared inside the subtree once.
            params = [p for p in module.parameters() if p not in ignored_params]
            claimed: Set[nn.Parameter] = set()
            claimed_by_subtree[module] = claimed
            if not self._fn(module=module, recurse=True, nonwrapped_numel=sum(p.numel() for p in params)):
                return claimed
            for child in module.children():
                if child not in ignored:
                    claimed |= visit(child)
            remainder = sum(p.numel() for p in params if p not in claimed)
            if self._fn(module=module, recurse=False, nonwrapped_numel=remainder):
                targets[module] = copy.copy(root_kwargs)
                claimed |= set(params)
            return claimed

        visit(root_module)
        return targets

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._fn!r})"


def _as_policy(policy: Union[_Policy, _FunctionPolicy]) -> _Policy:
    """Return ``policy`` itself if it is a :class:`_Policy`, else wrap the function policy
    ``fn(module, recurse, nonwrapped_numel) -> bool`` in one that runs it by [Note: Function
    policy traversal]. Raises :class:`TypeError` for anything else."""
    if isinstance(policy, _Policy):
        return policy
    if callable(policy):
        return _FunctionPolicyAdapter(policy)
    raise TypeError(f"policy must be a _Policy (ModuleWrapPolicy, CustomPolicy) or a function "
                    f"(module, recurse, nonwrapped_numel) -> bool, got {type(policy).__name__}.")


def _select_by_class(module: nn.Module, recurse: bool, module_classes: Iterable[Type[nn.Module]]) -> bool:
    """Function-policy form of class selection: always descend, select instances."""
    return recurse or isinstance(module, tuple(module_classes))


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Function policy selecting every module (the root included) not ignored.

    Example::

        >>> fully_shard(model, policy=always_wrap_policy)  # one handle per module
    """
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Function policy selecting each module for which ``lambda_fn(module)`` is true; the
    traversal always descends.

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to descend, ``False`` when asked whether to select.
        nonwrapped_numel: unused.
        lambda_fn: the selection predicate; bind it with :func:`functools.partial`.

    Example::

        >>> policy = functools.partial(
        ...     lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Embedding))
        >>> fully_shard(model, policy=policy)
    """
    return recurse or bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[Type[nn.Module]]) -> bool:
    """Function policy selecting every instance of ``transformer_layer_cls`` (the function
    form of :class:`ModuleWrapPolicy`); the traversal always descends.

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to descend, ``False`` when asked whether to select.
        nonwrapped_numel: unused.
        transformer_layer_cls: classes to select; bind with :func:`functools.partial`.

    Example::

        >>> policy = functools.partial(
        ...     transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
        >>> fully_shard(model, policy=policy)
    """
    return _select_by_class(module, recurse, transformer_layer_cls)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
                                exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None) -> bool:
    """Function policy selecting a module once its not-yet-claimed parameters reach
    ``min_num_params`` elements.

    A module is descended into only while its subtree holds at least ``min_num_params``
    elements and it is not a force-leaf module; a module not descended into is not selected
    either, so its parameters fall to the nearest selected ancestor.

    Args:
        module: the module being considered.
        recurse: ``True`` when asked whether to descend, ``False`` when asked whether to select.
        nonwrapped_numel: numel of the subtree (``recurse=True``) or of its parameters not
            claimed by a selected descendant (``recurse=False``).
        min_num_params: the threshold, in elements.
        force_leaf_modules: classes never descended into; ``None`` means
            ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES`` (``{nn.MultiheadAttention}``).
        exclude_wrap_modules: classes never selected; ``None`` means
            ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``).

    Example::

        >>> policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10**6)
        >>> fully_shard(model, policy=policy)
    """
    # Defaults are read at call time so that changing them on the function takes effect.
    given, default = ((force_leaf_modules, "FORCE_LEAF_MODULES") if recurse
                      else (exclude_wrap_modules, "EXCLUDE_WRAP_MODULES"))
    classes = getattr(size_based_auto_wrap_policy, default) if given is None else given
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(classes))


# Defaults stored on the function object, where torch users look for them.
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]  # function attribute, torch's public spelling
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]  # function attribute, torch's public spelling

# The active enable_wrap block as (wrapper_cls, wrapper_kwargs), or None outside one.
# Process-global, as torch's.
_active_wrap_context: Optional[Tuple[Callable[..., nn.Module], Dict[str, Any]]] = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Make :func:`wrap` apply ``wrapper_cls`` with ``wrapper_kwargs`` inside this block.

    Lets model code mark submodules at construction time (e.g. to shard large layers as soon
    as they exist) while staying usable without any wrapping. Blocks do not nest: entering one
    while another is active raises :class:`RuntimeError`.

    Args:
        wrapper_cls: called as ``wrapper_cls(module, **kwargs)`` by :func:`wrap`, e.g.
            ``fully_shard`` (which returns the same module).
        **wrapper_kwargs: default kwargs for every :func:`wrap` call in the block.

    Example::

        >>> with enable_wrap(wrapper_cls=fully_shard, mesh=mesh):
        ...     model.layer = wrap(nn.Linear(8, 8))
        >>> fully_shard(model, mesh=mesh)
    """
    global _active_wrap_context
    if _active_wrap_context is not None:
        raise RuntimeError(f"enable_wrap: already inside an enable_wrap block (wrapper_cls="
                           f"{_active_wrap_context[0]!r}); nested blocks are not supported. Exit the outer block "
                           "first, or pass per-module overrides to wrap().")
    _active_wrap_context = (wrapper_cls, dict(wrapper_kwargs))
    try:
        yield
    finally:
        _active_wrap_context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Apply the active :func:`enable_wrap` block's ``wrapper_cls`` to ``module``, or return
    ``module`` unchanged outside any block.

    Args:
        module: the module to mark.
        **wrap_overrides: kwargs that take priority over the block's ``wrapper_kwargs``.

    Returns:
        ``wrapper_cls(module, **{**wrapper_kwargs, **wrap_overrides})`` inside a block,
        otherwise ``module``.

    Example::

        >>> with enable_wrap(wrapper_cls=fully_shard, strategy=ShardingStrategy.FULL_SHARD):
        ...     head = wrap(nn.Linear(8, 2), strategy=ShardingStrategy.SHARD_GRAD_OP)
    """
    if _active_wrap_context is None:
        return module
    wrapper_cls, wrapper_kwargs = _active_wrap_context
    return wrapper_cls(module, **{**wrapper_kwargs, **wrap_overrides})
