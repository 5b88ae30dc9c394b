"""Command line: ``python -m composable_shard describe MODULE:FACTORY [--world W] [--wrap CLASS,...]``.

Builds ``FACTORY()`` from ``MODULE`` on the meta device (no memory, no weights initialized, no
process group) and prints :func:`composable_shard.describe`'s plan of ``fully_shard`` for it:

    python -m composable_shard describe benchmarks.model:GPT --world 2
    python -m composable_shard describe mypkg.models:make_model --world 8 --wrap DecoderLayer
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, List, Optional, Sequence, Set, Type

import torch
import torch.nn as nn

from ._describe import describe
from .api import MixedPrecision, ShardingStrategy
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m composable_shard``; returns the exit status."""
    args = _parser().parse_args(argv)
    factory = _factory(args.target)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"describe: {args.target}() returned {type(model).__name__}, not an nn.Module")
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
