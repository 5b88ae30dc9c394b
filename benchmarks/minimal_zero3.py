"""A floor for the overhead benchmark: the least Python a per-module ZeRO-3 step can run (issue 56, item 2).

``benchmarks/overhead.py`` measures this beside local, FSDP2 and ours, as the contender ``minimal``. It is
a measuring instrument, not a runtime anyone should train with: per module one flat parameter laid
out as ours (the module's own parameters concatenated in ``named_parameters`` order, padded to a
multiple of W, rank r holding chunk r), unsharded by one all-gather into a buffer whose storage is
allocated before and freed after each use, the module's parameters views of that buffer, one hook per
transition and nothing else: no prefetch, no mixed precision, no checks of any kind, no gradient
accumulation across backwards without a step, no state dicts. Its figures say how close to zero a
Python runtime built on module and tensor hooks can come on this machine, so that ours' and FSDP2's
overheads can be read against what no such runtime can avoid (the hooks, the collectives, the
gradient of the split).

[Note: Minimal step]
  forward pre-hook  allocate the buffer's storage, all-gather the shard into it (through a second
                    tensor on the same storage, whose version counter autograd does not watch),
                    split it into the parameters' views, put them on the module
  forward hook      free the storage; a hook on each output tensor that requires grad
  output's hook     (the module's backward is next) allocate and all-gather again: the forward's views
                    and the graph's saved tensors see the same storage
  the buffer's      reduce-scatter its gradient (averaged in the collective) into the shard's
  post-accumulate   ``.grad``, drop the unsharded gradient, free the storage
  grad hook
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard._base.torch_compat import all_gather_work, reduce_scatter_work  # the runtime's own calls

__all__ = ["MinimalShard", "apply_minimal"]


class MinimalShard:
    """One module's flat shard and its four hooks ([Note: Minimal step]). ``shard`` is the
    ``nn.Parameter`` an optimizer steps."""

    def __init__(self, module: nn.Module, group: Any, owned: List[Tuple[nn.Module, str]]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slots = [(m, name, tuple(getattr(m, name).shape)) for m, name in owned]
        params = [getattr(m, name) for m, name in owned]
        numels = [p.numel() for p in params]
        total = sum(numels)
        padded = -(-total // self.world) * self.world
        self.splits = numels + ([padded - total] if padded > total else [])
        flat = torch.zeros(padded)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=flat[:total])
        chunk = padded // self.world
        self.shard = nn.Parameter(flat[self.rank * chunk: (self.rank + 1) * chunk].clone())
        self.full = torch.empty(padded, requires_grad=True)  # the leaf the views (and their gradients) come from
        self.writer = torch.empty(0).set_(self.full.untyped_storage())  # same storage, own version counter
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        for m, name in owned:
            del m._parameters[name]
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        self.full.register_post_accumulate_grad_hook(self._post_backward)

    def _gather(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)
        all_gather_work(self.writer, self.shard.detach(), self.group).wait()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._gather()
        for (m, name, shape), view in zip(self.slots, self.full.split(self.splits)):
            m._parameters[name] = view.view(shape)  # type: ignore[assignment]  # a view, as FSDP1's flat parameter

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.full.untyped_storage().resize_(0)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._gather()

    def _post_backward(self, full: torch.Tensor) -> None:
        grad = torch.empty_like(self.shard)
        reduce_scatter_work(grad, full.grad, True, self.group).wait()  # type: ignore[arg-type]  # AVG
        self.shard.grad = grad if self.shard.grad is None else self.shard.grad.add_(grad)
        full.grad = None
        self.full.untyped_storage().resize_(0)


def apply_minimal(modules: List[nn.Module], group: Any = None) -> List[nn.Parameter]:
    """Shard each of ``modules`` (innermost first, e.g. the blocks, then the root) on ``group`` (a
    backend with ``ReduceOp.AVG``); each takes the parameters under it that no earlier one took, in
    ``named_parameters`` order. Returns the shards, for the optimizer. Each module outputs one tensor."""
    shards: List[nn.Parameter] = []
    for module in modules:
        seen: set = set()
        owned: List[Tuple[nn.Module, str]] = []
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen:  # earlier modules' parameters are gone from _parameters
                    seen.add(id(p))
                    owned.append((m, name))
        shards.append(MinimalShard(module, group, owned).shard)
    return shards
