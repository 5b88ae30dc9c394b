"""torchtitan's own Trainer and llama3 recipe on gloo/CPU ranks, with torch's FSDP2 or this
library's ``fully_shard`` in its ``apply_fsdp_to_decoder`` (``tests/distributed/test_torchtitan.py``).

[Note: The CPU harness]
  The recipe is torchtitan 0.3.0's ``--module llama3 --config llama3_debugmodel`` built by its
  own ``ConfigManager`` and run by its own ``Trainer`` (``config.build()``, ``trainer.train()``,
  as ``torchtitan/train.py`` does), with only these changes, all for running on CPU ranks:
  * device shim: torchtitan picks ``device_type``/``device_module`` once, at the import of
    ``torchtitan.tools.utils`` (``torch._utils._get_available_device_type() or "cuda"``), and then
    calls ``set_device``, ``current_device``, ``synchronize`` and the memory-statistics functions of
    that module. While that module is imported the device type reads "cpu" and the module is
    ``_CpuDeviceModule`` (no-ops, no memory statistics); torch is left as it was afterwards.
  * ``torch.distributed.set_timeout`` (called by torchtitan after the first step; torch 2.13
    has no such public function) is an alias of ``distributed_c10d._set_pg_timeout``.
  * attention: each layer's ``inner_attention`` is torchtitan's ``ScaledDotProductAttention``
    instead of ``FlexAttention`` (no backward on CPU without compiling). The trainer then builds
    no attention masks (it does only for Flex/Varlen); both backends run the same model.
  * options through torchtitan's own command line: ``--parallelism.spmd_backend partial_dtensor``
    (the default ``spmd_types`` annotates inputs for its own typed runtime), fp32 parameters
    (``--training.mixed_precision_param float32``; the recipe's default is bf16), a small
    ``seq_len`` and batch, a fixed seed, a generated dataset (``--dataloader.dataset_path``) and
    tokenizer (``--hf_assets_path``), the dump folder, the checkpoint interval and the seed
    checkpoint (``--checkpoint.initial_load_path``). CUDA graphs stay on as in the recipe:
    torchtitan runs eagerly off CUDA, and zeroes gradients in place (``set_to_none=False``).
  * FSDP2 only: ``set_force_sum_reduction_for_comms(True)`` on every torch ``FSDPModule`` after
    the trainer is built: torchtitan sets ``set_gradient_divide_factor(1.0)``, for which FSDP2
    reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, an op gloo does not have; with the
    forced SUM the gradients are the same sums (factor 1.0).
  * ours only: ``torchtitan.distributed.fsdp.fully_shard`` (the name ``apply_fsdp_to_decoder``
    calls; llama3's ``parallelize_llama`` reaches it through that function) is
    ``composable_shard.fully_shard``. Everything else torchtitan calls on the sharded modules is
    its own: ``isinstance(m, FSDPModule)`` (torch's class) then ``set_gradient_divide_factor(1.0)``;
    ``to_empty`` and ``init_weights``; the chunked loss's ``set_reshard_after_forward``,
    ``set_reshard_after_backward``, ``set_requires_gradient_sync(recurse=False)``, ``unshard``,
    eight ``lm_head`` calls and backwards, ``reshard``; ``get_total_norm`` and
    ``clip_grads_with_norm_``; ``model.state_dict()``/``load_state_dict`` and the optimizer's
    own state dict (FQNs from ``named_parameters``) through ``dcp.save``/``dcp.load``.

[Note: What is observed]
  Nothing of torchtitan's is replaced to observe it: ``trainer.metrics_processor.log`` is wrapped
  to record the step, the global average loss and the gradient norm it is given (what torchtitan
  prints), and ``trainer.train_step`` is wrapped to count, per step, the c10d operations issued in
  it (a ``TorchDispatchMode`` active for the step sees every ``c10d::`` and ``_c10d_functional::``
  op, whoever issues it, FSDP2's DTensor collectives and ours alike).
  Point-to-point operations (``c10d::send``/``c10d::recv_``) are counted with their tag. This
  library runs its all-gathers and (at W = 2) reduce-scatters on gloo as point-to-point
  exchanges, tagged by kind: ``0x63730001 + 4 * handle`` for an all-gather, ``0x63730002 + 4 *
  handle`` for a reduce-scatter ([Note: Collectives on gloo] in ``_runtime/collectives.py``, a published
  wire protocol: gloo pairs messages by these tags). ``classify`` folds a send and a receive of
  the same kind and peer into one logical collective of that kind, and refuses any other
  point-to-point traffic, so an untagged or unknown exchange fails the count instead of going
  uncounted.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import random
import shutil
import sys
import time
import types
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# What the test needs installed, for the failure message when torchtitan is missing (the
# project's [torchtitan] extra; see the report in the test module's docstring).
INSTALL_HINT = ('install the [torchtitan] test extra and torchtitan itself, as the README\'s test command does: '
                "pip install -e '.[test,torchtitan]' && pip install --no-deps torchtitan==0.3.0")

SEQ_LEN = 64
LOCAL_BATCH = 2
STEPS = 6
UNSEEDED_STEPS = 2
# Not an option of torchtitan's: an ``extra`` item of _config that leaves the recipe's selective
# activation checkpointing out (torchtitan's config object then holds None, which it skips).
NO_ACTIVATION_CHECKPOINTING = "no-activation-checkpointing"
SAVE_AT = 3  # checkpoint interval: the uninterrupted run saves at 3 (and 6, its last step)
SEED = 7
VOCAB_WORDS = 1000  # the model's vocabulary is 2048; 3 special tokens + these words
DOCUMENTS = 400

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


# ---------------------------------------------------------------------------- data (parent)
def make_assets(root: str) -> Dict[str, str]:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and a JSON-lines
    dataset of ``{"text": ...}`` documents, written under ``root``. Deterministic: a seeded
    first-order Markov chain over the words, so there is something to learn (the loss falls)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "dataset")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    vocab = {BOS: 0, EOS: 1, UNK: 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
                   "add_bos_token": True, "add_eos_token": True}, f)
    rng = random.Random(SEED)
    successors = [[rng.randrange(VOCAB_WORDS) for _ in range(4)] for _ in range(VOCAB_WORDS)]
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(DOCUMENTS):
            w = rng.randrange(VOCAB_WORDS)
            text = []
            for _ in range(rng.randint(20, 120)):
                text.append(words[w])
                w = rng.choice(successors[w]) if rng.random() < 0.9 else rng.randrange(VOCAB_WORDS)
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return {"tokenizer": tok_dir, "dataset": data_dir}


# ---------------------------------------------------------------------------- shims (rank)
class _CpuDeviceModule(types.ModuleType):
    """What torchtitan calls on its ``device_module``, for CPU ranks (no device state)."""

    def __init__(self) -> None:
        super().__init__("titan_cpu_device")

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device: Any = None) -> Dict[str, int]:
        return {}


def import_torchtitan() -> types.ModuleType:
    """Import torchtitan in a rank with the device shim (see [Note: The CPU harness]); returns
    ``torchtitan.trainer``. Idempotent."""
    import torch._utils as tu

    if "torchtitan.tools.utils" not in sys.modules:
        saved = tu._get_available_device_type, tu._get_device_module
        shim = _CpuDeviceModule()
        tu._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
        tu._get_device_module = lambda device_type=None: shim  # type: ignore[assignment]
        try:
            importlib.import_module("torchtitan.tools.utils")  # binds device_type/device_module
        finally:
            tu._get_available_device_type, tu._get_device_module = saved
    import torchtitan.tools.utils as tt_utils

    assert tt_utils.device_type == "cpu" and isinstance(tt_utils.device_module, _CpuDeviceModule), (
        "torchtitan.tools.utils was imported before the device shim", tt_utils.device_type)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    import torchtitan.trainer as trainer_module

    return trainer_module


# ---------------------------------------------------------------------------- counting (rank)
_KINDS = {
    "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::allgather_coalesced_": "all_gather",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_gather_into_tensor_coalesced": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor_coalesced": "reduce_scatter",
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_coalesced": "all_reduce",
    "c10d::broadcast_": "broadcast", "_c10d_functional::broadcast": "broadcast",
    "c10d::barrier": "barrier",
}
_NOT_COLLECTIVES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")
# This library's point-to-point tags on gloo ([Note: What is observed]).
P2P_TAG_BASE, P2P_KIND_BY_RESIDUE = 0x6373_0000, {1: "all_gather", 2: "reduce_scatter"}


def _numel(a: Any) -> int:
    if isinstance(a, torch.Tensor):
        return a.numel()
    if isinstance(a, (list, tuple)):
        return sum(_numel(x) for x in a)
    return 0


class C10dCounter(TorchDispatchMode):
    """Records every ``c10d::`` / ``_c10d_functional::`` op dispatched on this thread while
    active: ``(op name, peer, tag)`` for point-to-point, ``(op name, None, [numel of each
    argument])`` otherwise (the sizes only help reading a failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[tuple] = []

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types_):
            # DTensor first desugars the op into ops on plain tensors, collectives included,
            # which then reach this mode (what torch's CommDebugMode does).
            return NotImplemented
        name = f"{func.namespace}::{func._opname}"
        if func.namespace in ("c10d", "_c10d_functional") and name not in _NOT_COLLECTIVES:
            if name in ("c10d::send", "c10d::recv_"):  # (tensors, group, peer, tag)
                peer, tag = [a for a in args if isinstance(a, int) and not isinstance(a, bool)][:2]
                self.ops.append((name, peer, tag))
            else:
                self.ops.append((name, None, [_numel(a) for a in args]))
        return func(*args, **kwargs)


