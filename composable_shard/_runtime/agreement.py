"""Ranks that disagree raise on every rank instead of hanging, aborting or computing garbage;
and the end-of-backward agreement of ``fully_shard`` and ``replicate`` on the parameters used on
some rank and the optimizer steps taken (:func:`agree_used_and_steps`).

Collectives are matched across ranks by the order they are issued in, not by what they carry.
Ranks that all-gather different handles (data-dependent control flow), or where one rank skips a
reduction (``set_requires_gradient_sync(False)`` on one rank, a backward that raised on one
rank), issue unmatched collectives: gloo aborts the process when the sizes differ and returns
wrong data when they agree, and the next collective hangs.

[Note: Agreement]  Before a collective that must match, every rank tells the others, in one
small synchronous all-gather of integers (:func:`composable_shard._runtime.collectives.exchange`), what it
is about to do: ``(kind, handle index, group index, flag)``. Every rank sees the same table,
so on a difference every rank raises the same error naming the modules and the ranks.
  * first iteration, always, in every data-parallel group of the module (see [Note: Agreement on
    a 2-D mesh] for hybrid sharding): before every all-gather of parameters (forward and
    backward) and before every gradient reduction (with the gradient-sync flag: a module whose output enters
    the loss on some ranks only leaves its reduction out there, and would otherwise wait for the
    process group's timeout), and the layout of every handle once at lazy init (a digest; the
    full description only on a mismatch);
  * later iterations: each rank compares its forward order with the recorded one locally and
    warns once on a change (no communication); on gloo a gather or reduction carries its
    handle's index in its point-to-point tag, so ranks that diverged wait instead of exchanging
    shards of different handles (see [Note: Collectives on gloo]);
  * debug mode (``COMPOSABLE_SHARD_DEBUG=1``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): every
    iteration, before every all-gather and before every reduction (with the gradient-sync flag),
    and when recovering from a backward that raised.
What is not agreed on can still leave a collective unmatched; its wait then fails after the
process group's timeout with a message naming the pending handle and collective
(:meth:`composable_shard._runtime.collectives.Pending.wait`).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import collectives as _collectives
from . import watch as _watch
from .._base.host_mirror import HostMirror, to_device

if TYPE_CHECKING:
    from .module_state import _FSDPState
    from .flat_param import FlatParamHandle

__all__ = ["debug_mode", "agree_before_gather", "agree_before_reduction", "agree_on_failed_backward",
           "check_layout_across_ranks", "taking_part", "agree_used_and_steps"]

GATHER, REDUCE, FAILED_BACKWARD = 1, 2, 3


def debug_mode() -> bool:
    """The opt-in per-iteration checks (read at lazy init)."""
    flag = os.environ.get("COMPOSABLE_SHARD_DEBUG", "")
    return flag not in ("", "0") or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def agree_before_gather(root: "_FSDPState", state: "_FSDPState", handle: "FlatParamHandle") -> None:
    """Raise on every rank of ``state``'s data-parallel groups unless all are about to gather ``handle``."""
    _agree(root, _dp_groups(state), [GATHER, handle.index, 0, 0])


def agree_before_reduction(root: "_FSDPState", state: "_FSDPState", handle: "FlatParamHandle", group_index: int,
                           sync: bool) -> None:
    """Raise unless every rank is about to reduce (or, all of them, keep) the same gradient."""
    _agree(root, _dp_groups(state), [REDUCE, handle.index, group_index, int(sync)])


def agree_on_failed_backward(root: "_FSDPState") -> None:
    """A rank recovering from a backward that raised meets the others' next agreement: equal if
    they all failed, an error on every rank otherwise."""
    _agree(root, _dp_groups(root), [FAILED_BACKWARD, -1, 0, 0])


def _dp_groups(state: "_FSDPState") -> List[Any]:
    """The shard group, then the replicate group (hybrid sharding), each if it has several ranks."""
    groups = [g for g in (state.process_group, state.replicate_group) if g is not None]
    return [g for g in groups if dist.get_world_size(g) > 1]


def _agree(root: "_FSDPState", groups: List[Any], mine: List[int]) -> None:
    """[Note: Agreement on a 2-D mesh]  Under hybrid sharding a rank is in a shard group and a
    replicate group. Raising as soon as one group disagrees would leave the ranks of the other
    groups waiting for it in their next collective: every rank must learn of a disagreement
    anywhere. Two exchanges do it: in the shard group (the values), then in the replicate group
    (the values and whether the shard group disagreed). Where some shard group disagrees, every
    replicate group holds one of its ranks and hears of it; where none does, each shard group
    holds one value, every replicate group holds one rank of each, and so all of them see the
    same difference or none. A rank that saw the differing values names them; one that only heard
    of them names what it was about to do."""
    if not groups:
        return
    found = _differing(root, groups[0], _collectives.exchange(mine, groups[0], tag="agree"))
    if len(groups) > 1:
        across = _collectives.exchange(mine + [int(found is not None)], groups[1], tag="agree")
        if found is None:
            found = _differing(root, groups[1], [row[:-1] for row in across])
        if found is None and any(row[-1] for row in across):
            found = [f"rank {dist.get_rank()}: {_describe(root, mine)}", "ranks of another group: something else"]
    if found is not None:
        raise RuntimeError(
            "fully_shard: ranks disagree on the next collective, which would hang or mix up data:\n  "
            + "\n  ".join(found)
            + "\nEvery rank must run the same fully sharded modules in the same order, with the same "
            "gradient-sync setting, and raise in backward together (or not at all). A module's gradient is "
            "reduced on every rank only if its output reaches the loss on every rank: where it is used on some "
            "ranks only, add it to the loss multiplied by 0 on the others."
        )


