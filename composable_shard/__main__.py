"""Command line, no process group and no memory for the model (it is built on the meta device):

``python -m composable_shard describe MODULE:FACTORY [--world W] [--wrap CLASS,...]`` prints
:func:`composable_shard.describe`'s plan of ``fully_shard`` for ``FACTORY()``;
``python -m composable_shard plan MODULE:FACTORY --world W --budget SIZE --batch SPEC ...``
prints :func:`composable_shard.plan`'s choice per block for one rank's batch of the given shapes
(activations measured on fake tensors, recomputation priced at ``--device-flops``):

    python -m composable_shard describe benchmarks.model:GPT --world 2
    python -m composable_shard describe mypkg.models:make_model --world 8 --wrap DecoderLayer
    python -m composable_shard plan mypkg.models:make_model --world 64 --budget 80GB --param-dtype bf16 \
        --batch input_ids=1x4096:int64 --batch labels=1x4096:int64
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Type

import torch
import torch.nn as nn

from ._planning.describe import describe
from .api import MixedPrecision, ShardingStrategy
from .plan import DEFAULT_BANDWIDTH, DEFAULT_DEVICE_FLOPS, plan
from .wrap import ModuleWrapPolicy

__all__ = ["main"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m composable_shard",
                                     description="Tools of composable_shard that need no process group.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = commands.add_parser(
        "describe", help="plan fully_shard for a model built on the meta device and print the per-rank figures",
        description="Build MODULE:FACTORY() on the meta device and print what fully_shard would do at --world ranks: "
                    "fully sharded modules in DFS order (FQN, parameters, elements per rank, padding, dtype groups, "
                    "strategy), parameter/gradient/AdamW bytes per rank and the collectives of one training step.")
    sub.add_argument("target", metavar="MODULE:FACTORY",
                     help="an importable module and a callable in it returning an nn.Module, e.g. benchmarks.model:GPT")
    sub.add_argument("--world", type=int, default=2, help="ranks to plan for (default: %(default)s)")
    sub.add_argument("--wrap", default=None, metavar="CLASS[,CLASS]",
                     help="class names to fully shard separately (ModuleWrapPolicy); default: the classes of the "
                          "items of the model's nn.ModuleLists; '' for the root only")
    sub.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
                     help="sharding strategy (default: %(default)s)")
    sub.add_argument("--param-dtype", default=None, choices=sorted(_DTYPES),
                     help="plan MixedPrecision(param_dtype=...) (default: none)")
    sub = commands.add_parser(
        "plan", help="choose fully_shard / replicate / checkpoint per block to fit a per-rank budget",
        description="Build MODULE:FACTORY() on the meta device, measure one rank's step on fake tensors of the "
                    "--batch shapes, and print plan()'s choice per block with its predicted peak per rank.")
    sub.add_argument("target", metavar="MODULE:FACTORY",
                     help="an importable module and a callable in it returning an nn.Module")
    sub.add_argument("--world", type=int, required=True, help="ranks to plan for")
    sub.add_argument("--budget", required=True, metavar="SIZE",
                     help="bytes per rank: an integer or with a unit, e.g. 80GB, 75GiB, 512MB")
    sub.add_argument("--batch", action="append", required=True, metavar="[NAME=]DIMS[:DTYPE]",
                     help="one tensor of one rank's batch, e.g. 8x2048:int64 (positional, in order) or "
                          "input_ids=1x4096:int64 (a keyword); repeat for each; dtype default float32")
    sub.add_argument("--param-dtype", default=None, choices=sorted(_DTYPES),
                     help="plan MixedPrecision(param_dtype=...) (default: none)")
    sub.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    sub.add_argument("--block", default=None, metavar="CLASS[,CLASS]",
                     help="class names of the blocks (default: the class repeated in the largest nn.ModuleList)")
    sub.add_argument("--bandwidth", type=float, default=None, help="bytes per second of the cost model")
    sub.add_argument("--device-flops", type=float, default=None,
                     help="FLOP/s pricing recomputation (default: plan's DEFAULT_DEVICE_FLOPS)")
    return parser


def _factory(target: str) -> Callable[[], Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise SystemExit(f"describe: expected MODULE:FACTORY (e.g. benchmarks.model:GPT), got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # MODULE may live in the current directory, as with python -m
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"describe: cannot import {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"describe: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"describe: {target} is not callable")
    return obj  # type: ignore[no-any-return]  # checked callable above


def _wrap_classes(model: nn.Module, wrap: Optional[str]) -> Set[Type[nn.Module]]:
    """The classes named by ``--wrap`` (by ``__name__`` or ``__qualname__``) among the model's
    modules; without ``--wrap``, the classes of every ``nn.ModuleList``'s items."""
    if wrap is None:
        return {type(item) for m in model.modules() if isinstance(m, nn.ModuleList) for item in m}
    names = [n.strip() for n in wrap.split(",") if n.strip()]
    present = {type(m) for m in model.modules()}
    found = {cls for cls in present if cls.__name__ in names or cls.__qualname__ in names}
    missing = [n for n in names if not any(n in (c.__name__, c.__qualname__) for c in found)]
    if missing:
        known = ", ".join(sorted({c.__name__ for c in present}))
        raise SystemExit(f"describe: --wrap {','.join(missing)}: no module of that class in the model; "
                         f"its classes: {known}")
    return found


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_BATCH_DTYPES = {"int64": torch.int64, "long": torch.int64, "int32": torch.int32, "float32": torch.float32,
                 "float": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "bool": torch.bool}