def classify(ops: List[tuple]) -> Dict[str, int]:
    """Logical collectives per kind (see [Note: What is observed]). A point-to-point exchange
    of this library counts once: its sends to each peer, which must be as many as its receives
    from that peer and the same number for every peer. Raises on any other point-to-point
    traffic."""
    counts: Counter = Counter()
    p2p: Counter = Counter()
    for name, peer, detail in ops:
        if name in ("c10d::send", "c10d::recv_"):
            residue = (detail - P2P_TAG_BASE) % 4 if detail >= P2P_TAG_BASE else -1
            if residue not in P2P_KIND_BY_RESIDUE:
                raise AssertionError(f"point-to-point {name} to/from {peer} with an unknown tag {detail:#x}")
            p2p[(name, peer, P2P_KIND_BY_RESIDUE[residue])] += 1
        elif name in _KINDS:
            counts[_KINDS[name]] += 1
        else:
            counts["other:" + name] += 1
    for kind in sorted({k for _, _, k in p2p}):
        peers = sorted({peer for _, peer, k in p2p if k == kind})
        per_peer = {(p2p[("c10d::send", p, kind)], p2p[("c10d::recv_", p, kind)]) for p in peers}
        if len(per_peer) != 1 or len({n for pair in per_peer for n in pair}) != 1:
            raise AssertionError(f"{kind} point-to-point (sends, receives) per peer differ: "
                                 f"{ {p: (p2p[('c10d::send', p, kind)], p2p[('c10d::recv_', p, kind)]) for p in peers} }")
        counts[kind] += per_peer.pop()[0]
    return dict(counts)