def _differing(root: "_FSDPState", group: Any, everyone: List[List[int]]) -> Optional[List[str]]:
    """One line per rank of ``group`` saying what it is about to do, if they differ."""
    if all(theirs == everyone[0] for theirs in everyone):
        return None
    ranks = [dist.get_global_rank(group, r) for r in range(len(everyone))]
    return [f"rank {rank}: {_describe(root, values)}" for rank, values in zip(ranks, everyone)]


def _describe(root: "_FSDPState", values: List[int]) -> str:
    kind, index, group_index, flag = values
    name = repr(root._all_handles[index].fqn or "<root>") if 0 <= index < len(root._all_handles) else "?"
    if kind == GATHER:
        return f"all-gather of the parameters of {name}"
    if kind == REDUCE:
        how = "reduction" if flag else "keeping it unreduced (gradient sync off)"
        return f"gradient of {name} (flat parameter {group_index}): {how}"
    if kind == FAILED_BACKWARD:
        return "recovering from a backward that raised on this rank"
    return f"unknown {values}"


# ---------------------------------------------------------------------------- layout at lazy init
def check_layout_across_ranks(root: "_FSDPState") -> None:
    """Ranks that built different handles would issue mismatched collectives; compare a digest
    of every handle's names, shapes and dtypes, and on a difference describe the first one."""
    mine = [(h.fqn, [(tuple(g.flat_param._fqns), [tuple(s) for s in g.flat_param._shapes], str(g.flat_param.dtype))
                     for g in h.groups]) for h in root._all_handles]
    digest = hashlib.sha256(repr(mine).encode()).digest()
    words = [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
    for group in {id(g): g for g in (root.process_group, root.replicate_group) if g is not None}.values():
        everyone = _collectives.exchange(words, group, tag="lazy_init_check")
        if all(theirs == words for theirs in everyone):
            continue
        layouts = _collectives.all_gather_json(mine, group, tag="lazy_init_check")
        decoded_mine = layouts[dist.get_rank(group)]  # decoded as the others' are (tuples as lists)
        for other_rank, theirs in enumerate(layouts):
            if theirs != decoded_mine:
                raise RuntimeError(_describe_mismatch(root, decoded_mine, theirs, other_rank))


def _describe_mismatch(root: "_FSDPState", mine: List[Any], theirs: List[Any], other_rank: int) -> str:
    head = f"fully_shard: rank {root.rank} and rank {other_rank} of the process group built different handles; "
    if len(mine) != len(theirs):
        return head + (f"{len(mine)} handles here vs {len(theirs)} there. Apply fully_shard identically "
                       "(same model, same policy) on every rank.")
    for (fqn_a, groups_a), (fqn_b, groups_b) in zip(mine, theirs):
        if fqn_a != fqn_b:
            return head + f"handle {fqn_a!r} here vs {fqn_b!r} there."
        if len(groups_a) != len(groups_b):
            return head + f"in handle {fqn_a or '<root>'!r}: {len(groups_a)} flat parameters here vs {len(groups_b)} there."
        for ga, gb in zip(groups_a, groups_b):
            for name_a, name_b, shape_a, shape_b in zip(ga[0], gb[0], ga[1], gb[1]):
                if name_a != name_b or shape_a != shape_b:
                    return head + (f"in handle {fqn_a or '<root>'!r}: parameter {name_a!r} {list(shape_a)} here vs "
                                   f"{name_b!r} {list(shape_b)} there. Build the same model on every rank.")
            if ga != gb:
                return head + f"in handle {fqn_a or '<root>'!r}: {ga} here vs {gb} there."
    return head + "parameter layouts differ."


# ---------------------------------------------------------------------------- the end-of-backward agreement
def taking_part(groups: Sequence[Optional[dist.ProcessGroup]]) -> List[dist.ProcessGroup]:
    """The groups of ``groups`` with more than one rank (None: skipped)."""
    return [g for g in groups if g is not None and dist.get_world_size(g) > 1]


def agree_used_and_steps(local_used: Sequence[int], steps: Sequence[int],
                         groups: Sequence[Optional[dist.ProcessGroup]], device: torch.device, *,
                         api: str, consequence: str, tag: str) -> Tuple[List[int], Optional[_watch.StepVerdict]]:
    """One int32 all-reduce per group in ``groups`` (None and single-rank groups skipped, in order) of
    ``local_used + steps``, issued without waiting. Returns (the used flags summed over every rank of
    the groups, a :class:`~composable_shard._runtime.watch.StepVerdict` to read later when ``steps`` is non-empty and more than one
    rank took part, else None).

    A parameter this rank used is used on some rank whatever the others say, so when this rank
    used all of them the flags are known at once and nothing is read here; only a step in which
    this rank left a parameter without a gradient waits for the others' flags (a host read)."""
    taking = taking_part(groups)
    values = [int(v) for v in local_used] + [int(s) for s in steps]
    if not taking or not values:
        return values[:len(local_used)], None
    summed = to_device(values, torch.int32, device)
    num_ranks = 1
    pending: Optional[_collectives.Pending] = None
    for group in taking:
        if pending is not None:
            pending.wait()  # orders the next all-reduce after it (a stream wait on an accelerator)
        pending = _collectives.all_reduce(summed, group, tag=tag)
        num_ranks *= dist.get_world_size(group)
    assert pending is not None  # taking is non-empty
    n = len(local_used)
    verdict = _watch.StepVerdict(HostMirror(summed[n:], pending), steps, num_ranks, api, consequence) if steps else None
    if verdict is None:
        pending.wait()  # nothing keeps its buffer for later: order (accelerator) or finish (CPU) it now
    if all(values[:n]):
        return values[:n], verdict
    pending.wait()
    used: List[int] = summed[:n].tolist()  # a parameter unused here: the others' flags decide
    return used, verdict