def _size(text: str) -> int:
    """``80GB`` -> 80 * 10**9 bytes (decimal units; ``GiB`` binary)."""
    found = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).upper() if found else ""
    if found is None or unit not in _UNITS:
        raise SystemExit(f"plan: --budget {text!r}: expected bytes, e.g. 80GB, 75GiB or 80000000000")
    return int(float(found.group(1)) * _UNITS[unit])


def _batch(specs: Sequence[str]) -> Any:
    """The meta tensors of ``--batch``: a tuple (positional) or a dict (keywords), not both."""
    positional: List[torch.Tensor] = []
    named: Dict[str, torch.Tensor] = {}
    for spec in specs:
        found = re.fullmatch(r"(?:([A-Za-z_]\w*)=)?(\d+(?:x\d+)*)(?::(\w+))?", spec.strip())
        if found is None or (found.group(3) and found.group(3) not in _BATCH_DTYPES):
            raise SystemExit(f"plan: --batch {spec!r}: expected [NAME=]DIMS[:DTYPE], e.g. input_ids=1x4096:int64 "
                             f"(dtypes: {', '.join(sorted(_BATCH_DTYPES))})")
        name, dims, dtype = found.group(1), found.group(2), found.group(3) or "float32"
        t = torch.empty([int(d) for d in dims.split("x")], dtype=_BATCH_DTYPES[dtype], device="meta")
        if name:
            named[name] = t
        else:
            positional.append(t)
    if positional and named:
        raise SystemExit("plan: --batch: give every tensor a NAME= (keywords) or none (positional), not a mix")
    return named if named else (positional[0] if len(positional) == 1 else tuple(positional))


def _block_classes(model: nn.Module, names: Optional[str]) -> Optional[Set[Type[nn.Module]]]:
    if names is None:
        return None
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    present = {type(m) for m in model.modules()}
    found = {c for c in present if c.__name__ in wanted or c.__qualname__ in wanted}
    missing = [n for n in wanted if not any(n in (c.__name__, c.__qualname__) for c in found)]
    if missing or not found:
        raise SystemExit(f"plan: --block {names}: no module of that class in the model; its classes: "
                         f"{', '.join(sorted({c.__name__ for c in present}))}")
    return found


def _plan_main(args: argparse.Namespace, model: nn.Module) -> int:
    budget, batch = _size(args.budget), _batch(args.batch)
    mp = MixedPrecision(param_dtype=_DTYPES[args.param_dtype]) if args.param_dtype else None
    print(f"{args.target}() on the meta device; plan at world size {args.world}, budget {budget:,} B per rank, "
          f"batch {', '.join(args.batch)}{', param_dtype ' + args.param_dtype if mp else ''}")
    try:
        chosen = plan(model, batch, memory_budget=budget, world_size=args.world, optimizer=args.optimizer,
                      mixed_precision=mp, block_types=_block_classes(model, args.block), profile="fake",
                      bandwidth=args.bandwidth or DEFAULT_BANDWIDTH, device_flops=args.device_flops or DEFAULT_DEVICE_FLOPS)
    except (ValueError, TypeError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(chosen)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m composable_shard``; returns the exit status."""
    args = _parser().parse_args(argv)
    factory = _factory(args.target)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"{args.command}: {args.target}() returned {type(model).__name__}, not an nn.Module")
    if args.command == "plan":
        return _plan_main(args, model)
    classes = _wrap_classes(model, args.wrap)
    policy = ModuleWrapPolicy(classes) if classes else None
    mp = MixedPrecision(param_dtype=_DTYPES[args.param_dtype]) if args.param_dtype else None
    names: List[str] = sorted(c.__name__ for c in classes)
    print(f"{args.target}() on the meta device; fully_shard(model, policy="
          f"{'ModuleWrapPolicy({' + ', '.join(names) + '})' if names else 'None'}, "
          f"strategy={args.strategy}{', mixed_precision=MixedPrecision(param_dtype=' + str(mp.param_dtype) + ')' if mp else ''})")
    print(describe(model, world_size=args.world, policy=policy, strategy=ShardingStrategy[args.strategy],
                   mixed_precision=mp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