# ---------------------------------------------------------------------------- a run (rank)
def _config(assets: Dict[str, str], dump: str, seed_path: Optional[str], create_seed: bool = False,
            extra: Sequence[str] = (), steps: int = STEPS, saves: bool = True) -> Any:
    """torchtitan's own command line for the llama3 debug recipe (see [Note: The CPU harness]);
    ``extra``: more of its options (the parallelisms); ``saves=False``: the seed checkpoint is
    loaded and nothing is saved (``--checkpoint.load_only``)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    args = ["--module", "llama3", "--config", "llama3_debugmodel",
            "--parallelism.spmd_backend", "partial_dtensor",
            "--training.mixed_precision_param", "float32",
            "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(LOCAL_BATCH),
            "--training.steps", str(steps),
            "--debug.seed", str(SEED),
            "--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["dataset"],
            "--dump_folder", dump,
            "--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT)]
    if not saves:
        args += ["--checkpoint.load_only"]
    elif not create_seed:  # torchtitan's async checkpointing: the step-3 save is written while steps 4.. run
        args += ["--checkpoint.async_mode", "async"]
    no_ac = NO_ACTIVATION_CHECKPOINTING in extra
    args += [a for a in extra if a != NO_ACTIVATION_CHECKPOINTING]
    if create_seed:
        args += ["--checkpoint.create_seed_checkpoint"]
    if seed_path is not None:
        args += ["--checkpoint.initial_load_path", seed_path]
    config = ConfigManager().parse_args(args)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if no_ac:
        config.activation_checkpoint = None  # parallelize_llama applies none
    return config


def _rank_env(tmp: str) -> None:
    """What a launcher sets (torchtitan reads ``LOCAL_RANK``), offline Hugging Face datasets with
    their cache under the test's folder, and quiet: torchtitan logs INFO and WARNING on the root
    logger, and torch, torchdata and datasets warn about CPU meshes and deprecations."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      HF_DATASETS_DISABLE_PROGRESS_BARS="1",
                      HF_DATASETS_CACHE=os.path.join(tmp, "hf_datasets_cache"))
    logging.getLogger().setLevel(logging.ERROR)
    for module in (r"torch\.distributed", r"torchdata", r"torch\.optim\.lr_scheduler", r"torchtitan"):
        warnings.filterwarnings("ignore", module=module)


def create_seed_checkpoint(tmp: str, assets: Dict[str, str]) -> None:
    """At W = 1, what ``torchtitan/train.py`` does with ``--checkpoint.create_seed_checkpoint``:
    build the trainer (no parallelism, weights initialized on the CPU) and save step 0."""
    _rank_env(tmp)
    import_torchtitan()
    config = _config(assets, os.path.join(tmp, "seed"), None, create_seed=True)
    trainer = config.build()
    try:
        trainer.checkpointer.save(curr_step=0, last_step=True)
    finally:
        trainer.close()


def seed_path(tmp: str) -> str:
    return os.path.join(tmp, "seed", "checkpoint", "step-0")


def _use_backend(backend: str) -> None:
    """The one-line swap (and, for pipelining, the second line: the stage torchtitan builds)."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.pipelining as torch_pipelining
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.pipeline_parallel as titan_pp

    if backend == "fsdp2":
        titan_fsdp.fully_shard = torch_fsdp.fully_shard
        titan_pp.PipelineStage = torch_pipelining.PipelineStage
    elif backend == "composable_shard":
        import composable_shard
        import composable_shard.integrations.pipelining

        titan_fsdp.fully_shard = composable_shard.fully_shard
        titan_pp.PipelineStage = composable_shard.integrations.pipelining.PipelineStage
    else:
        raise ValueError(backend)


def _schedule_step_shim(trainer: Any) -> None:
    """torchtitan 0.3.0 calls ``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``
    with micro-batches it split itself; torch 2.13's ``step`` takes the whole batch (FSDP2 fails
    the same way). The shim does what torch's ``step`` does around its micro-batches (stage flags,
    per-step state cleared) and runs them through the schedule's own ``_step_microbatches``."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None:
        return

    def step(*, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None, losses: Any = None,
             return_outputs: bool = True, loss_kwargs: Any = None) -> None:
        for stage in schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)

    schedule.step = step


def _force_sum_on_fsdp2(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    n = 0
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


class TorchtitanCallFailed(RuntimeError):
    """A run failed; the message names the innermost torchtitan line on the stack (the call
    torchtitan made into the sharding library, or torch) and the error."""


@contextlib.contextmanager
def _naming_torchtitans_call(backend: str, stage: str) -> Any:
    try:
        yield
    except Exception as exc:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        titan = [f for f in frames if f"{os.sep}torchtitan{os.sep}" in f.filename]
        where = "no torchtitan frame"
        if titan:
            f = titan[-1]
            where = f"torchtitan/{f.filename.split(os.sep + 'torchtitan' + os.sep, 1)[1]}:{f.lineno} in {f.name}: {f.line}"
        raise TorchtitanCallFailed(f"[{backend}] {stage} failed at {where}\n  -> {type(exc).__name__}: {exc}") from exc


def _fsdp_module_counts(model: torch.nn.Module) -> Dict[str, List[str]]:
    """Names of the modules that are torch's ``FSDPModule`` and this library's ``FSDPModule``."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    import composable_shard

    return {"torch": [n for n, m in model.named_modules() if isinstance(m, TorchFSDPModule)],
            "composable_shard": [n for n, m in model.named_modules() if isinstance(m, composable_shard.FSDPModule)]}


def train_once(tmp: str, assets: Dict[str, str], backend: str, name: str,
               resume_from: Optional[str] = None, extra: Sequence[str] = (), steps: int = STEPS,
               saves: bool = True, seeded: bool = True, count: bool = True) -> Dict[str, Any]:
    """One ``trainer.train()`` at this world size: from the seed checkpoint (``seeded``; else
    from torchtitan's own init), or resumed from ``resume_from``'s step-``SAVE_AT`` checkpoint
    (copied into this run's own folder, where torchtitan's checkpointer finds it and restores
    model, optimizer, LR schedule, dataloader and step); ``extra``, ``steps``, ``saves``: see
    :func:`_config`; ``count``: record each step's collectives. Returns per-step figures
    (rank-local counts; loss and norm are global)."""
    _rank_env(tmp)
    import_torchtitan()
    _use_backend(backend)
    dump = os.path.join(tmp, name)
    if resume_from is not None and dist.get_rank() == 0:
        src = os.path.join(tmp, resume_from, "checkpoint", f"step-{SAVE_AT}")
        shutil.copytree(src, os.path.join(dump, "checkpoint", f"step-{SAVE_AT}"))
    dist.barrier()
    config = _config(assets, dump, seed_path(tmp) if seeded else None, extra=extra, steps=steps, saves=saves)
    record: Dict[str, Any] = {"backend": backend, "name": name, "steps": [], "loss": [], "grad_norm": [],
                              "collectives": [], "ops": [], "rank": dist.get_rank()}
    t0 = time.monotonic()
    with _naming_torchtitans_call(backend, "config.build()"):
        trainer = config.build()
    record["build_s"] = time.monotonic() - t0
    try:
        record["async_mode"] = str(getattr(trainer.checkpointer, "async_mode", None))
        parts = trainer.model_parts
        record["fsdp2_modules_forced_sum"] = sum(_force_sum_on_fsdp2(m) for m in parts) if backend == "fsdp2" else 0
        counts = [_fsdp_module_counts(m) for m in parts]
        record["fsdp_modules"] = {k: [n for c in counts for n in c[k]] for k in ("torch", "composable_shard")}
        schedule = getattr(trainer, "pp_schedule", None)
        stages = [] if schedule is None else getattr(schedule, "_stages", None) or [schedule._stage]
        record["stages"] = sorted({f"{type(st).__module__}.{type(st).__name__}" for st in stages})
        _schedule_step_shim(trainer)
        log = trainer.metrics_processor.log

        def logged(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                   *args: Any, **kwargs: Any) -> Any:
            record["steps"].append(step)
            record["loss"].append(float(global_avg_loss))
            record["grad_norm"].append(float(grad_norm))
            return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        trainer.metrics_processor.log = logged
        train_step = trainer.train_step

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not count:
                return train_step(*args, **kwargs)
            with C10dCounter() as counter:
                out = train_step(*args, **kwargs)
            record["collectives"].append(classify(counter.ops))
            record["ops"].append([list(o) for o in counter.ops])
            return out

        trainer.train_step = counted
        t0 = time.monotonic()
        with _naming_torchtitans_call(backend, "trainer.train()"):
            trainer.train()
        record["train_s"] = time.monotonic() - t0
        saved = os.path.join(dump, "checkpoint")
        record["checkpoints"] = sorted(os.listdir(saved)) if os.path.isdir(saved) else []
    finally:
        trainer.close()
    return record


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def run_backend(tmp: str, assets: Dict[str, str], backend: str) -> None:
    """In each rank: the uninterrupted run (saving at ``SAVE_AT``), then a run resumed from that
    save; each rank writes ``{tmp}/{backend}.rank{r}.json`` after each run, so figures of a run
    that finished survive a later failure."""
    out = os.path.join(tmp, "results", f"{backend}.rank{dist.get_rank()}.json")
    results: Dict[str, Any] = {}
    results["full"] = train_once(tmp, assets, backend, f"{backend}_full")
    write_json(out, results)
    # FSDP2's resume is not run: only ours is compared with its own uninterrupted run
    if backend == "composable_shard":
        results["resumed"] = train_once(tmp, assets, backend, f"{backend}_resumed", resume_from=f"{backend}_full")
        write_json(out, results)
        # from torchtitan's own init, no seed checkpoint: the seed checkpoint holds the unsharded
        # model's weights for the same seed (made at W = 1), which a drop-in gives too (issue 55)
        results["unseeded"] = train_once(tmp, assets, backend, f"{backend}_unseeded", steps=UNSEEDED_STEPS, saves=False,
                                         seeded=False, count=False)
        write_json(out, results)
    dist.barrier()
    if dist.get_rank() == 0:  # 72 MB each (step 3, step 6 of each run); kept when a run failed
        for name in (f"{backend}_full", f"{backend}_resumed"):
            shutil.rmtree(os.path.join(tmp, name, "checkpoint"), ignore_errors=True)


def run_backends(tmp: str, assets: Dict[str, str], backends: List[str]) -> None:
    """:func:`run_backend` for each of ``backends`` in turn, in one spawn (each spawn pays
    torchtitan's imports and first build again: about 5 s at W = 2)."""
    for backend in backends:
        run_backend(tmp, assets, backend)


# The configurations beyond 1-D data parallelism (issue 55), each at W = 4 from the seed checkpoint,
# nothing saved: torchtitan's own options for each, and the configuration whose FSDP2 run is the
# reference (itself, but for zero-bubble: FSDP2's ZBVZeroBubble in this recipe fails under the
# recipe's selective activation checkpointing, "Trying to backward an extra time", and without it
# its step-1 gradient norm is 1.07284 where every exact run gives 1.07641 (measured): the
# reference is then FSDP2's 1F1B over the same pipeline degree, the same sums in another order).
_PP = ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs",
       "--parallelism.pipeline_parallel_schedule"]
PARALLELISMS: Dict[str, List[str]] = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2_1F1B": _PP + ["1F1B"],
    "pp2_Interleaved1F1B": _PP + ["Interleaved1F1B"],
    # torch's selective activation checkpointing refuses the weight pass's second backward through its
    # region ("Trying to backward an extra time"), with FSDP2 and with this library: left out here
    "pp2_ZBVZeroBubble": _PP + ["ZBVZeroBubble", NO_ACTIVATION_CHECKPOINTING],
}
REFERENCE = {"pp2_ZBVZeroBubble": "pp2_1F1B"}  # default: the configuration itself
PARALLEL_STEPS = 3


def run_parallelisms(tmp: str, assets: Dict[str, str], names: List[str]) -> None:
    """In each rank (W = 4): for each configuration of ``names``, FSDP2 (unless another
    configuration's FSDP2 run is its reference) then this library, each ``PARALLEL_STEPS`` steps
    from the seed checkpoint; each rank writes ``{tmp}/results/parallel.rank{r}.json``
    (``{name: {backend: record}}``) after each run, so a failure keeps what ran before it."""
    out = os.path.join(tmp, "results", f"parallel.rank{dist.get_rank()}.json")
    results: Dict[str, Dict[str, Any]] = {}
    for name in names:
        results[name] = {}
        backends = ("composable_shard",) if REFERENCE.get(name, name) != name else ("fsdp2", "composable_shard")
        for backend in backends:
            results[name][backend] = train_once(tmp, assets, backend, f"{name}_{backend}", extra=PARALLELISMS[name],
                                                steps=PARALLEL_STEPS, saves=False, count=name == "tp2")
            write_json(out, results)
