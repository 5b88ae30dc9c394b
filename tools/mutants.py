#!/usr/bin/env python
"""Seeded one-line bugs: does the test suite catch each of them?

Each mutant is one deliberate bug in ``composable_shard/``: an exact substring of a file and
its replacement (one line changed), plus the tests that should catch it. For every mutant this
script copies the package and the tests into a fresh temporary directory, applies the mutant
there (the working tree is never touched), runs the selected tests in that directory with
``PYTHONPATH`` pointing at the copy, and reports:

  CAUGHT      a selected test failed (the first failing test is shown)
  SURVIVED    every selected test passed: the suite misses this bug
  STALE       the original substring is no longer in the file (the code moved): update the
              mutant; a stale mutant is never counted as caught
  AMBIGUOUS   the original substring occurs more than once: make it longer
  NEEDS-CUDA  the mutated code only runs with an accelerator and none is available here
  ERROR       pytest could not run the selection (usage error, nothing collected, timeout)

Before the mutants, the union of all selections runs once on an unmutated copy (skip with
``--no-baseline``): a selection that already fails would make every mutant look caught.

Not part of CI. Usage::

    python tools/mutants.py --list                 # mutants, their files and tests
    python tools/mutants.py                        # all of them, one at a time
    python tools/mutants.py -j 2                   # two at a time (each runs its own pytest)
    python tools/mutants.py --only hybrid_shard_keeps_after_forward --only backward_post_prefetches_nothing

Exit status: 0 if every mutant that could run was caught (NEEDS-CUDA ones excepted), 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "composable_shard"
COPIED = (PACKAGE, "tests", "examples", "benchmarks")  # directories the selected tests may need (benchmarks.model)
COPIED_FILES = ("pyproject.toml",)  # pytest's configuration (rootdir, addopts)
TIMEOUT_S = 900  # per mutant; the harness's own per-test timeouts normally fire first

_RUNTIME = f"{PACKAGE}/_runtime/hooks.py"
_REDUCTION = f"{PACKAGE}/_runtime/flat_param.py"  # the Reduction class moved there
_FLAT = f"{PACKAGE}/_runtime/flat_param.py"
_SHARD_MATH = f"{PACKAGE}/_runtime/shard_math.py"
_UNSHARD = f"{PACKAGE}/_state/unshard_params.py"
_STATE_DICT = f"{PACKAGE}/_state/model_state_dict.py"
_CHECKPOINT = f"{PACKAGE}/checkpoint.py"
_DIVERGENCE = f"{PACKAGE}/_runtime/agreement.py"
_REPLICATE = f"{PACKAGE}/replicate.py"
_MIXED = f"{PACKAGE}/_runtime/mixed_precision.py"
_API = f"{PACKAGE}/api.py"
_INIT = f"{PACKAGE}/_setup/fully_shard_init.py"
_FULLY_SHARD = f"{PACKAGE}/fully_shard.py"
_COLLECTIVES = f"{PACKAGE}/_runtime/collectives.py"
_INTEROP = f"{PACKAGE}/_runtime/interop.py"

_STORAGE = "tests/distributed/test_fully_shard_runtime.py::test_storage_per_rank_and_freeing"
_PREFETCH = "tests/distributed/test_fully_shard_runtime.py::test_prefetch_order_limit_and_release"
_METHODS = "tests/distributed/test_fully_shard_runtime.py::test_no_sync_and_manual_unshard"
_CLIP = "tests/distributed/test_fully_shard_runtime.py::test_clip_grad_norm_over_all_shards"
_CLIP_MIX = "tests/distributed/test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix"
_TRAINING = "tests/distributed/test_fully_shard_training.py::test_parity_with_local_and_torch_fsdp"
_MP = "tests/distributed/test_fully_shard_mixed_precision.py"
_MP_OPTIONS = "tests/distributed/test_mixed_precision_options.py::test_mixed_precision_options"
_UNSHARD_TESTS = "tests/distributed/test_unshard_params.py"
_STATE_DICT_TESTS = "tests/distributed/test_state_dict.py"
_CHECKPOINT_UNIT = "tests/unit/test_checkpoint.py"
_DIVERGENCE_TESTS = "tests/distributed/test_fully_shard_divergence.py"
_REPLICATE_TESTS = "tests/distributed/test_replicate.py"
_INIT_TESTS = "tests/distributed/test_fully_shard_init.py::test_init_options"
_COMPOSE = "tests/distributed/test_compose.py::test_composition_matrix"
_OPTIM = f"{PACKAGE}/optim.py"
_MUON_SQUARE = "tests/distributed/test_muon.py::test_square_matrices_several_per_rank_match_torch_muon"
_MUON_REFUSALS = ("tests/distributed/test_muon_agreement.py::"
                  "test_refusal_on_one_rank_raises_on_every_rank_within_seconds")
_OPTIM_SD = f"{PACKAGE}/_state/optim_state_dict.py"
_LIGHTNING = f"{PACKAGE}/integrations/lightning.py"
_LIGHTNING_CHECKS = f"{PACKAGE}/integrations/_lightning_checks.py"
_TORCH_SD_API = "tests/distributed/test_torch_state_dict_api.py"
_LIGHTNING_TESTS = "tests/distributed/test_lightning.py"
_TP_TESTS = "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_modules_left_out_train_exactly_and_checkpoint"
_TP_REPLICATE_TESTS = "tests/distributed/test_tensor_parallel.py::test_replicate_over_tensor_parallel_modules_is_one_process"
_TP_REFUSALS = "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_modules_are_refused_naming_the_parameter"
_PIPELINING = f"{PACKAGE}/integrations/pipelining.py"
_PLAN_PROFILE = f"{PACKAGE}/_planning/plan_profile.py"
_PLAN_PY = f"{PACKAGE}/plan.py"
_FSDP2_COMPAT = f"{PACKAGE}/_setup/fsdp2_compat.py"
_FSDP2_ARGS = "tests/distributed/test_fsdp2_arguments.py::test_fsdp2_arguments_have_fsdp2s_effect"
_MUON_AGREE2 = "tests/distributed/test_muon_agreement.py::test_refusal_on_one_rank_raises_on_every_rank_within_seconds"
_MUON_AGREE4 = "tests/distributed/test_muon_agreement.py::test_refusal_reaches_every_replica_of_a_hybrid_model[4]"
_PP = "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"
_PP_ZB = f"{_PP}[schedules0-zero_bubble0]"
_SLICE = f"{PACKAGE}/_state/sharded_slice.py"
_ASYNC_FILE = f"{PACKAGE}/_state/async_checkpoint.py"
_ASYNC = "tests/distributed/test_async_checkpoint.py"
_HOST_READS = "tests/distributed/test_host_reads.py"
_AC_WAYS = "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[1]"
_TITAN_PARALLEL = "tests/distributed/test_torchtitan.py::test_torchtitan_llama3_equals_fsdp2_in_every_parallelism"
_PIECES = f"{PACKAGE}/_base/pieces.py"
_FS_TP_2D = "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_two_tensor_parallel_mesh_dimensions"
_FS_TP = ("tests/distributed/test_fully_shard_tensor_parallel.py::"
          "test_fully_shard_over_tensor_parallel_blocks_trains_and_checkpoints_exactly")
_FSDP2 = f"{PACKAGE}/_setup/fsdp2_compat.py"
_DROPIN = "tests/distributed/test_fsdp2_dropin.py::test_fsdp2_dropin"
_META_INIT = "tests/distributed/test_meta_init.py::test_meta_materialization_equals_cpu_and_keeps_sharded_children"
_FS_TP_META = ("tests/distributed/test_fully_shard_tensor_parallel.py::"
               "test_fully_shard_over_sequence_loss_parallel_and_a_llama_plan_equals_fsdp2_and_one_process")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    file: str  # relative to the repository root
    original: str  # exact substring of the file (must occur once)
    replacement: str  # what it becomes: one line changed
    tests: Tuple[str, ...]  # pytest selection, most likely to fail first
    requires: Optional[str] = None  # "cuda": the mutated line only runs with an accelerator


def _m(name: str, what: str, file: str, original: str, replacement: str, *tests: str,
       requires: Optional[str] = None) -> Mutant:
    return Mutant(name, what, file, original, replacement, tuple(tests), requires)


MUTANTS: List[Mutant] = [
    # ---------------------------------------------------------------- reshard timing per strategy
    _m("hybrid_shard_keeps_after_forward",
       "HYBRID_SHARD keeps unsharded parameters from forward to backward (silently ZeRO-2)",
       _INIT, "_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD}",
       "_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD}", f"{_STORAGE}[2]"),
    _m("shard_grad_op_frees_after_forward", "SHARD_GRAD_OP frees after forward (silently ZeRO-3)",
       _INIT, "_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD}",
       "_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy.SHARD_GRAD_OP}",
       f"{_STORAGE}[2]"),
    _m("root_frees_after_forward", "the root reshards after its forward (an extra all-gather per step)",
       _RUNTIME, "return state.reshard_after_forward and (not state.is_root or state.root_reshards_after_forward)",
       "return state.reshard_after_forward", f"{_STORAGE}[2]"),
    _m("root_explicit_reshard_after_forward_ignored", "FSDP2's reshard_after_forward=True asked for the root keeps it anyway",
       _RUNTIME, "return state.reshard_after_forward and (not state.is_root or state.root_reshards_after_forward)",
       "return state.reshard_after_forward and not state.is_root", _FSDP2_ARGS),
    _m("root_reshard_argument_dropped", "fully_shard(root, reshard_after_forward=True) does not mark the root",
       _FULLY_SHARD, "        state.root_reshards_after_forward = True  # (hooks.frees_after_forward)", "        pass", _FSDP2_ARGS),
    _m("root_reshard_method_not_explicit", "set_reshard_after_forward(True) on the root keeps it anyway",
       _FSDP2_COMPAT, "            s.reshard_after_forward = s.root_reshards_after_forward = reshard_after_forward",
       "            s.reshard_after_forward = reshard_after_forward", _FSDP2_ARGS),
    _m("never_reshards_after_backward", "no handle frees its unsharded parameters after backward",
       _RUNTIME, "    return state.reshard_after_backward\n", "    return False\n", f"{_STORAGE}[2]"),
    _m("set_reshard_after_backward_ignored", "set_reshard_after_backward(False) has no effect",
       _RUNTIME, "    return state.reshard_after_backward\n", "    return True\n", f"{_METHODS}[2]"),
    _m("kept_buffer_never_stale", "a kept unsharded buffer is reused after an optimizer step",
       _RUNTIME, "    if handle.is_stale():", "    if False:", f"{_METHODS}[2]"),
    # ---------------------------------------------------------------- prefetch
    _m("backward_post_prefetches_nothing", "BackwardPrefetch.BACKWARD_POST prefetches nothing",
       _RUNTIME, "if state.backward_prefetch_states is None and state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:",
       "if False:", _PREFETCH),
    _m("backward_prefetch_wrong_target", "backward prefetch gathers the handle after, not before, in forward order",
       _RUNTIME, "_prefetch(root, root.ctx.post_forward_order, handle.post_forward_index - 1)",
       "_prefetch(root, root.ctx.post_forward_order, handle.post_forward_index + 1)", _PREFETCH),
    _m("prefetch_on_a_second_call", "a module's second call in one forward prefetches again (a handle already run)",
       _RUNTIME, "    elif first_use and state.forward_prefetch and", "    elif state.forward_prefetch and",
       _PREFETCH),
    _m("order_checked_on_every_call", "every call of a module, not only its first, is checked against exec order",
       _RUNTIME, "    if id(handle) in root.ctx.forward_seen:\n        return False\n", "",
       _PREFETCH),
    _m("forward_prefetch_wrong_target", "forward prefetch gathers two handles ahead",
       _RUNTIME, "_prefetch(root, root.ctx.exec_order, handle.exec_index + 1)",
       "_prefetch(root, root.ctx.exec_order, handle.exec_index + 2)", _PREFETCH),
    _m("forward_prefetch_full_shard_only", "forward_prefetch only honoured under FULL_SHARD",
       _RUNTIME, "state.forward_prefetch and _root_of(state).ctx.exec_order_recorded:",
       "state.forward_prefetch and state.strategy is ShardingStrategy.FULL_SHARD and _root_of(state).ctx.exec_order_recorded:",
       _PREFETCH),
    _m("unused_prefetch_kept", "a block forward prefetch gathered and the forward skipped stays gathered",
       _RUNTIME, "        _release_unused_prefetches(state)\n", "",
       _PREFETCH),
    _m("illegal_transition_allowed", "a handle may go from FORWARD straight to BACKWARD_PRE",
       f"{PACKAGE}/_runtime/flat_param.py", "    _S.FORWARD: frozenset({_S.IDLE}),",
       "    _S.FORWARD: frozenset({_S.IDLE, _S.BACKWARD_PRE}),",
       "tests/unit/test_handle_transitions.py"),
    _m("limit_all_gathers_false_ignored", "limit_all_gathers=False is accepted and does nothing",
       f"{PACKAGE}/_setup/validation.py", '    if config["limit_all_gathers"] is False:', "    if False:",
       "tests/distributed/test_fully_shard_errors.py::test_errors_are_clear_and_leave_the_model_unchanged"),
    # ---------------------------------------------------------------- gradient averaging per strategy
    _m("average_over_shard_group_only", "fp32 gradients divided by the shard group size, not the data-parallel world",
       _REDUCTION, "output.div_(self.state.gradient_divisor)", "output.div_(self.state.world_size)", f"{_TRAINING}[2]"),
    _m("low_precision_not_averaged", "low-precision gradients summed, not averaged",
       _REDUCTION, "grad.div_(state.gradient_divisor)  # pre-divide", "grad.div_(1)  # pre-divide", _MP),
    _m("replicas_not_reduced", "no all-reduce across replicas (NO_SHARD, hybrid): ranks drift apart",
       _REDUCTION, "if group is not None and _collectives.group_size(group) > 1:", "if False:", f"{_STORAGE}[2]", f"{_TRAINING}[2]"),
    _m("dp_world_size_is_shard_size", "the data-parallel world (gradient divisor) counts the shard group only",
       _INIT, "return _Groups(shard, replicate, rank, world, world * replicas)",
       "return _Groups(shard, replicate, rank, world, world)", f"{_TRAINING}[2]"),
    _m("hybrid_groups_swapped", "a hybrid mesh shards along its replicate dimension",
       _INIT, "return mesh.get_group(1), mesh.get_group(0)", "return mesh.get_group(0), mesh.get_group(1)",
       f"{_STORAGE}[4]"),
    _m("gloo_reduce_scatter_drops_own_part", "gloo's point-to-point reduce-scatter keeps only the peer's part",
       _COLLECTIVES, "then=lambda: output.add_(mine))", "then=lambda: output.copy_(mine))", f"{_STORAGE}[2]",
       f"{_TRAINING}[2]"),
    # ---------------------------------------------------------------- reduce dtype, mixed precision
    _m("reduce_dtype_ignored", "gradients reduced in param_dtype even when reduce_dtype is set",
       _API, "            return reduce\n", "            return compute_dtype\n", _MP),
    _m("full_precision_output_not_cast_back", "BatchNorm's fp32 output reaches the bf16 layers after it",
       _MIXED, "return convert(output, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)",
       "return output", _MP_OPTIONS),
    _m("buffer_dtype_ignored", "MixedPrecision(buffer_dtype=...) leaves buffers in their dtype",
       _MIXED, "setattr(module, name, buf.to(dtype))", "setattr(module, name, buf)", _MP_OPTIONS),
    _m("keep_low_precision_grads_ignored", "keep_low_precision_grads=True still casts .grad to fp32",
       _FLAT, "dtype = group.compute_dtype if self.keep_low_precision_grads else fp.dtype",
       "dtype = fp.dtype", _MP_OPTIONS),
    _m("unsynced_accumulated_in_compute_dtype", "backwards without sync sum bf16 gradients in bf16 despite reduce_dtype=fp32",
       _FLAT, "        if _wider(reduce_dtype, grad.dtype):\n", "        if False:\n",
       f"{_MP}::test_unsynced_backwards_accumulate_in_reduce_dtype[2]"),
    _m("cast_forward_inputs_ignored", "MixedPrecision(cast_forward_inputs=True) casts nothing",
       _RUNTIME, "if not (mp.cast_root_forward_inputs or (mp.cast_forward_inputs and state.handle is not None)):",
       "if not mp.cast_root_forward_inputs:", f"{_MP}::test_cast_root_forward_inputs_applies_to_every_fully_shard_unit"),
    # ---------------------------------------------------------------- padding and chunk arithmetic
    _m("padding_rounds_down", "the flat parameter is padded down, not up, to a multiple of W",
       _SHARD_MATH, "return -(-numel // world_size) * world_size", "return (numel // world_size) * world_size",
       "tests/unit/test_shard_math.py"),
    _m("chunk_bounds_overlap", "rank r's chunk runs one element into rank r+1's",
       _SHARD_MATH, "return rank * chunk, (rank + 1) * chunk", "return rank * chunk, (rank + 1) * chunk + 1",
       "tests/unit/test_shard_math.py"),
    _m("slice_offset_in_shard", "a parameter's offset inside the shard measured from the flat start",
       _SHARD_MATH, "slices.append(ParamSlice(index, lo - offset, hi - offset, lo - start))",
       "slices.append(ParamSlice(index, lo - offset, hi - offset, lo - offset))", "tests/unit/test_shard_math.py"),
    # ---------------------------------------------------------------- gradient accumulation, no_sync
    _m("no_sync_not_recursive", "set_requires_gradient_sync(False) only reaches the root",
       _FULLY_SHARD, "for s in self._states(recurse):\n            s.sync_gradients",
       "for s in self._states(False):\n            s.sync_gradients", f"{_METHODS}[2]"),
    _m("unsynced_grads_dropped", "gradients of unsynced backwards are not added to the synced one",
       _FLAT, "grad = kept if grad is None else kept.add_(grad)", "grad = kept if grad is None else grad",
       f"{_METHODS}[2]"),
    _m("synced_grads_overwrite", "a synced backward overwrites .grad instead of accumulating",
       _FLAT, "old.add_(reduced)  # every .grad", "old.copy_(reduced)  # every .grad", f"{_METHODS}[2]"),
    _m("clip_inf_norm_summed", "clip_grad_norm_(norm_type=inf) sums the per-rank maxima",
       _INTEROP, "op = dist.ReduceOp.SUM if not math.isinf(order) else dist.ReduceOp.MAX if order > 0 else "
       "dist.ReduceOp.MIN", "op = dist.ReduceOp.SUM", f"{_CLIP}[2]", f"{_CLIP_MIX}_2"),
    _m("clip_ancestor_handle_grads_whole", "clip_grad_norm_(model.blocks) counts the root handle's slices as whole",
       _INTEROP, "    tagged = [_piece_source(g) if piece else source if source is not None else _source_of(g)\n",
       "    tagged = [_piece_source(g) if piece else source\n", f"{_CLIP_MIX}_2"),
    _m("clip_neg_inf_norm_maxed", "the -inf norm of a sharded gradient combines the ranks' minima with MAX",
       _INTEROP, "dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN",
       "dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MAX", f"{_CLIP_MIX}_2", f"{_CLIP_MIX}_4"),
    _m("clip_no_shard_counted_per_rank", "clip_grad_norm_ sums a NO_SHARD gradient's norm over its replicas",
       _FULLY_SHARD, "group = s.process_group if s.world_size > 1 else None",
       "group = s.process_group if s.world_size > 1 else s.replicate_group", f"{_CLIP_MIX}_2"),
    _m("clip_hybrid_over_replicate_group", "clip_grad_norm_ combines HYBRID shards over the replicate group",
       _FULLY_SHARD, "group = s.process_group if s.world_size > 1 else None",
       "group = (s.replicate_group or s.process_group) if s.world_size > 1 else None", f"{_CLIP_MIX}_4"),
    # ---------------------------------------------------------------- unshard_params write-back
    _m("writeback_direction_reversed", "unshard_params(writeback=True) copies the shard over the edits",
       _UNSHARD, "fp.data.copy_(item.full[start:start + fp.numel()])",
       "item.full[start:start + fp.numel()].copy_(fp.data)", _UNSHARD_TESTS),
    _m("writeback_false_keeps_edits_one_rank", "unshard_params(writeback=False) keeps the edits on one rank",
       _UNSHARD, "saved = shard.clone() if full is shard and not writeback else None", "saved = None", _UNSHARD_TESTS),
    _m("offload_writeback_dropped", "unshard_params(offload_to_cpu=True, writeback=True) drops the edits",
       _UNSHARD, "item.full[: full_cpu.numel()].copy_(full_cpu)", "full_cpu.copy_(item.full[: full_cpu.numel()])",
       f"{_UNSHARD_TESTS}::test_offload_to_cpu_writeback_from_an_accelerator", requires="cuda"),
    _m("offloaded_shard_edits_dropped", "unshard_params at one rank over CPUOffload shards drops the edits",
       _UNSHARD, "if writeback and item.full.data_ptr() != fp.data.data_ptr():",
       "if writeback and item.state.world_size > 1:", f"{_UNSHARD_TESTS}::test_offload_to_cpu_writeback_from_an_accelerator",
       requires="cuda"),
    # ---------------------------------------------------------------- state dict keys
    _m("state_dict_key_without_prefix", "state_dict() rewrites 'weight' instead of 'blocks.0.fc1.weight'",
       _STATE_DICT, "_save_entry(state_dict, prefix + name, m,", "_save_entry(state_dict, name, m,",
       f"{_STATE_DICT_TESTS}::test_state_dicts"),
    _m("load_key_without_prefix", "load_state_dict() looks for nested entries without their prefix",
       _STATE_DICT, "        key = prefix + name\n", "        key = name\n",
       f"{_STATE_DICT_TESTS}::test_state_dicts"),
    # ---------------------------------------------------------------- checkpoint recompute bookkeeping
    _m("recompute_every_unpack", "checkpoint recomputes the forward at every unpacked tensor",
       _CHECKPOINT, "if placeholder not in self.recomputed:", "if True:", _CHECKPOINT_UNIT),
    _m("placeholder_off_by_one", "checkpoint's placeholders are off by one",
       _CHECKPOINT, "return len(self.saved_metas) - 1", "return len(self.saved_metas)", _CHECKPOINT_UNIT),
    _m("rng_not_restored", "checkpoint recomputes with the current RNG state (other dropout masks)",
       _CHECKPOINT, "torch.set_rng_state(self.cpu_rng_state)", "torch.get_rng_state()", _CHECKPOINT_UNIT),
    _m("recomputed_not_released", "recomputed tensors stay alive until the graph is freed",
       _CHECKPOINT, "return self.recomputed.pop(placeholder)", "return self.recomputed[placeholder]", _CHECKPOINT_UNIT),
    _m("recomputation_graph_keeps_activations", "a tensor stashed by the recomputed forward keeps its activations alive",
       _CHECKPOINT, "        captured.clear()\n", "        pass\n", _CHECKPOINT_UNIT),
    # ---------------------------------------------------------------- plan(): the predicted peak
    _m("plan_headroom_dropped", "plan() reserves nothing for small tensors: a plan at its budget measures over it",
       f"{PACKAGE}/plan.py", 'moment.parts["other"] = max(OTHER_MIN_BYTES, int(OTHER_FRACTION * moment.total))',
       'moment.parts["other"] = 0', "tests/distributed/test_plan_peak.py"),
    _m("plan_prefetch_uncounted", "plan() misses the block the root's pre-backward prefetches",
       f"{PACKAGE}/plan.py", "unsharded_in_flight=in_flight + prefetched,",
       "unsharded_in_flight=in_flight,", "tests/distributed/test_plan_peak.py"),
    _m("plan_zero2_own_params_dropped", "a SHARD_GRAD_OP block's backward forgets its own unsharded parameters",
       f"{PACKAGE}/plan.py", "in_flight = t.root_unsharded + sum(zero2[:k + 1])",
       "in_flight = t.root_unsharded + sum(zero2[:k])",
       "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m("plan_undo_skips_block0", "plan()'s undo pass never revisits block 0: plans that are not minimal",
       f"{PACKAGE}/plan.py", "        for k in range(len(assignment)):\n            for option in sorted(",
       "        for k in range(1, len(assignment)):\n            for option in sorted(",
       "tests/unit/test_plan_search.py"),
    _m("plan_next_gradient_uncounted", "block k+1's unsharded gradient, still being reduced, is not counted in k's backward",
       f"{PACKAGE}/plan.py", "    comm = 0 if releases_early else _reduction_in_flight(options, costs, k)", "    comm = 0",
       "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards",
       "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions"),
    _m("plan_next_gradient_released_late", "a checkpointed block's backward is counted with block k+1's gradient in flight",
       f"{PACKAGE}/plan.py", '    releases_early = option.api == "fully_shard" and option.checkpoint',
       '    releases_early = False',
       "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards",
       "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions"),
    # issue 54: the planner's fake pass by name and storage, shared inputs once, the head's gradient, the rows that fit
    _m('plan_shared_inputs_per_layer', 'inputs every layer receives (rotary tables) counted once per checkpointed layer',
       _PLAN_PROFILE, '        fresh = recorder.inputs[index] - seen',
       '        fresh = recorder.inputs[index]', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards", "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_kwargs_inputs_missed', "a block's keyword inputs are not counted",
       _PLAN_PROFILE, '        for t in tensors_in((args, kwargs), None):\n            if _torch_compat',
       '        for t in tensors_in(args, None):\n            if _torch_compat', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards", "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_head_grad_by_id', "the head's parameters recorded by id(): its gradient counted as 0 B",
       _PLAN_PY, 'if name in profile.after_params and p.requires_grad}',
       'if id(p) in profile.after_params and p.requires_grad}', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards", "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_head_grad_in_storage_dtype', "the head's gradient counted in the storage dtype, not the compute dtype",
       _PLAN_PY, 'dtypes.get(id(p), p.dtype).itemsize for p in head.values())',
       'p.dtype.itemsize for p in head.values())', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards"),
    _m('plan_head_grad_counted_twice', "the head's gradient counted where it is already being communicated",
       _PLAN_PY, '    head = 0 if t.head_grad_is_comm else t.head_grad',
       '    head = t.head_grad', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards"),
    _m('plan_block_output_doubled', "a block's output counted twice",
       _PLAN_PROFILE, '        self.outputs[index] = sum(',
       '        self.outputs[index] = 2 * sum(', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards"),
    _m('plan_keyed_storage_released', "the fake pass lets a keyed storage go: a freed input's identity is reused",
       _PLAN_PROFILE, '        self.held.setdefault(key, t.untyped_storage())',
       '        pass', "tests/unit/test_plan_fake.py::test_head_gradient_and_arriving_gradients_are_a_real_backwards"),
    _m('plan_shared_bytes_dropped', 'inputs shared by every layer counted in no block',
       _PLAN_PROFILE, '        return self.input_bytes if checkpointed else self.saved_bytes + self.shared_bytes',
       '        return self.input_bytes if checkpointed else self.saved_bytes', "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_head_backward_grads_uncounted', "the head backward's gradients are not counted as they are made",
       _PLAN_PY, '    head_made = min(prof.head_backward_grads, t.head_grad)',
       '    head_made = 0', "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_head_grads_all_made_at_peak', "the head backward's peak counted with every head gradient, made or not",
       _PLAN_PY, '    head_made = min(prof.head_backward_grads, t.head_grad)',
       '    head_made = t.head_grad', "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m('plan_parameter_around_functional_call', 'a parameter reached around functional_call keeps a fake gradient',
       _PLAN_PROFILE, '            p.grad = grad',
       '            pass', "tests/unit/test_plan_fake.py::test_a_parameter_reached_around_functional_call_is_no_activation_and_keeps_its_gradient"),
    _m('plan_infeasible_names_no_rows', "plan's infeasible-budget error names no remedy",
       _PLAN_PY, '    return text + f" At {s.world} ranks, " + _fewer_rows(s, smallest, budget, rows)',
       '    return text', "tests/unit/test_plan.py::test_infeasible_budget_names_the_most_rows_that_fit"),
    _m('plan_rows_off_by_one', 'plan measures one row more than it names',
       _PLAN_PY, '        return convert(self.batch, lambda t: t[:rows] if t.dim() else t)',
       '        return convert(self.batch, lambda t: t[:rows + 1] if t.dim() else t)', "tests/unit/test_plan.py::test_infeasible_budget_names_the_most_rows_that_fit"),
    _m('plan_rows_fit_twice_the_budget', 'the rows named fit twice the budget, not the budget',
       _PLAN_PY, 'if _simulate(s, smallest, r / total).total <= budget), default=0)',
       'if _simulate(s, smallest, r / total).total <= 2 * budget), default=0)', "tests/unit/test_plan.py::test_infeasible_budget_names_the_most_rows_that_fit"),
    _m('plan_rows_scaled_not_measured', 'the rows named are scaled from the example, not measured',
       _PLAN_PY, '        if top <= budget:\n            return estimate, top',
       '        if True:\n            return estimate, top', "tests/unit/test_plan.py::test_rows_named_for_a_llama_are_measured_not_scaled"),
    _m("plan_conv_scratch_uncounted", "a convolution's backward scratch copies are not counted",
       f"{PACKAGE}/_planning/plan_profile.py", "            self.live.workspace(_conv_backward_workspace(args))",
       "            pass", "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions"),
    _m("plan_ranks_plan_their_own_bytes", "ranks plan with their own bytes: different batches choose apart",
       f"{PACKAGE}/_planning/plan_profile.py", "    dist.all_reduce(most, op=dist.ReduceOp.MAX)\n",
       "    most = torch.tensor(numbers, dtype=torch.int64, device=device)\n",
       "tests/distributed/test_plan.py"),
    _m("plan_fake_cache_left", "a fake tensor the model cached during planning stays in it",
       f"{PACKAGE}/_planning/plan_profile.py", "        _drop_fake_attributes(model, attributes)\n", "        pass\n",
       "tests/unit/test_plan_fake.py::test_a_model_caching_what_its_forward_builds_keeps_no_fake_tensor"),
    _m("plan_grads_counted_twice", "parameters' gradients counted in a block's backward besides the plan's own terms",
       f"{PACKAGE}/_planning/plan_profile.py", "            elif key not in self.gradients:", "            elif True:",
       "tests/unit/test_plan_fake.py::test_a_blocks_backward_leaves_parameter_gradients_to_the_plan"),
    _m("plan_parameter_views_counted", "a view of a parameter (a weight's transpose) counted as new memory",
       f"{PACKAGE}/_planning/plan_profile.py", "        if sid in self.existing:  # a view", "        if False:  # a view",
       "tests/unit/test_plan_fake.py::test_a_blocks_backward_leaves_parameter_gradients_to_the_plan"),
    # ---------------------------------------------------------------- divergence checks
    _m("disagreement_ignored", "ranks about to run different collectives are not stopped",
       _DIVERGENCE, "if any(theirs != everyone[0] for theirs in everyone):", "if False:",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank"),
    _m("first_iteration_not_checked", "handle order only agreed on in debug mode",
       _RUNTIME, "if root is not None and (root.ctx.check_order or root.ctx.debug_checks) and handle.will_gather():",
       "if root is not None and root.ctx.debug_checks and handle.will_gather():",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank"),
    _m("debug_mode_never_on", "COMPOSABLE_SHARD_DEBUG=1 turns nothing on",
       _DIVERGENCE, 'return flag not in ("", "0") or', 'return False and',
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    _m("p2p_tag_without_handle", "gloo pairs a gather with the peers' gather of another handle (mixed shards)",
       _COLLECTIVES, "    return kind + 4 * (match % (1 << 24))", "    return kind",
       f"{_DIVERGENCE_TESTS}::test_unagreed_divergence_times_out_naming_the_collective"),
    _m("reentrant_arrival_reduced_early", "a reentrant recomputation's part of a handle's gradient is reduced on its own",
       _RUNTIME, "    if group.forward_grad_due:  # a reentrant", "    if False:  # a reentrant",
       "tests/distributed/test_hf_models.py::test_hf_decoders"),
    # ---------------------------------------------------------------- misuse between steps
    _m("called_while_sharded_unchecked", "a module called while its owner is sharded computes on 1-D slices",
       _RUNTIME, "            if all(holder is not m for m in members):",
       "            if all(holder is not m for m in members) and False:",
       "tests/distributed/test_called_while_sharded.py"),
    _m("detached_params_unchecked", "a parameter whose .data was replaced after fully_shard trains on silently",
       _RUNTIME, "        if detached:\n", "        if False:\n",
       "tests/distributed/test_fully_shard_lifecycle.py::test_changes_after_fully_shard_are_refused"),
    _m("unfrozen_params_not_adopted", "a parameter unfrozen after replicate keeps each rank's own gradient",
       _REPLICATE, "    if not unfrozen or state.backward is not None:", "    if True:",
       f"{_REPLICATE_TESTS}::test_parameters_unfrozen_after_replicate_are_averaged"),
    _m("casts_not_guarded", "model.half()/.to(dtype) after fully_shard or replicate goes through",
       f"{PACKAGE}/_setup/apply_guard.py", '    if _depth["init"] or _depth["apply"]:', "    if True:",
       "tests/distributed/test_fully_shard_lifecycle.py::test_changes_after_fully_shard_are_refused",
       f"{_REPLICATE_TESTS}::test_errors_identity_and_skipped_parameters"),
    _m("collective_call_hint_dropped", "a state dict taken on one rank only times out blaming the training step",
       _UNSHARD, "state.process_group, tag=tag, hint=hint).wait()", "state.process_group, tag=tag).wait()",
       f"{_DIVERGENCE_TESTS}::test_unagreed_divergence_times_out_naming_the_collective"),
    _m("compile_wrapper_not_unwrapped", "a checkpoint taken through torch.compile's wrapper keeps its _orig_mod. names",
       f"{PACKAGE}/_base/torch_compat.py", "        module = module._orig_mod  #", "        break  #",
       "tests/distributed/test_compile.py::test_checkpoint_through_torch_compile_wrapper"),
    _m("param_hooks_not_refused", "a gradient hook on an original parameter is accepted and never runs",
       f"{PACKAGE}/_runtime/flat_param.py", "                if has_grad_hooks(p):", "                if False:",
       "tests/distributed/test_fully_shard_lifecycle.py::test_changes_after_fully_shard_are_refused"),
    _m("step_disagreement_ignored", "an optimizer step skipped on one rank (GradScaler) goes unreported",
       f"{PACKAGE}/_runtime/watch.py", "if num_ranks * squares == total * total:", "if True:",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    _m("step_counter_counts_every_optimizer", "an optimizer of a rank's own model counts as one of the model's",
       f"{PACKAGE}/_runtime/watch.py", "any(id(p) in self.param_ids for g in groups for p in g[\"params\"])", "True",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]",
       "tests/distributed/test_two_models.py::test_optimizer_step_of_one_model_makes_the_other_gather_nothing"),
    # issue 56: no host read of a device value in a step; the step verdict read a synced backward later
    _m("agreement_used_flags_local_only", "the used flags are taken as this rank's own when some are 0 (a parameter used on another rank keeps grad None)",
       _DIVERGENCE, "    if all(values[:n]):\n", "    if True:\n",
       "tests/distributed/test_fully_shard_lifecycle.py::test_parameters_without_gradient_keep_grad_none",
       f"{_REPLICATE_TESTS}::test_parity_with_ddp_and_local[2]"),
    _m("agreement_host_tensor_on_device", "the agreement's integers made on the device from Python values (a host wait on a GPU)",
       _DIVERGENCE, "    summed = to_device(values, torch.int32, device)",
       "    summed = torch.tensor(values, dtype=torch.int32, device=device)", _HOST_READS),
    _m("agreement_reads_at_once", "the step verdict read in the step that issued it (a host read of the device result)",
       _DIVERGENCE, "    if all(values[:n]):\n        return values[:n], verdict",
       "    if all(values[:n]):\n        return summed[:n].tolist(), verdict", _HOST_READS),
    _m("clip_index_from_python_values", "clipping's index tensor made on the device from Python values",
       _INTEROP, "        index = to_device(members, torch.int64, local.device)",
       "        index = torch.tensor(members, device=local.device)", _HOST_READS),
    _m("profiler_ranges_always_opened", "the runtime's profiler ranges opened with no profiler running (tens of microseconds each)",
       _RUNTIME, "            if not profiler_enabled():\n                return fn(*args, **kwargs)\n", "", _HOST_READS),
    _m("profiler_ranges_never_opened", "the runtime's profiler ranges never opened, even under torch.profiler",
       _RUNTIME, "            if not profiler_enabled():\n", "            if True:\n", _HOST_READS),
    _m("step_verdict_never_read", "the previous synced backward's step verdict is never read",
       _RUNTIME, "    disagreement = take_step_verdicts(root) if batches else None", "    disagreement = None",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    _m("step_verdict_not_kept", "the step verdict of a synced backward is dropped instead of kept for the next",
       _RUNTIME, "            root.ctx.step_verdicts[key] = verdict", "            pass",
       f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    _m("step_verdict_not_read_at_state_dict", "a step verdict no later backward read is not read when the state dict is taken",
       f"{PACKAGE}/_state/unshard_params.py", "        if steps_disagree is not None:\n            raise RuntimeError(steps_disagree)",
       "        if False:\n            raise RuntimeError(steps_disagree)", f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    _m("replicate_step_verdict_never_read", "replicate's previous step verdict is never read",
       _REPLICATE, "        steps_disagree = previous.disagreement() if previous is not None else None",
       "        steps_disagree = None", f"{_DIVERGENCE_TESTS}::test_disagreement_raises_on_every_rank[2]"),
    # ---------------------------------------------------------------- replicate
    _m("replicate_bucket_not_scaled", "replicate sums bucket gradients instead of averaging",
       _REPLICATE, "else 1.0 / state.world_size", "else 1.0", f"{_REPLICATE_TESTS}::test_parity_with_ddp_and_local[2]"),
    _m("replicate_slot_view_not_scaled", "a gradient that already is its bucket slot is not scaled",
       _REPLICATE, "            view.mul_(scale)\n", "            view.mul_(1.0)\n",
       f"{_REPLICATE_TESTS}::test_parity_with_ddp_and_local[2]", f"{_REPLICATE_TESTS}::test_no_sync_overlap_and_bucket_rebuild"),
    _m("replicate_no_sync_ignored", "replicate's set_requires_gradient_sync(False) still communicates",
       _REPLICATE, "state.backward = _BackwardPass(state.sync_gradients, len(state.params))",
       "state.backward = _BackwardPass(True, len(state.params))",
       f"{_REPLICATE_TESTS}::test_no_sync_overlap_and_bucket_rebuild"),
    _m("replicate_unused_gets_grad", "a parameter no rank used gets a zero .grad (DDP leaves None)",
       _REPLICATE, "            if is_used[i]:\n", "            if True:\n",
       f"{_REPLICATE_TESTS}::test_parity_with_ddp_and_local[2]"),
    _m("replicate_process_group_ignored", "replicate(process_group=G) averages over the whole world",
       _REPLICATE, "state.process_group, state.world_size = group, dist.get_world_size(group)",
       "state.process_group, state.world_size = None, dist.get_world_size()",
       f"{_REPLICATE_TESTS}::test_parity_with_ddp_and_local[4]"),
    _m("replicate_rebuilds_every_step", "replicate rebuilds its buckets after every backward",
       _REPLICATE, "if state.num_rebuilds == 0:", "if True:", f"{_REPLICATE_TESTS}::test_no_sync_overlap_and_bucket_rebuild"),
    # ---------------------------------------------------------------- init
    _m("sync_module_states_ignored", "fully_shard(sync_module_states=True) broadcasts nothing",
       _INIT, "    if plan.sync_module_states:\n        broadcast_from_rank0(",
       "    if False:\n        broadcast_from_rank0(", _INIT_TESTS),
    _m("process_group_ignored", "fully_shard(process_group=G) shards over the whole world",
       _INIT, "group: Optional[dist.ProcessGroup] = process_group if process_group is not None else dist.group.WORLD",
       "group: Optional[dist.ProcessGroup] = dist.group.WORLD", f"{_STORAGE}[4]"),
    _m("ignored_states_ignored", "fully_shard(ignored_states=[...]) flattens those parameters anyway",
       f"{PACKAGE}/_setup/data_parallel.py", "params.update(s for s in ignored_states or [] if isinstance(s, nn.Parameter))",
       "params.update([])",
       _INIT_TESTS),
    _m("hybrid_groups_made_per_call", "HYBRID_SHARD without groups makes a new (shard, replicate) pair per fully_shard call",
       _INIT, "    if len(cached) == 3 and cached[0] is default", "    if False and cached[0] is default",
       "tests/distributed/test_fully_shard_init.py::test_hybrid_groups_are_made_once_per_layout"),
    _m("param_init_fn_ignored", "fully_shard(param_init_fn=...) falls back to reset_parameters()",
       _INIT, "        _call_param_init_fn(plan, plan.param_init_fn)\n", "        _reset_meta_modules(plan)\n",
       "tests/distributed/test_fully_shard_composable.py::test_composable_fully_shard_behaviours[2]"),
    # ---------------------------------------------------------------- FSDPModule methods
    _m("summon_full_params_ignores_recurse", "FSDPModule.summon_full_params(recurse=False) unshards the subtree",
       _FULLY_SHARD, "return unshard_params(self, recurse=recurse,", "return unshard_params(self, recurse=True,",
       _UNSHARD_TESTS),
    _m("set_reshard_after_backward_always_recursive", "set_reshard_after_backward(flag, recurse=False) reaches children",
       _FULLY_SHARD, "for s in self._states(recurse):\n            s.reshard_after_backward",
       "for s in self._states(True):\n            s.reshard_after_backward", f"{_METHODS}[2]"),
    # ---------------------------------------------------------------- interoperability
    _m("torch_clip_sees_local_norm", "torch.nn.utils.clip_grad_norm_ clips each rank's slices by its own norm",
       _INTEROP, "        if func is _VECTOR_NORM and _is_total_norm(args, kwargs):", "        if False:",
       "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[2]"),
    _m("torch_clip_norms_plain", "a sharded gradient's norm is a plain tensor: torch's clip sums nothing across ranks",
       _INTEROP, "        if func is _VECTOR_NORM or func is _FOREACH_NORM:\n            return _partial_norms(",
       "        if func is _FOREACH_NORM:\n            return _partial_norms(",
       "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[2]"),
    _m("torch_clip_any_norm_of_partials_combines",
       "any vector norm of a partial norm (not only of a stack) combines: a norm logged on one rank hangs or is global",
       _INTEROP, "    return (len(args) >= 1 and isinstance(args[0], PartialNorm) and args[0]._cs_stacked\n",
       "    return (len(args) >= 1 and isinstance(args[0], PartialNorm)\n",
       "tests/distributed/test_clip_grad_norm.py::test_norms_outside_torch_clipping_stay_local_under_modes"),
    _m("torch_clip_stack_loses_partials", "stacking partial norms drops their sources: torch's total norm is this rank's",
       _INTEROP, '        if func is torch.stack and not kwargs.get("dim") and len(args) == 1 and _stackable(args[0]):',
       '        if False:', f"{_CLIP_MIX}_2"),
    _m("torch_clip_partial_arithmetic_resolves", "arithmetic on a logged norm combines it across ranks (one rank waits)",
       _INTEROP, "        return plain_torch_function(func, [_local_values(a) for a in args],",
       "        return plain_torch_function(func, [_resolve(a) if isinstance(a, PartialNorm) else a for a in args],",
       "tests/distributed/test_clip_grad_norm.py::test_norms_outside_torch_clipping_stay_local_under_modes"),
    _m("torch_clip_sums_norms_not_powers", "partial norms are summed instead of their p-th powers",
       f"{PACKAGE}/_runtime/interop.py", "    return norms if math.isinf(order) or order == 0 else norms.pow(order)",
       "    return norms", "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[2]"),
    _m("foreign_wrappers_allowed", "DistributedDataParallel around a sharded model broadcasts rank 0's slices",
       _INTEROP, "    if found is None:\n        return", "    if True:\n        return",
       "tests/distributed/test_interop.py::test_torch_data_parallel_wrappers_are_refused_at_construction"),
    _m("torch_contract_apis_allowed", "torch's composable replicate on a sharded model is set up, its DDP broadcasts",
       _INTEROP, "applied = _FOREIGN.get(_contract_api(function)) if key == _CONTRACT else None", "applied = None",
       "tests/distributed/test_interop.py::test_torch_data_parallel_wrappers_are_refused_at_construction"),
    _m("torch_contract_entries_left", "a refused torch replicate/fully_shard leaves its registry in the module",
       _INTEROP, "        _undo_contract_entries(contract)", "        pass",
       "tests/distributed/test_interop.py::test_torch_data_parallel_wrappers_are_refused_at_construction"),
    _m("torch_replicate_lazy_init_allowed", "torch's replicate applied before fully_shard broadcasts at the first forward",
       _INTEROP, '            ("replicate", "init"): "torch\'s composable replicate",\n', "",
       "tests/distributed/test_interop.py::test_torch_replicate_applied_before_fully_shard_is_refused_at_its_first_forward"),
    # ---------------------------------------------------------------- tensor-parallel modules beside the APIs
    _m("fs_tp_views_plain", "fully_shard shows a tensor-parallel module its plain local piece, not a DTensor",
       f"{PACKAGE}/_runtime/flat_param.py",
       "            views = [view if tp is None else as_dtensor(tp, view) for view, tp in zip(views, fp._pieces)]",
       "            views = [view for view, tp in zip(views, fp._pieces)]", _FS_TP),
    _m("fs_tp_norm_over_dp_only", "a fully sharded piece's gradient norm is completed over dp only, not over tp",
       f"{PACKAGE}/_runtime/flat_param.py",
       "    return ([shard_group] if shard_group is not None else []) + (shard_groups(piece) if piece is not None else [])",
       "    return ([shard_group] if shard_group is not None else [])", _FS_TP),
    _m("fs_tp_boxes_unmoved", "a sharded state dict describes a piece's boxes at the piece's own offsets, not global",
       f"{PACKAGE}/_state/sharded_slice.py",
       "        out.boxes = [(tuple(o + p for o, p in zip(box, offsets)), box_sizes, flat)",
       "        out.boxes = [(box, box_sizes, flat)", _FS_TP),
    _m("fs_tp_full_state_dict_pieces", "a full state dict holds each rank's piece, not the joined tensor",
       f"{PACKAGE}/_state/model_state_dict.py", "        value = to_global(m.piece, value)", "        value = value.clone()",
       _FS_TP),
    _m("fs_tp_rank0_only_skips_join", "under rank0_only the other ranks do not join their pieces (rank 0 hangs)",
       f"{PACKAGE}/_state/model_state_dict.py",
       "        if m.piece is not None:  # its tensor-parallel peers", "        if False:  # its tensor-parallel peers", _FS_TP),
    _m("fs_tp_optimizer_state_pieces", "a full optimizer state dict holds each rank's piece of the moments",
       _OPTIM_SD, "                    value = to_global(piece, views[index])",
       "                    value = views[index].clone()", _FS_TP),
    _m("fs_tp_load_whole_not_piece", "a full tensor loads its first elements into a piece, not the piece's own",
       f"{PACKAGE}/_state/model_state_dict.py",
       "    return (value if piece is None else take_piece(piece, value)).reshape(-1)[start:end]",
       "    return value.reshape(-1)[start:end]", _FS_TP),
    _m("fs_tp_piece_shape_unchecked", "fully_shard flattens a piece that is not its placements' split",
       f"{PACKAGE}/_base/pieces.py", "    if local != sizes:", "    if False:", _TP_REFUSALS),
    _m("fs_tp_overlapping_group_accepted", "fully_shard shards over a group holding the tensor-parallel peers",
       _INIT, "                          dp_groups or [None], flattened=True)", "                          [], flattened=True)",
       _TP_REFUSALS),
    _m("fs_tp_describe_no_pieces", "describe does not list the tensor-parallel parameters",
       f"{PACKAGE}/_planning/describe.py", "                                        tensor_parallel=_tensor_parallel_pieces(model))",
       "                                        tensor_parallel=())", _FS_TP),
    _m("tp_replicate_cast_cuts_pieces", "a cast of a replicated tensor-parallel model swaps its DTensors' pieces",
       f"{PACKAGE}/_setup/apply_guard.py", "    _refuse_moving_pieces(module, owners, fn)\n", "", _TP_REPLICATE_TESTS),
    _m("tp_clip_one_collective_per_gradient", "our clip joins each tensor-parallel gradient's norm on its own",
       _INTEROP, "    pieces = [source is None and _is_placed_piece(g) for g, source in zip(grads, sources)]",
       "    pieces = [False for g in grads]", _TP_REPLICATE_TESTS),
    _m("fs_tp_early_optimizer_steps", "an optimizer built before fully_shard silently steps the DTensors it replaced",
       f"{PACKAGE}/_runtime/flat_param.py",
       "    _watch.watch_replaced(param, \".\".join(part for part in (module_fqn, info.module_name, info.param_name) if part))\n",
       "", _TP_REFUSALS),
    _m("fs_tp_other_piece_loaded", "a ShardedSlice of another tensor-parallel piece loads as this rank's",
       f"{PACKAGE}/_state/model_state_dict.py",
       "        if value.piece != mine:", "        if False:", _FS_TP),
    _m("fs_tp_plan_accepts", "plan() plans a tensor-parallel model as data-parallel",
       f"{PACKAGE}/plan.py", "    if pieces:\n        name, t = pieces[0]", "    if False:\n        name, t = pieces[0]",
       _TP_REFUSALS),
    _m("tp_full_state_dict_keeps_dtensors", "a full state dict holds the tensor-parallel pieces, not full tensors",
       f"{PACKAGE}/_state/model_state_dict.py", "(k, v.full_tensor() if isinstance(v, DTensor) else v)", "(k, v)", _TP_TESTS),
    _m("tp_full_state_dict_loses_versions", "a full state dict rebuilt for tensor-parallel pieces drops the module versions",
       f"{PACKAGE}/_state/model_state_dict.py", '    if hasattr(state_dict, "_metadata"):', "    if False:", _TP_TESTS),
    _m("tp_failed_load_keeps_pieces", "a failed load leaves the tensor-parallel pieces loaded",
       f"{PACKAGE}/_state/load_transaction.py",
       "copied whole\n            self.clones.append((tensor, tensor.detach().clone()))", "copied whole\n            pass",
       _TP_TESTS),
    _m("tp_full_load_not_placed", "a plain model's full tensors are not placed as the DTensors they load into",
       f"{PACKAGE}/_state/model_state_dict.py",
       "        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):", "        if False:", _TP_TESTS),
    _m("tp_gradient_norm_of_the_piece", "a tensor-parallel gradient's norm is taken as its local piece's",
       _INTEROP, "        return torch.linalg.vector_norm(grad, order, dtype=dtype).full_tensor()",
       "        return torch.linalg.vector_norm(grad.to_local(), order, dtype=dtype)", _TP_TESTS),
    _m("tp_torch_norms_unresolved", "torch's own DTensor norms are stacked with ours unresolved",
       _INTEROP, "    wholes = [t.full_tensor() if isinstance(t, DTensor) else t for t in items]",
       "    wholes = list(items)", _TP_TESTS),
    _m("tp_replicate_broadcasts_wrappers", "replicate broadcasts DTensor wrappers, not their pieces",
       _REPLICATE, "    broadcast_from_rank0([local_piece(t) for _, t in states]", "    broadcast_from_rank0([t for _, t in states]",
       _TP_REPLICATE_TESTS),
    _m("tp_buckets_of_global_shapes", "replicate's bucket slots take a tensor-parallel parameter's global shape",
       _REPLICATE, "        pieces = [local_piece(p) for p in params]", "        pieces = list(params)", _TP_REPLICATE_TESTS),
    _m("tp_overlapping_mesh_accepted", "replicate averages over a group holding the tensor-parallel peers",
       f"{PACKAGE}/_setup/validation.py", "        if shared:", "        if False:",
       "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_modules_are_refused_naming_the_parameter"),
    _m("tp_describe_global_bytes", "describe counts a tensor-parallel parameter's global bytes on every rank",
       f"{PACKAGE}/_planning/describe.py", "    here = {id(p): local_piece(p).numel() for p in params}",
       "    here = {id(p): p.numel() for p in params}", _TP_REPLICATE_TESTS),
    _m("tp_partial_grads_averaged_as_pieces", "a SequenceParallel norm's Partial gradient is averaged over dp unsummed",
       _REPLICATE, "        grad = cast(DTensor, grad).redistribute(", "        grad = grad if True else cast(DTensor, grad).redistribute(",
       "tests/distributed/test_tensor_parallel.py::test_replicate_over_sequence_parallel_blocks_is_one_process"),
    _m("tp_partial_grad_overwritten_in_place", "a reduced copy lands in a Partial gradient, which then claims a sum",
       _REPLICATE, "    elif param.grad is None or _placed_otherwise(param, param.grad):", "    elif param.grad is None:",
       "tests/distributed/test_tensor_parallel.py::test_replicate_over_sequence_parallel_blocks_is_one_process"),
    _m("tp_optimizer_state_read_as_plain", "a DTensor's optimizer state is compared by its wrapper's storage",
       _OPTIM_SD, "    if isinstance(a, DTensor) or isinstance(b, DTensor):", "    if False:", _TP_TESTS),
    # ---------------------------------------------------------------- state dicts and loads
    _m("rank0_only_keeps_entries", "state_dict() under FullStateDictConfig(rank0_only=True) gives rank 1 buffers",
       f"{PACKAGE}/_state/model_state_dict.py", "            if config.rank0_only and rank_of() != 0:\n                del state_dict[key]",
       "            if False:\n                del state_dict[key]",
       "tests/distributed/test_state_dict_ownership.py::test_rank0_only_gives_other_ranks_nothing"),
    _m("state_dict_aliases_live_state", "a full state dict's tensors alias live parameters and buffers",
       f"{PACKAGE}/_state/model_state_dict.py", "            elif not call.keep_vars:", "            elif False:",
       "tests/distributed/test_state_dict_ownership.py::test_returned_state_dicts_share_no_storage_with_live_state"),
    _m("storage_paths_unchecked", "a .metadata entry whose symlink leads outside the checkpoint folder is read",
       f"{PACKAGE}/_state/checkpoint_files.py", "    if not real.startswith(real_root.rstrip(os.sep) + os.sep):", "    if False:",
       "tests/distributed/test_checkpoint_faults.py::test_storage_path_outside_the_folder_is_refused_unread"),
    _m("failed_load_not_restored", "a load that failed on one rank leaves the others half-loaded",
       f"{PACKAGE}/_state/load_transaction.py", "def _restore(snapshot: _Snapshot) -> None:\n",
       "def _restore(snapshot: _Snapshot) -> None:\n    return\n",
       "tests/distributed/test_checkpoint_faults.py::test_failed_load_leaves_every_rank_bit_identical"),
    _m("same_device_copy_refused", ".to('cpu:0') on the CPU raises instead of being a no-op",
       f"{PACKAGE}/_setup/apply_guard.py", "    if copies_only:\n", "    if False:\n",
       "tests/distributed/test_interop.py::test_moves_to_the_shards_own_device_are_no_ops"),
    # ---------------------------------------------------------------- Muon (composable_shard.optim)
    _m("muon_zeroes_other_owned_matrices", "Muon zeroes a gathered group from its start to each owned matrix, "
       "wiping the results of the rank's earlier owned matrices",
       _OPTIM, "gathered[end:m.flat_start].zero_()", "gathered[:m.flat_start].zero_()", f"{_MUON_SQUARE}[2]"),
    _m("muon_transposes_square_matrices", "Muon's Newton-Schulz transposes square matrices (other bfloat16 rounding)",
       _OPTIM, "tall = matrix.shape[0] > matrix.shape[1]", "tall = matrix.shape[0] >= matrix.shape[1]",
       f"{_MUON_SQUARE}[2]"),
    _m("muon_refusals_raised_alone", "a Muon refused on one rank raises there only; the others build theirs",
       _OPTIM, "return agreed(api, [group] if collective else None, prepare_here,", "return agreed(api, None, prepare_here,",
       _MUON_REFUSALS),
    _m("muon_refused_group_kept", "a param group refused on another rank stays added on the ranks that accepted it",
       _OPTIM, "            del self.param_groups[count:]  # refused", "            pass  # refused", _MUON_REFUSALS),
    # ---------------------------------------------------------------- torch's state-dict API, Lightning
    _m("optim_state_dict_slices_plain", "optimizer.state_dict() shows sharded states as plain per-rank slices "
       "(DCP keeps one rank's: the equal-shapes swap)",
       _OPTIM_SD, "                    entries[name] = where.sharded(value.detach().reshape(-1))",
       "                    entries[name] = value", f"{_TORCH_SD_API}::test_equal_shapes_resume_exactly"),
    _m("torch_full_request_not_gathered", "torch's full_state_dict=True gets the optimizer's per-rank slices",
       _OPTIM_SD, "    if request is not None and request.full_state_dict and members:",
       "    if False and members:", f"{_TORCH_SD_API}::test_full_state_dicts_equal_fsdp2s"),
    _m("torch_sharded_model_request_full", "torch's sharded request gathers the full model on every rank",
       f"{PACKAGE}/_state/model_state_dict.py", "    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(request.cpu_offload)",
       "    return StateDictType.FULL_STATE_DICT, FullStateDictConfig()",
       f"{_TORCH_SD_API}::test_full_state_dicts_equal_fsdp2s"),
    _m("optim_load_full_kept_whole", "optimizer.load_state_dict keeps a full-shaped state for a sharded parameter",
       _OPTIM_SD, "    if isinstance(value, DTensor) or tuple(value.shape) == tuple(where.shape):",
       "    if isinstance(value, DTensor):",
       f"{_TORCH_SD_API}::test_resume_through_torch_api_at_another_world_size[torch:full-1-FULL_SHARD]"),
    _m("extra_written_after_publishing", "save_checkpoint's extra lands outside the checksummed, published folder",
       f"{PACKAGE}/_state/checkpoint_files.py", "(_write_extra(tmp, extra) or _publish(tmp, path))",
       "(_publish(tmp, path) or _write_extra(path, extra))",
       f"{_STATE_DICT_TESTS}::test_resume_equals_the_uninterrupted_run"),
    _m("lightning_accumulation_syncs", "ShardedStrategy reduces every accumulated micro-batch",
       _LIGHTNING, "        with gradient_sync_off(self.model):\n            yield",
       "        with contextlib.nullcontext():\n            yield",
       f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("lightning_model_parallel_saves", "Lightning's ModelParallelStrategy writes a checkpoint it cannot resume",
       _LIGHTNING_CHECKS, '_MODEL_PARALLEL_MODULES = frozenset({"lightning.pytorch.strategies.model_parallel",',
       '_MODEL_PARALLEL_MODULES = frozenset({"lightning.pytorch.strategies.model_parallel_",', f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    # issue 54: Lightning save -> load -> continue with every kind of state; the collectives of a checkpoint
    _m("lightning_standalone_trainer_saves", "standalone pytorch_lightning's ModelParallelStrategy saves unrefused",
       _LIGHTNING_CHECKS, '"pytorch_lightning.strategies.model_parallel",', "", f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("lightning_model_parallel_loads", "Lightning's ModelParallelStrategy loads are not refused (Lightning's own error)",
       _LIGHTNING_CHECKS, '_CHECKPOINT_CALLS = frozenset({"save_checkpoint", "load_checkpoint", "_save_checkpoint", "_load_checkpoint",',
       '_CHECKPOINT_CALLS = frozenset({"save_checkpoint", "_save_checkpoint",', f"{_LIGHTNING_TESTS}::test_fabric_model_parallel_strategy_is_refused_at_save"),
    _m("lightning_traverse_unchecked", "Fabric's ModelParallelStrategy save reaches Lightning's own confusing refusal",
       _LIGHTNING_CHECKS, '_CHECKED_POINTS = frozenset({"traverse", "state_dict"})', '_CHECKED_POINTS = frozenset({"state_dict"})',
       f"{_LIGHTNING_TESTS}::test_fabric_model_parallel_strategy_is_refused_at_save"),
    _m("caller_checks_need_the_import", "caller checks run only once the user imported the integration",
       f"{PACKAGE}/_base/callers.py", "        _load(prefix)(subject, point, functions)",
       '        sys.modules.get("composable_shard.integrations.lightning") and _load(prefix)(subject, point, functions)',
       f"{_LIGHTNING_TESTS}::test_fabric_model_parallel_strategy_is_refused_at_save", "tests/unit/test_caller_checks.py"),
    _m("fabric_stateful_not_restored", "fabric.load returns a Stateful (an LR scheduler) unrestored",
       _LIGHTNING, "                obj.load_state_dict(extra.pop(key))", "                extra.pop(key)", f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m("fabric_plain_value_not_restored", "fabric.load drops a plain value of the state",
       _LIGHTNING, "                state[key] = extra.pop(key)", "                extra.pop(key)", f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m("checkpoint_second_optimizer_not_loaded", "a checkpoint's second optimizer is not restored",
       f"{PACKAGE}/_state/checkpoint_files.py", "        for index, optimizer in enumerate(optims):",
       "        for index, optimizer in enumerate(optims[:1]):", f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes", f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("optim_load_state_not_initialized", "a loaded optimizer's moments are not set up before the load",
       _OPTIM_SD, "    _init_state(optim)\n", "    None\n", f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m("lightning_checkpoint_gathers", "Trainer's checkpoint gathers the whole model on every rank (sharded views expected)",
       _LIGHTNING, "        with state_dict_type(self.lightning_module, StateDictType.SHARDED_STATE_DICT):",
       "        with state_dict_type(self.lightning_module, StateDictType.FULL_STATE_DICT):", f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("lightning_callbacks_dropped", "Trainer's checkpoint drops the callbacks' state",
       _LIGHTNING, 'if k not in ("state_dict", "optimizer_states")}', 'if k not in ("state_dict", "optimizer_states", "callbacks")}',
       f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("lightning_loops_dropped", "Trainer's resume loses the loops' state",
       _LIGHTNING, "        return dict(extra or {})", '        return {k: v for k, v in (extra or {}).items() if k != "loops"}',
       f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("fabric_save_path_per_rank", "Fabric's save uses each rank's own path (no broadcast from rank 0)",
       _LIGHTNING, "    path = os.path.abspath(strategy.broadcast(os.fspath(path)))", "    path = os.path.abspath(os.fspath(path))",
       f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m("pipeline_syncs_every_microbatch", "the pipelined stage reduces every micro-batch's gradients",
       f"{PACKAGE}/integrations/pipelining.py", "            m.set_requires_gradient_sync(False, recurse=False)",
       "            m.set_requires_gradient_sync(True, recurse=False)",
       "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"),
    _m("pipeline_step_never_reduced", "the pipelined stage's end of step does not reduce the accumulated sum",
       f"{PACKAGE}/integrations/pipelining.py", "            m.reduce_accumulated_gradients()",
       "            pass",
       "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"),
    _m("pipeline_zero_bubble_allowed", "zero-bubble schedules are built over replicated stages",
       _PIPELINING, '_SPLIT_SCHEDULE_INITS = {f"{name}.__init__": name', '_SPLIT_SCHEDULE_INITS = {f"{name}.__call__": name',
       f"{_PP}[schedules0-zero_bubble0]"),
    # issue 54: every FSDP2 argument and method checked for its effect; Muon names what differs
    _m('fsdp2_reduce_dtype_is_param_dtype', "mp_policy's reduce_dtype replaced by its param_dtype: gradients reduced in bf16",
       _FSDP2_COMPAT, '    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,',
       '    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.param_dtype,', _FSDP2_ARGS),
    _m('fsdp2_hsdp_reshard_after_forward_inverted', 'reshard_after_forward on a 2-D mesh maps True to the strategy that keeps',
       _FSDP2_COMPAT, '            out["strategy"] = ShardingStrategy.HYBRID_SHARD if raf else ShardingStrategy._HYBRID_SHARD_ZERO2',
       '            out["strategy"] = ShardingStrategy._HYBRID_SHARD_ZERO2 if raf else ShardingStrategy.HYBRID_SHARD', _FSDP2_ARGS),
    _m('fsdp2_reshard_after_forward_inverted', 'reshard_after_forward on a 1-D mesh maps True to SHARD_GRAD_OP',
       _FSDP2_COMPAT, '            out["strategy"] = ShardingStrategy.FULL_SHARD if raf else ShardingStrategy.SHARD_GRAD_OP',
       '            out["strategy"] = ShardingStrategy.SHARD_GRAD_OP if raf else ShardingStrategy.FULL_SHARD', _FSDP2_ARGS),
    _m('fsdp2_hsdp_default_keeps', 'FSDP2 on a 2-D mesh without reshard_after_forward keeps parameters after forward',
       _FSDP2_COMPAT, '        out["strategy"] = ShardingStrategy.HYBRID_SHARD  # FSDP2 on a 2-D mesh is HSDP',
       '        out["strategy"] = ShardingStrategy._HYBRID_SHARD_ZERO2  # FSDP2 on a 2-D mesh is HSDP', _FSDP2_ARGS),
    _m('fsdp2_output_dtype_ignored', "mp_policy's output_dtype is silently ignored",
       _FSDP2_COMPAT, '    if policy.output_dtype is not None:',
       '    if False:', _FSDP2_ARGS),
    _m('fsdp2_cast_forward_inputs_inverted', "mp_policy's cast_forward_inputs inverted",
       _FSDP2_COMPAT, 'cast_root_forward_inputs=bool(policy.cast_forward_inputs),',
       'cast_root_forward_inputs=not policy.cast_forward_inputs,', _FSDP2_ARGS),
    _m('fsdp2_param_dtype_dropped', "mp_policy's param_dtype dropped: compute in full precision",
       _FSDP2_COMPAT, '    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,',
       '    return MixedPrecision(param_dtype=None, reduce_dtype=policy.reduce_dtype,', _FSDP2_ARGS),
    _m('fsdp2_offload_ignored', 'offload_policy=CPUOffloadPolicy() keeps the shards on the device',
       _FSDP2_COMPAT, '        return CPUOffload(offload_params=True)',
       '        return CPUOffload(offload_params=False)', _FSDP2_ARGS),
    _m('fsdp2_ignored_params_sharded', 'ignored_params are sharded anyway',
       _FSDP2_COMPAT, '        out["ignored_states"] = list(ignored)',
       '        out["ignored_states"] = None', _FSDP2_ARGS),
    _m('fsdp2_hsdp_dims_swapped', "a 2-D mesh's replicate and shard dimensions swapped",
       _INIT, '        return mesh.get_group(1), mesh.get_group(0)',
       '        return mesh.get_group(0), mesh.get_group(1)', _FSDP2_ARGS),
    _m('fsdp2_divide_factor_recursive', "set_gradient_divide_factor on the root changes every module's division (FSDP2's does not)",
       _FSDP2_COMPAT, '        self._fsdp_state().gradient_divide_factor = value',
       '        [setattr(s, "gradient_divide_factor", value) for s in self._states(True)]', _FSDP2_ARGS),
    _m('fsdp2_deprecated_divide_name_silent', "set_reduce_scatter_divide_factor does not warn as FSDP2's does",
       _FSDP2_COMPAT, '        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)',
       '        pass', _FSDP2_ARGS),
    _m('fsdp2_backward_prefetch_as_forward', 'set_modules_to_backward_prefetch sets the forward prefetch',
       _FSDP2_COMPAT, '        self._fsdp_state().backward_prefetch_states = self._prefetch_states("set_modules_to_backward_prefetch", modules)',
       '        self._fsdp_state().forward_prefetch_states = self._prefetch_states("set_modules_to_backward_prefetch", modules)', _FSDP2_ARGS),
    _m('fsdp2_unshard_method_noop', 'FSDPModule.unshard() gathers nothing',
       _FULLY_SHARD, '            issue_unshard(state, state.handle)',
       '            pass', _FSDP2_ARGS),
    _m('fsdp2_reshard_method_noop', 'FSDPModule.reshard() frees nothing',
       _FULLY_SHARD, '            state.handle.reshard(free=True)',
       '            pass', _FSDP2_ARGS),
    _m('muon_difference_unnamed', "Muon's cross-rank refusal does not name what differs",
       _OPTIM, '            raise RuntimeError(_plans_differ(api, applied, layout(planned[0]), group, tag)) from None',
       '            raise e', _MUON_AGREE2),
    _m('muon_settings_not_agreed', "Muon's ranks never compare their param groups' settings",
       _OPTIM, '        [["setting", i, k, _plain(g[k])] for i, g in enumerate(param_groups) for k in settings] + \\',
       '        [] + \\', _MUON_AGREE2),
    _m('muon_differing_ranks_inverted', "Muon's refusal names the ranks that agree with rank 0",
       _OPTIM, '    differing = [rank for rank, layout in zip(ranks, everyone) if entry(layout, k) != entry(everyone[0], k)]',
       '    differing = [rank for rank, layout in zip(ranks, everyone) if entry(layout, k) == entry(everyone[0], k)]', _MUON_AGREE4),
    _m('muon_setting_unnamed', "Muon's refusal says 'settings' without naming the one that differs",
       _OPTIM, '        return f"param group {value[0]}\'s {value[1]}={value[2]}"',
       '        return f"param group {value[0]}\'s settings"', _MUON_AGREE2),
    # issue 54: the pipelined step leaves every module as a plain step does; torch's own stage refused by names
    _m("pipeline_reshard_setting_overwritten", "each micro-batch overwrites the recorded setting: blocks stay unsharded",
       _PIPELINING, "            saved.setdefault(id(state), (state, state.reshard_after_backward))",
       "            saved[id(state)] = (state, state.reshard_after_backward)", f"{_PP}[schedules0-zero_bubble0]", f"{_PP}[schedules1-zero_bubble1]"),
    _m("pipeline_first_setting_restored_only", "only the first module's reshard setting is restored after a step",
       _PIPELINING, 'for state, value in self.__dict__.pop("_cs_reshard_after_backward", {}).values():',
       'for state, value in list(self.__dict__.pop("_cs_reshard_after_backward", {}).values())[:1]:', f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_reshard_restored_true", "a user's set_reshard_after_backward(False) is lost after a pipelined step",
       _PIPELINING, "state.reshard_after_backward = value  # as configured",
       "state.reshard_after_backward = True  # as configured", f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_replicated_sync_left_off", "replicated stage modules are left with gradient sync off after a step",
       _PIPELINING, "            r.set_requires_gradient_sync(True)", "            r.set_requires_gradient_sync(False)",
       f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_first_outermost_reduced_only", "only the first outermost fully sharded module reduces at the end of a step",
       _PIPELINING, "        for m in outermost:", "        for m in outermost[:1]:", f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_torch_stage_first_forward_allowed", "torch's own stage runs a fully sharded module's first forward",
       _PIPELINING, "        return not subject.__dict__.get(_DRIVEN, False)", "        return False", f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_stage_marks_nothing", "our stage does not mark its modules: its own first forward is refused",
       _PIPELINING, "            module.__dict__[_DRIVEN] = True", "            pass", f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_torch_stage_last_backward_allowed", "torch's stage turns sync off on a module whose first forward ran",
       _PIPELINING, "        return any(f.name in _TORCH_STAGE_FSDP_SEAMS for f in functions)", "        return False",
       f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_split_backward_allowed", "a split (input/weight) backward runs over replicated modules",
       _PIPELINING, '        if backward_type != "full" and replicated:', "        if False:", f"{_PP}[schedules0-zero_bubble0]"),
    _m("pipeline_traverse_point_misnamed", "the zero-bubble check never sees the schedule's walk of the stages",
       _PIPELINING, '    if point == "traverse":', '    if point == "traversal":', f"{_PP}[schedules0-zero_bubble0]"),
    # issue 54: two tensor-parallel mesh dimensions splitting one tensor dimension; TP under unshard_params
    _m("tp_2d_offset_assigned", "a piece's offset along a dimension two mesh dims split is assigned, not accumulated",
       _PIECES, "        offsets[d] += start", "        offsets[d] = start", _FS_TP_2D),
    _m("tp_2d_coordinate_of_first_dim", "every mesh dim takes the first dim's coordinate for the piece's offset",
       _PIECES, "mesh.size(i), coordinate[i]", "mesh.size(i), coordinate[0]", _FS_TP_2D),
    _m("tp_2d_dims_reversed", "the mesh dims splitting one tensor dim applied in reverse order",
       _PIECES, "for i, placement in enumerate(placements):",
       "for i, placement in reversed(list(enumerate(placements))):", _FS_TP_2D),
    _m("tp_2d_norm_over_first_dim_only", "a piece's norm completed over the first mesh dim that shards it only",
       _PIECES, "for i, p in enumerate(piece.placements) if isinstance(p, Shard)]",
       "for i, p in enumerate(piece.placements) if isinstance(p, Shard)][:1]", _FS_TP_2D),
    _m("tp_unshard_params_plain_piece", "unshard_params shows a tensor-parallel parameter as its plain local piece",
       _UNSHARD, "    item.shown = _show_pieces(item.group)\n", "", _FS_TP_2D, _FS_TP),
    _m("tp_unshard_params_other_placements", "unshard_params shows a piece with another parameter's placements",
       _UNSHARD, "dtensor = nn.Parameter(as_dtensor(piece, p.data)",
       "dtensor = nn.Parameter(as_dtensor(next(q for q in fp._pieces if q is not None), p.data)", _FS_TP_2D),
    _m("tp_unshard_params_slot_kept", "after unshard_params a tensor-parallel slot still holds the DTensor",
       _UNSHARD, "        set_module_tensor(info.module, info.param_name, p)\n", "        pass\n", _FS_TP_2D),
    _m("plan_frozen_replicated_free", "plan counts nothing for frozen parameters replicate leaves whole",
       f"{PACKAGE}/plan.py", "    return _Cost(row, 0, 0, sum(p.numel() * p.dtype.itemsize for p in trained), largest, 0, frozen)",
       "    return _Cost(row, 0, 0, sum(p.numel() * p.dtype.itemsize for p in trained), largest, 0, 0)",
       "tests/unit/test_plan.py::test_frozen_parameters_under_replicate_are_counted"),
    _m("divide_factor_ignored", "set_gradient_divide_factor(1.0) is stored but reductions still average",
       f"{PACKAGE}/_runtime/module_state.py",
       "        return float(self.dp_world_size) if self.gradient_divide_factor is None else self.gradient_divide_factor",
       "        return float(self.dp_world_size)", _DROPIN),
    _m("group_frees_before_last_member", "a group of modules reshards after its first member's forward",
       _RUNTIME, "        handle.reshard(free=(frees_after_forward(state) or not needs_backward) and not others_pending)",
       "        handle.reshard(free=(frees_after_forward(state) or not needs_backward))", _DROPIN),
    _m("reshard_after_forward_method_ignored", "set_reshard_after_forward(False) changes nothing",
       _FSDP2, "            s.reshard_after_forward = s.root_reshards_after_forward = reshard_after_forward",
       "            pass", _DROPIN),
    _m("chosen_prefetch_ignored", "set_modules_to_forward_prefetch gathers nothing early",
       _RUNTIME, "        _prefetch_chosen(state.forward_prefetch_states, for_forward=True)",
       "        pass", _DROPIN),
    _m("init_values_wrong_chunk", "to_empty's init lands every rank's first chunk in its shard",
       _FLAT, "                group.flat_param.data.copy_(full.view(self.world_size, -1)[self.rank])",
       "                group.flat_param.data.copy_(full.view(self.world_size, -1)[0])", _DROPIN),
    _m("deferred_forward_allowed", "a model sharded uninitialized on meta trains on garbage",
       _RUNTIME, "        if s.awaiting_init:\n            _raise_awaiting_init(s)", "        if False:\n            _raise_awaiting_init(s)",
       _DROPIN, "tests/distributed/test_fully_shard_errors.py::test_errors_are_clear_and_leave_the_model_unchanged"),
    # issue 54: ten bugs seeded by a stranger (a helper that wrote none of the tests), each with a probe showing what
    # a user gets wrong; selections: every test file that exercises the module (tests/README.md: before/after)
    _m('stranger_latest_checkpoint_matches_unfinished', 'latest_checkpoint returns an unfinished (.tmp-) save: a resume starts from a half-written directory',
       f"{PACKAGE}/_state/checkpoint_files.py", 'if (m := _STEP_DIR.fullmatch(name))',
       'if (m := _STEP_DIR.match(name))', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_checkpoint_faults.py', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_examples.py', 'tests/unit', 'tests/distributed/test_lightning.py', 'tests/distributed/test_hf_trainer.py'),
    _m('stranger_failed_load_empties_optimizer_state', 'a refused optimizer load wipes the AdamW state instead of restoring it',
       f"{PACKAGE}/_state/load_transaction.py", 'entries = [(p, entry, dict(entry)) for p, entry in optim.state.items()]',
       'entries = [(p, entry, entry) for p, entry in optim.state.items()]', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_checkpoint_faults.py', 'tests/distributed/test_state_dict_ownership.py', 'tests/distributed/test_muon.py'),
    _m('stranger_loaded_step_shared_with_state_dict', 'two optimizers loaded from one state dict share their step tensor',
       f"{PACKAGE}/_state/optim_state_dict.py", "return value.detach().clone()  # torch's loader keeps a step's dtype and device",
       "return value.detach()  # torch's loader keeps a step's dtype and device", 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_state_dict_ownership.py', 'tests/distributed/test_lightning.py', 'tests/distributed/test_hf_trainer.py'),
    _m('stranger_layout_check_passes_if_any_rank_matches', 'ranks that built different handles are not refused at lazy init when any rank matches',
       f"{PACKAGE}/_runtime/agreement.py", 'if all(theirs == words for theirs in everyone):',
       'if any(theirs == words for theirs in everyone):', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_fully_shard_errors.py', 'tests/distributed/test_two_models.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('stranger_first_bucket_not_small', "replicate's first bucket is not the small one: no overlap early in backward",
       f"{PACKAGE}/replicate.py", 'min(state.bucket_cap_bytes, _FIRST_BUCKET_BYTES)',
       'max(state.bucket_cap_bytes, _FIRST_BUCKET_BYTES)', 'tests/distributed/test_replicate.py', 'tests/distributed/test_replicate_first_bucket.py', 'tests/unit/test_describe.py', 'tests/distributed/test_collective_budget.py'),
    _m('stranger_policy_forgets_claims_of_earlier_children', 'a size-based wrap policy forgets what earlier children claimed: extra targets, more all-gathers',
       f"{PACKAGE}/wrap.py", 'claimed |= visit(child)',
       'claimed = visit(child)', 'tests/unit/test_wrap.py', 'tests/distributed/test_fully_shard_composable.py', 'tests/distributed/test_compose.py', 'tests/distributed/test_hf_models.py'),
    _m('stranger_grad_attached_by_local_use_only', 'a parameter used only on another rank gets no .grad here: its shard is not updated',
       f"{PACKAGE}/_runtime/flat_param.py", '(group.had_grad[i] or used[i])',
       '(group.had_grad[i] or group.used[i])', 'tests/distributed/test_fully_shard_lifecycle.py::test_parameters_without_gradient_keep_grad_none', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_data_parallel_shared.py'),
    _m('stranger_accelerator_clips_subset_by_whole_norm', 'ShardedAccelerator.clip_grad_norm_ of a subset clips the whole model by the whole norm',
       f"{PACKAGE}/integrations/transformers.py", 'if ids == own:',
       'if ids <= own:', 'tests/distributed/test_hf_trainer.py', 'tests/distributed/test_hf_models.py'),
    _m('stranger_muon_default_not_nesterov', "Muon's default nesterov differs from torch.optim.Muon's",
       f"{PACKAGE}/optim.py", 'momentum: float = 0.95, nesterov: bool = True,',
       'momentum: float = 0.95, nesterov: bool = False,', 'tests/distributed/test_muon.py', 'tests/distributed/test_muon_agreement.py'),
    _m('stranger_shard_grad_op_keeps_params_after_backward', 'SHARD_GRAD_OP keeps unsharded parameters after backward',
       f"{PACKAGE}/_setup/fully_shard_init.py", 'state.reshard_after_backward = cfg["strategy"] is not ShardingStrategy.NO_SHARD',
       'state.reshard_after_backward = cfg["strategy"] in _FREES_AFTER_FORWARD', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_memory.py', 'tests/distributed/test_fsdp2_arguments.py', 'tests/distributed/test_fsdp2_dropin.py'),
    # issue 54, second round: ten bugs seeded by a stranger in the code of issues 42-47, each with a probe under
    # /tmp/stranger2/ showing what a user gets wrong; selections: every test file that exercises the code
    _m('stranger2_pieces_floor_chunk', "a tensor-parallel piece's box uses floor division: uneven Shard pieces are refused by fully_shard (and their boxes misplaced)",
       f"{PACKAGE}/_base/pieces.py", 'chunk = -(-sizes[d] // n) if sizes[d] else 0',
       'chunk = sizes[d] // n if sizes[d] else 0', 'tests/distributed/test_fully_shard_tensor_parallel.py', 'tests/distributed/test_tensor_parallel.py', 'tests/distributed/test_clip_grad_norm.py', 'tests/unit/test_describe.py'),
    _m('stranger2_mp_policy_needs_both_dtypes', "FSDP2's MixedPrecisionPolicy(param_dtype=bf16) without reduce_dtype is dropped: the model computes in float32",
       f"{PACKAGE}/_setup/fsdp2_compat.py", 'if policy.param_dtype is None and policy.reduce_dtype is None:',
       'if policy.param_dtype is None or policy.reduce_dtype is None:', 'tests/distributed/test_fsdp2_dropin.py', 'tests/distributed/test_fsdp2_arguments.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py', 'tests/distributed/test_fully_shard_training.py'),
    _m('stranger2_pp_replicated_syncs_every_microbatch', 'a replicated pipeline stage all-reduces its gradients on every micro-batch instead of once per step',
       f"{PACKAGE}/integrations/pipelining.py", 'r.set_requires_gradient_sync(last_backward)',
       'r.set_requires_gradient_sync(True)', 'tests/distributed/test_pipelining.py', 'tests/distributed/test_replicate.py', 'tests/distributed/test_collective_budget.py'),
    _m('stranger2_fabric_load_nonstrict_refuses_missing', 'fabric.load(..., strict=False) raises KeyError for a requested key the checkpoint does not hold',
       f"{PACKAGE}/integrations/lightning.py", 'if strict and missing:',
       'if missing:', 'tests/distributed/test_lightning.py', 'tests/distributed/test_state_dict.py'),
    _m('stranger2_plan_mp_needs_buffer_dtype', 'plan ignores MixedPrecision(param_dtype=bf16) without buffer_dtype: activations measured in float32 (twice the bytes)',
       f"{PACKAGE}/_planning/plan_profile.py", 'if mp is None or (mp.param_dtype is None and mp.buffer_dtype is None):',
       'if mp is None or (mp.param_dtype is None or mp.buffer_dtype is None):', 'tests/unit/test_plan_fake.py', 'tests/unit/test_plan.py', 'tests/unit/test_plan_search.py', 'tests/distributed/test_plan.py', 'tests/distributed/test_plan_peak.py'),
    _m('stranger2_clip_piece_over_replicated_dims', 'clip_grad_norm_ of a tensor-parallel gradient sums Replicate pieces over the tp ranks too: norm too large, over-clipping',
       f"{PACKAGE}/_runtime/interop.py", 'groups = [placed.device_mesh.get_group(i) for i, p in enumerate(placed.placements) if p.is_shard()]',
       'groups = [placed.device_mesh.get_group(i) for i, p in enumerate(placed.placements)]', 'tests/distributed/test_tensor_parallel.py', 'tests/distributed/test_fully_shard_tensor_parallel.py', 'tests/distributed/test_clip_grad_norm.py', 'tests/distributed/test_fully_shard_runtime.py'),
    _m('stranger2_muon_lr_adjust_cols_over_rows', "Muon's default lr adjustment uses cols/rows: wide matrices step sqrt(cols/rows) too far, tall ones too short",
       f"{PACKAGE}/optim.py", 'return lr * math.sqrt(max(1.0, rows / cols))',
       'return lr * math.sqrt(max(1.0, cols / rows))', 'tests/distributed/test_muon.py', 'tests/distributed/test_muon_agreement.py'),
    _m('stranger2_full_state_dict_regathers_per_param', "a full state dict drops a flat group's gathered buffer after its first parameter: one all-gather per parameter",
       f"{PACKAGE}/_state/model_state_dict.py", 'if all((id(m.group), i) in session.values for i in range(len(fp._numels))):',
       'if any((id(m.group), i) in session.values for i in range(len(fp._numels))):', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py', 'tests/distributed/test_state_dict_ownership.py', 'tests/distributed/test_collective_budget.py', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_fully_shard_tensor_parallel.py'),
    _m('stranger2_describe_adamw_counts_frozen', 'describe counts AdamW state for frozen parameters of replicate / unmanaged rows',
       f"{PACKAGE}/_planning/describe.py", 'adamw = sum(2 * here[id(p)] * _itemsize(p.dtype) + STEP_BYTES for p in trained)',
       'adamw = sum(2 * here[id(p)] * _itemsize(p.dtype) + STEP_BYTES for p in params)', 'tests/unit/test_describe.py', 'tests/distributed/test_replicate.py', 'tests/distributed/test_tensor_parallel.py', 'tests/distributed/test_collective_budget.py', 'tests/unit/test_plan.py'),
    _m('stranger2_replicate_buckets_by_global_numel', "replicate sizes its buckets by a tensor-parallel parameter's global numel: buckets close early, more all-reduces",
       f"{PACKAGE}/replicate.py", 'nbytes += local_piece(p).numel() * (state.reduce_dtype or p.dtype).itemsize',
       'nbytes += p.numel() * (state.reduce_dtype or p.dtype).itemsize', 'tests/distributed/test_tensor_parallel.py', 'tests/distributed/test_replicate.py', 'tests/distributed/test_replicate_first_bucket.py', 'tests/unit/test_describe.py', 'tests/distributed/test_collective_budget.py'),
    # neighbours of the three above, caught by the tests written for them
    _m('stranger2_neighbour_fabric_optimizer_keys_ignore_strict', 'fabric.load(..., strict=False) refuses optimizers saved under other keys (in the same order)',
       f"{PACKAGE}/integrations/lightning.py", 'if strict and saved and [k for k, _ in optimizers] != saved.get("optimizers"):',
       'if saved and [k for k, _ in optimizers] != saved.get("optimizers"):', f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m('stranger2_neighbour_fabric_load_stops_at_missing_key', 'fabric.load(..., strict=False) stops at the first requested key the checkpoint lacks: the keys after it are not loaded',
       f"{PACKAGE}/integrations/lightning.py", 'if key not in extra:\n                continue',
       'if key not in extra:\n                break', f"{_LIGHTNING_TESTS}::test_fabric_matches_a_local_loop_and_resumes"),
    _m('stranger2_neighbour_describe_grads_for_frozen', 'describe counts gradient bytes for frozen parameters of replicate / unmanaged rows',
       f"{PACKAGE}/_planning/describe.py", 'grad_bytes = bucket_bytes + (0 if grads_are_buckets else sum(here[id(p)] * _itemsize(p.dtype) for p in trained))',
       'grad_bytes = bucket_bytes + (0 if grads_are_buckets else sum(here[id(p)] * _itemsize(p.dtype) for p in params))', 'tests/unit/test_describe.py', _TP_REPLICATE_TESTS),
    _m('stranger2_neighbour_replicate_bucket_closes_above_cap', 'a replicate bucket closes only above its cap, not at it: one parameter more per bucket',
       f"{PACKAGE}/replicate.py", 'if nbytes >= (state.bucket_cap_bytes if closed else min(state.bucket_cap_bytes, _FIRST_BUCKET_BYTES)):',
       'if nbytes > (state.bucket_cap_bytes if closed else min(state.bucket_cap_bytes, _FIRST_BUCKET_BYTES)):', _TP_REPLICATE_TESTS),
    # issue 55: 2-D from the meta device; the initial weights and the global RNG
    _m("meta_rng_not_given_back", "to_empty never gives back fully_shard's reset_parameters() draws (the init after it draws other numbers)",
       f"{PACKAGE}/fully_shard.py", "        _init_draws.give_back_draws(self)  # see", "        pass  # see",
       f"{_META_INIT}", _FS_TP_META),
    _m("meta_rng_chain_restarts", "consecutive calls' draws not chained: to_empty gives back only the last call's",
       f"{PACKAGE}/_setup/init_draws.py", "        if _record is None or not _same(_record.after, self.before):",
       "        if True:", f"{_META_INIT}", _FS_TP_META),
    _m("meta_rng_given_back_after_a_draw", "the draws given back although something drew since (that draw repeats, silently)",
       f"{PACKAGE}/_setup/init_draws.py",
       "    if len(mine) == len(record.modules) and _same(record.after, _states(_device(record))):",
       "    if len(mine) == len(record.modules):", f"{_META_INIT}"),
    _m("meta_tp_piece_initialized_as_whole", "a meta DTensor's reset_parameters() runs on the DTensor (each tp piece the same draws, fans of the piece)",
       _INIT, "                    empty = torch.empty(t.shape, dtype=t.dtype, device=plan.compute_device) if isinstance(",
       "                    empty = _empty_on(t, plan.compute_device) if isinstance(", _FS_TP_META),
    _m("meta_tp_piece_of_whole_offset", "the piece kept from a whole tensor-parallel init is the first rank's",
       f"{PACKAGE}/_base/pieces.py", "    index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))",
       "    index = tuple(slice(0, s) for o, s in zip(piece.offsets, piece.sizes))", _FS_TP_META, _FS_TP_2D),
    _m("meta_tp_to_empty_piece_not_taken", "after to_empty + init, a tensor-parallel parameter's piece is not taken from the whole tensor",
       _FLAT, "                        piece.view(shape).copy_(take_piece(tp, p.data))",
       "                        pass", _FS_TP_META),
    _m("meta_tp_deferred_local_shape", "a deferred meta DTensor materialized with its global shape as its local piece",
       _INIT, "        local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)",
       "        local = torch.empty(t.shape, dtype=t.dtype, device=device)", _FS_TP_META),
    # issue 55: zero-bubble schedules over fully sharded stages (weight passes), stages built before fully_shard
    _m("zb_weight_pass_grads_dropped", "a completed weight pass's gradients dropped (the weight gradients never reach the reduction)",
       _RUNTIME, "        if not completed:", "        if True:", _PP_ZB),
    _m("zb_weight_pass_asks_shard_views", "the weight pass asks the 1-D shard views for gradients (the forward never used them)",
       _PIPELINING, "self.submod = _PlainView(plain, self._computed_on(sharded))", "self.submod = _PlainView(plain, None)", _PP_ZB),
    _m("zb_weight_pass_reduces_each_pass", "each weight pass reduce-scatters its gradients at once (a reduction per micro-batch)",
       _RUNTIME, "handle.keep_unreduced(group, unsharded_grad, handle.reduce_dtype(group))  # type: ignore[arg-type]  # not None: checked above",
       "handle.reduce(group, unsharded_grad)  # type: ignore[arg-type]", _PP_ZB),
    _m("zb_pre_backward_left_off", "after a weight pass the handle's pre-backward stays off (the next input pass runs on freed storage)",
       _RUNTIME, "    handle.needs_pre_backward = True\n\n\ndef finish_reductions", "    handle.needs_pre_backward = False\n\n\ndef finish_reductions", _PP_ZB),
    _m("pp_stage_not_marked_at_first_forward", "a stage built before fully_shard (torchtitan's order) is not marked at its first forward",
       _PIPELINING, "        _MarkAtFirstForward(self.submod)", "        None", _PP_ZB),
    _m("zb_replicate_check_on_sharded", "the zero-bubble refusal checks fully sharded modules instead of replicated ones",
       _PIPELINING, "        if isinstance(subject, ReplicateModule):", "        if isinstance(subject, FSDPModule):", _PP_ZB),
    _m("zb_weight_pass_by_last_backward", "the weight pass recognised by last_backward instead of the backward type",
       _PIPELINING, 'weight_pass = backward_type == "weight"', "weight_pass = last_backward", _PP_ZB, f"{_PP}[schedules0-zero_bubble0]"),
    _m("pp_grouped_state_twice", "a group (fully_shard([norm, head])) driven twice per weight pass by the stage",
       _PIPELINING, "                       and id(m._fsdp_state()) not in states and not states.add(id(m._fsdp_state()))]",
       "                       and True]", _TITAN_PARALLEL),
    # issue 55: asynchronous checkpoints (torch's stager over ShardedSlice; save_checkpoint_async)
    _m("async_slice_new_empty_refused", "ShardedSlice refuses the stager's new_empty (dcp.async_save raises, as before)",
       _SLICE, "        if func is torch.ops.aten.new_empty.default:  # see [Note: Staged copies]",
       "        if False:  # see [Note: Staged copies]", _ASYNC),
    _m("async_slice_start_lost_in_process", "a slice sent to DCP's checkpoint process loses its start",
       _SLICE, "(value.local, value.start, tuple(value.shape)", "(value.local, 0, tuple(value.shape)", _ASYNC),
    _m("async_slice_piece_lost_in_process", "a tensor-parallel slice sent to DCP's checkpoint process loses its piece",
       _SLICE, "value.start, tuple(value.shape), value.world_size, value.piece)",
       "value.start, tuple(value.shape), value.world_size, None)", _ASYNC),
    _m("async_slice_pickled_plain", "slices travel to the checkpoint process as plain per-rank tensors",
       _SLICE, "ForkingPickler.register(ShardedSlice, _reduce_for_another_process)", "None", _ASYNC),
    _m("async_staging_aliases_live_state", "the staging copy aliases the live state: a step during the save leaks in",
       _ASYNC_FILE, 'copies[key] = tensor.detach().to("cpu", copy=True)', "copies[key] = tensor.detach()", _ASYNC),
    _m("async_extra_not_copied", "extra state is not copied at the call: later changes reach the checkpoint",
       _ASYNC_FILE, "    return copy.deepcopy(value, memo)", "    return value", _ASYNC),
    _m("async_staging_bytes_without_scalars", "staging bytes leave out 0-dim tensors (the optimizer steps)",
       _ASYNC_FILE, "staging_bytes = sum(t.untyped_storage().nbytes() for t in copies.values())",
       "staging_bytes = sum(t.untyped_storage().nbytes() for t in copies.values() if t.dim() > 0)", _ASYNC),
    _m("async_write_failure_not_agreed", "a write failing on one rank is not agreed: the others publish or wait",
       _ASYNC_FILE, "    agree_or_raise(error, _API, group)", "    pass", _ASYNC),
    _m("async_publication_verdict_not_shared", "rank 0's publication verdict is not broadcast: the others report success",
       _ASYNC_FILE, "    verdict = from_rank(verdict, 0, group)", "    pass", _ASYNC),
    _m("async_published_before_extra", "published before extra is written (a crash leaves a checkpoint without it)",
       _ASYNC_FILE, "verdict = _write_bytes(os.path.join(tmp, EXTRA), extra) or _publish(tmp, path)",
       "verdict = _publish(tmp, path) or _write_bytes(os.path.join(path, EXTRA), extra)", _ASYNC),
    _m("async_error_reported_as_success", "the background error is swallowed: result() returns",
       _ASYNC_FILE, "            self._future.set_exception(e)", "            self._future.set_result(None)", _ASYNC),
    _m("async_staging_failure_not_agreed", "a staging failure on one rank is not agreed at the call",
       _ASYNC_FILE, "    agree_or_raise(staging_error, _API)", "    pass", _ASYNC),
    _m("async_slice_new_empty_moves_passed_dict", "the stager's new_empty returns the slice itself: the dict handed to dcp.async_save is moved onto the copy",
       _SLICE, "            return self.with_local(self.local.new_empty(self.local.shape, **(kwargs or {})))",
       "            return self", _ASYNC),
    # torch's checkpoint_wrapper (selective activation checkpointing) around fully sharded blocks
    _m("sac_recompute_extra_profiler_range", "the recomputation opens a profiler range of its own (selective checkpointing counts it: refused)",
       _RUNTIME, "def _pre_recompute(state: _FSDPState, args", '@_profiled("cs::pre_recompute")\ndef _pre_recompute(state: _FSDPState, args',
       _AC_WAYS),
    _m("zb_recompute_in_weight_pass_unseen", "a checkpoint_wrapper recomputation inside a weight pass is taken for a forward",
       _RUNTIME, "    return (root is not None and root.ctx.final_callback_queued) or in_weight_pass",
       "    return root is not None and root.ctx.final_callback_queued", _PP_ZB),
    _m("zb_recompute_state_not_recomputing", "a second recomputation in a weight pass (handle RECOMPUTE) is taken for a forward",
       _RUNTIME, "HandleTrainingState.RECOMPUTE)\n    return (root", "HandleTrainingState.BACKWARD_PRE)\n    return (root", _PP_ZB),
    # planted by an independent reviewer who read the library's newest code and none of the tests (2026-11-28)
    _m('st_agreement_any_used_skips_wait', "When this rank left some parameter without a gradient but used another, the end-of-backward agreement returns this rank's own flags instead of waiting for the others', so a parameter used only on another rank keeps .grad=None (or an unaveraged gradient) here: wrong gradients and diverging ranks.",
       'composable_shard/_runtime/agreement.py', '    if all(values[:n]):',
       '    if any(values[:n]):', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_fully_shard_divergence.py'),
    _m('st_attach_reduced_grads_drops_step_verdicts', "fully_shard never reads the previous synced backward's step verdicts, so an optimizer step skipped on some ranks (e.g. torch.amp.GradScaler) no longer raises at the following synced backward: ranks silently drift.",
       'composable_shard/_runtime/hooks.py', '    disagreement = take_step_verdicts(root) if batches else None',
       '    disagreement = None', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_fully_shard_mixed_precision.py'),
    _m('st_replicate_previous_verdict_never_read', "replicate drops the previous sync's step verdict unread, so ranks that took different numbers of optimizer steps are never reported and replicas drift silently.",
       'composable_shard/replicate.py', '        steps_disagree = previous.disagreement() if previous is not None else None',
       '        steps_disagree = None', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_replicate.py'),
    _m('st_group_facts_cached_under_world_key', "Every process group shares one cache entry, so the first group's size/backend is reported for all: under HSDP/2-D a subgroup of size 1 cached first makes world collectives skipped as single-rank (or vice versa), giving wrong parameters/gradients or mismatched collectives.",
       'composable_shard/_runtime/collectives.py', '    key = group if group is not None else dist.group.WORLD',
       '    key = dist.group.WORLD', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_fully_shard_tensor_parallel.py', 'tests/distributed/test_compose.py'),
    _m('st_group_facts_world_size_of_default_group', "A subgroup's size is taken from the default group, so collectives on single-rank subgroups (HSDP replicate/shard groups, 2-D meshes) are no longer skipped and exchange/all_gather_json size buffers by the world size: errors or wrong agreement results under HSDP and recorders report wrong group sizes.",
       'composable_shard/_runtime/collectives.py', '        facts = (dist.get_world_size(group), str(dist.get_backend(group)))',
       '        facts = (dist.get_world_size(), str(dist.get_backend(group)))', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_fully_shard_tensor_parallel.py', 'tests/distributed/test_compose.py'),
    _m('st_profiler_ranges_only_without_profiler', 'The cs::pre_forward/cs::post_backward profiler ranges are opened only when no profiler runs (paying the per-range cost every step) and are missing from torch.profiler traces.',
       'composable_shard/_runtime/hooks.py', '            if not profiler_enabled():',
       '            if profiler_enabled():', 'tests/distributed/test_host_reads.py'),
    _m('st_recomputing_requires_both_callback_and_weight_pass', 'An activation-checkpointing recomputation inside an ordinary backward is no longer recognised (the handle is not in a weight pass), so it runs as a fresh forward: state errors or wrong gradients with checkpointed fully sharded blocks.',
       'composable_shard/_runtime/hooks.py', '    return (root is not None and root.ctx.final_callback_queued) or in_weight_pass',
       '    return (root is not None and root.ctx.final_callback_queued) and in_weight_pass', 'tests/distributed/test_activation_checkpointing.py'),
    _m('st_weight_pass_state_backward_post', 'Inside a zero-bubble weight pass (handle BACKWARD_PRE, no root callback) a checkpoint_wrapper recomputation is taken for a forward, so selective activation checkpointing under ZB schedules fails or computes wrong weight gradients.',
       'composable_shard/_runtime/hooks.py', '    in_weight_pass = handle is not None and handle.training_state in (HandleTrainingState.BACKWARD_PRE,',
       '    in_weight_pass = handle is not None and handle.training_state in (HandleTrainingState.BACKWARD_POST,', 'tests/distributed/test_pipelining.py'),
    _m('st_async_copy_key_ignores_storage_offset', "Two equally sized parameters sharing one flat shard (e.g. two biases) get the same staging copy, so save_checkpoint_async writes the first one's values under both names: a wrong checkpoint.",
       'composable_shard/_state/async_checkpoint.py', '    key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),',
       '    key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),', 'tests/distributed/test_async_checkpoint.py'),
    _m('st_async_staging_aliases_live_slice', "Sharded parameters are not copied at the call, so the background write sees training's later updates: the async checkpoint holds a later (or torn) state instead of the state at save_checkpoint_async.",
       'composable_shard/_state/async_checkpoint.py', '        return value.with_local(_copied(value.local, copies))',
       '        return value.with_local(value.local)', 'tests/distributed/test_async_checkpoint.py'),
    _m('st_sharded_slice_rebuilt_at_offset_zero', "A ShardedSlice sent to DCP's checkpoint process (async_save with AsyncCheckpointerType.PROCESS) loses its start offset, so every rank writes its elements at offset 0: a wrong/overlapping checkpoint on ranks > 0.",
       'composable_shard/_state/sharded_slice.py', '    return ShardedSlice(local, start, shape, world_size, piece)',
       '    return ShardedSlice(local, 0, shape, world_size, piece)', 'tests/distributed/test_async_checkpoint.py'),
    _m('st_init_draws_restore_after_state', "to_empty no longer gives back fully_shard's initialization draws, so on the FSDP2 flow (fully_shard, to_empty, init_weights) the initial weights and the following random draws differ from the unsharded model's.",
       'composable_shard/_setup/init_draws.py', '        _restore(record.before)',
       '        _restore(record.after)', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fsdp2_dropin.py', 'tests/distributed/test_fully_shard_tensor_parallel.py'),
    _m('st_init_draws_extend_inverted', 'Consecutive fully_shard calls start a new record instead of extending it (and unrelated ones extend it), so to_empty restores the RNG to the middle of the draws (or refuses wrongly): per-block fully_shard on the meta device gets different initial weights than the unsharded model.',
       'composable_shard/_setup/init_draws.py', '        if _record is None or not _same(_record.after, self.before):',
       '        if _record is None or _same(_record.after, self.before):', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fsdp2_dropin.py', 'tests/distributed/test_fully_shard_tensor_parallel.py'),
    _m('st_end_weight_pass_drops_completed_grads', "Under zero-bubble schedules every successful weight pass's gradient is thrown away (and a failed one's kept), so fully sharded stages get no weight gradients: parameters never change/wrong numbers against FSDP2.",
       'composable_shard/_runtime/hooks.py', '        if not completed:',
       '        if completed:', 'tests/distributed/test_pipelining.py'),
    _m('st_zero_bubble_refused_over_fully_sharded', 'Building ScheduleZBVZeroBubble/InterleavedZeroBubble over fully sharded stages raises NotImplementedError while replicated stages are let through, silently training with unreduced per-rank gradients.',
       'composable_shard/integrations/pipelining.py', '        if isinstance(subject, ReplicateModule):',
       '        if isinstance(subject, FSDPModule):', 'tests/distributed/test_pipelining.py'),
    _m('st_weight_pass_omits_unsharded_params', "In zero-bubble input/weight passes the stage's parameters not owned by any fully sharded module (e.g. a parameter of a plain module in the stage that fully_shard does not manage) are not shown to torch's weight pass, so they get no gradient and never train.",
       'composable_shard/integrations/pipelining.py', '        return buffers + [p for p in self.submod.parameters() if id(p) not in owned]',
       '        return buffers', _PP_ZB),
    # torchao float8 (issue 57, in part)
    _m("fp8_all_gather_weights_unchecked", "tensor-parallel float8 all-gather weights reach the flat parameter (a shape error at the first forward)",
       _INIT, "    check_all_gather_extensions(f\"fully_shard({type(module).__name__})\", module,",
       "    if False: check_all_gather_extensions(f\"fully_shard({type(module).__name__})\", module,",
       "tests/distributed/test_float8.py"),
    _m("fp8_all_gather_dtensor_local_unchecked", "the check looks at the parameter, not a DTensor's local tensor",
       "composable_shard/_setup/validation.py", "        tensor = param.to_local() if isinstance(param, DTensor) else param",
       "        tensor = param", "tests/distributed/test_float8.py"),
    _m("clip_zero_norm_counts_zero_gradients", "the 0-norm counts a parameter whose gradient is zero on every rank (0 ** 0 = 1)",
       "composable_shard/_runtime/interop.py", "    return norms if math.isinf(order) or order == 0 else norms.pow(order)",
       "    return norms if math.isinf(order) else norms.pow(order)",
       "tests/distributed/test_clip_grad_norm.py::test_norms_outside_torch_clipping_stay_local_under_modes"),
    # issue 56: views kept from forward to backward, reductions averaged by the collective
    _m("kept_views_nested_task_not_told_apart", "a reentrant checkpoint's nested backward through the kept views clears the forward's arrival",
       "composable_shard/_runtime/flat_param.py",
       "            if handle.backward_task is not None and current_graph_task() != handle.backward_task:",
       "            if False:", "tests/distributed/test_activation_checkpointing.py"),
    _m("kept_views_made_again_in_backward", "the pre-backward makes new views instead of installing the forward's",
       "composable_shard/_runtime/hooks.py",
       "    wait_unshard(state, handle, fresh=handle.recomputes_in_backward)",
       "    wait_unshard(state, handle, fresh=True)",
       "tests/distributed/test_fully_shard_runtime.py::test_prefetch_order_limit_and_release"),
    _m("kept_views_kept_across_steps", "the end of backward keeps the views (their split runs last in the next backward)",
       "composable_shard/_runtime/hooks.py", "                g.kept_views = None", "                pass",
       "tests/distributed/test_fully_shard_runtime.py::test_prefetch_order_limit_and_release"),
    _m("avg_also_divided", "a reduction the collective averaged is divided again",
       "composable_shard/_runtime/flat_param.py",
       "        if not self.averaged and self.reduce_dtype in (torch.float32, torch.float64) and self.state.gradient_divisor != 1:",
       "        if self.reduce_dtype in (torch.float32, torch.float64) and self.state.gradient_divisor != 1:",
       "tests/unit/test_simulated_backend.py"),
    _m("avg_ignores_divide_factor", "a custom gradient divide factor still averages in the collective",
       "composable_shard/_runtime/flat_param.py",
       "        averages = (state.dp_world_size > 1 and state.gradient_divisor == state.dp_world_size and bool(groups)",
       "        averages = (state.dp_world_size > 1 and bool(groups)", "tests/unit/test_simulated_backend.py"),
    # a stranger's round on 17b22cd (issue 56's kept views and averaging; read the code, not the tests)
    _m('st56_split_hook_same_task_swapped', "The split pre-hook treats the ordinary backward as a reentrant recomputation and a reentrant checkpoint's nested backward as the forward's arrival: every handle's reduction waits until the end of backward (no overlap, every unsharded gradient alive at once: higher peak memory), and under torch.utils.checkpoint(use_reentrant=True) inside a fully sharded module the nested part is reduced alone and the rest is lost or raises.",
       'composable_shard/_runtime/flat_param.py',
       '            if handle.backward_task is not None and current_graph_task() != handle.backward_task:',
       '            if handle.backward_task is not None and current_graph_task() == handle.backward_task:',
       'tests/distributed/test_activation_checkpointing.py', 'tests/distributed/test_fully_shard_runtime.py'),
    _m('st56_pre_backward_task_not_recorded', "The pre-backward no longer records its graph task, so a reentrant checkpoint's nested backward reaching the kept forward views clears forward_grad_due: that partial gradient is reduced and the handle resharded early, giving wrong gradients (or a recomputation on sharded parameters) with use_reentrant=True checkpointing.",
       'composable_shard/_runtime/hooks.py',
       '    handle.backward_task = current_graph_task()',
       '    handle.backward_task = None',
       'tests/distributed/test_activation_checkpointing.py', 'tests/distributed/test_fully_shard_runtime.py'),
    _m('st56_will_gather_numel_not_storage', 'will_gather never sees a freed buffer (its numel is never 0), so no all-gather is ever issued after a reshard: the forward runs on freed storage and fails (or computes on stale values) from the second module use on.',
       'composable_shard/_runtime/flat_param.py',
       'g.gathered_buffer.untyped_storage().size() == 0',
       'g.gathered_buffer.numel() == 0',
       'tests/distributed/test_fully_shard_runtime.py'),
    # (its line, a poll before the wait, is gone: [Note: Never poll a work]; the registration itself now)
    _m('st56_wait_watched_inverted', "Waits on collectives skip the watchdog registration, so a stuck collective (a rank that skipped a forward or backward) hangs silently instead of raising the watchdog's error naming the pending collective.",
       'composable_shard/_runtime/collectives.py',
       '    _WAITING[ident] = _Wait(time.monotonic(), pending.kind, pending.tag, pending.hint)',
       '    pass',
       'tests/distributed/test_fully_shard_divergence.py'),
    _m('st56_averages_natively_gloo_allowed', "gloo groups are taken to average natively, so every float32/bfloat16 backward of fully_shard over several gloo ranks raises the internal error 'gloo's reduce-scatter cannot average' (or an unsupported ReduceOp.AVG all-reduce for HSDP replicas).",
       'composable_shard/_runtime/collectives.py',
       '    return size > 1 and backend not in ("gloo", "mpi")',
       '    return size > 1 and backend != "mpi"',
       'tests/distributed/test_fully_shard_runtime.py'),
    _m('st56_average_cache_key_no_divisor', "The cached 'averages natively' verdict ignores the gradient divisor: after set_gradient_divide_factor is called once a backward has run, an AVG-capable backend keeps averaging by the world size and the new factor is silently ignored (gradients off by factor/W).",
       'composable_shard/_runtime/flat_param.py',
       '        key = (state.gradient_divisor, state.dp_world_size, self.reduce_dtype)',
       '        key = (state.dp_world_size, self.reduce_dtype)',
       'tests/unit/test_simulated_backend.py'),
    _m('st56_average_ignores_divide_factor', "On a backend with AVG a custom gradient divide factor is ignored: gradients are averaged over the data-parallel world instead of divided by the user's factor.",
       'composable_shard/_runtime/flat_param.py',
       '        averages = (state.dp_world_size > 1 and state.gradient_divisor == state.dp_world_size and bool(groups)',
       '        averages = (state.dp_world_size > 1 and bool(groups)',
       'tests/unit/test_simulated_backend.py'),
    _m('st56_finish_divides_after_avg', 'float32 gradients reduced with ReduceOp.AVG are divided by the world size a second time in finish: .grad is W times too small on NCCL-like backends (the simulated backend included).',
       'composable_shard/_runtime/flat_param.py',
       '        if not self.averaged and self.reduce_dtype in (torch.float32, torch.float64) and self.state.gradient_divisor != 1:',
       '        if self.reduce_dtype in (torch.float32, torch.float64) and self.state.gradient_divisor != 1:',
       'tests/unit/test_simulated_backend.py'),
    _m('st56_issue_predivides_after_avg', 'bfloat16 reductions are pre-divided by the divisor and then averaged by the collective too: with a bfloat16 reduce dtype on an AVG-capable backend .grad is W times too small.',
       'composable_shard/_runtime/flat_param.py',
       '        if not self.averaged and self.reduce_dtype not in (torch.float32, torch.float64) and state.gradient_divisor != 1:',
       '        if self.reduce_dtype not in (torch.float32, torch.float64) and state.gradient_divisor != 1:',
       'tests/unit/test_simulated_backend.py'),
    _m('st56_replicate_always_sum', 'HSDP on an AVG-capable backend sums across replicas while finish skips the division (averaged), so gradients are R times too large (R replicas), and fully replicated (shard size 1) groups are never averaged at all.',
       'composable_shard/_runtime/flat_param.py',
       '            op = dist.ReduceOp.AVG if self.averaged else dist.ReduceOp.SUM',
       '            op = dist.ReduceOp.SUM',
       'tests/unit/test_simulated_backend.py'),
    _m('st56_sharded_grad_source_ignored', "The runtime's per-parameter shard source is dropped (attach_grads passes no groups), so torch's clip_grad_norm_/get_total_norm on a fully sharded model sees only this rank's slice: a wrong, rank-dependent total norm and different clipping per rank.",
       'composable_shard/_runtime/interop.py',
       '    shown._cs_source = source if source is not None else shard_source(groups, device)',
       '    shown._cs_source = shard_source(groups, device)',
       'tests/distributed/test_clip_grad_norm.py'),
    _m('st56_grad_sources_drop_tp_dims', "Gradient sources leave out a tensor-parallel piece's mesh dimensions, so clip_grad_norm_ on a 2-D (fully_shard + tensor parallel) model completes the norm over the shard group only: the total norm is wrong and differs across TP ranks (with a one-rank shard group the norm is purely local).",
       'composable_shard/_runtime/flat_param.py',
       '            over = norm_groups(shard_group, tp)',
       '            over = norm_groups(shard_group, None)',
       'tests/distributed/test_clip_grad_norm.py', 'tests/distributed/test_fully_shard_tensor_parallel.py'),
    # issue 57: float8 all-gather
    _m("fp8_amax_not_agreed", "each rank scales its slices of a float8 weight with its own amax, not the whole weight's",
       "composable_shard/_runtime/flat_param.py",
       "                _collectives.all_reduce(amaxes, shard_group, tag=tag, op=dist.ReduceOp.MAX).wait()",
       "                pass", "tests/distributed/test_float8.py"),
    _m("fp8_first_scale_for_all", "every float8 weight of a module is given the first weight's scale",
       "composable_shard/_base/float8.py",
       "    return _AsFloat8Weight.apply(hp_view, data, fp8.scales[index], fp8.linear_mm_configs[index])",
       "    return _AsFloat8Weight.apply(hp_view, data, fp8.scales[0], fp8.linear_mm_configs[index])",
       "tests/distributed/test_float8.py"),
    _m("fp8_gathered_kept_after_forward", "the float8 bytes are never freed: the buffer frees the gradient leaf instead",
       "composable_shard/_runtime/flat_param.py", "                    _free_storage(group.gathered_buffer)",
       "                    _free_storage(group.padded_unsharded_flat)", "tests/distributed/test_float8.py"),
    _m("fp8_weights_gathered_in_full_precision", "torchao's float8 weights join the plain group and are gathered in float32",
       "composable_shard/_runtime/flat_param.py",
       "                   _float8.float8_weight_info(p)[1] if _float8.is_float8_weight(p) else None)",
       "                   None)", "tests/distributed/test_float8.py"),
    _m("fp8_gradient_not_passed", "the float8 weight's gradient is dropped on its way to the flat gradient",
       "composable_shard/_base/float8.py", "        return grad, None, None, None",
       "        return torch.zeros_like(grad), None, None, None", "tests/distributed/test_float8.py"),
    # ---------------------------------------------------------------- a stranger's mutants of the float8 code (6f2045d)
    _m('st57_agree_dropped', "each rank casts its slice of a weight with a scale from its own slice's amax instead of the whole weight's agreed one, so at W>1 the gathered float8 bytes and the training numbers differ from FSDP2's float8 all-gather (and the MAX all-reduce disappears from the collectives)",
       'composable_shard/_base/float8.py',
       '            agree(amaxes)',
       '            pass',
       'tests/distributed/test_float8.py'),
    _m('st57_amax_without_abs', "the amax is the signed maximum, so a weight whose largest magnitude is negative gets too large a scale and its float8 cast saturates: losses and weights diverge from FSDP2's float8 numbers",
       'composable_shard/_base/float8.py',
       '.abs().max().to(torch.float32)',
       '.max().to(torch.float32)',
       'tests/distributed/test_float8.py'),
    _m('st57_amax_default_one', "a rank holding nothing of a weight contributes 1.0 to the MAX all-reduce, so every weight with |w| < 1 that lies wholly in fewer than all ranks' chunks is cast with scale 448 instead of its own: coarser float8 numbers than FSDP2's",
       'composable_shard/_base/float8.py',
       'amaxes = torch.zeros(len(slices)',
       'amaxes = torch.ones(len(slices)',
       'tests/distributed/test_float8.py'),
    _m('st57_scale_group_wide_amax', "every weight of a module's float8 group shares the scale of the group's largest weight instead of its own tensorwise scale, so a module with two or more float8 linears trains with different (coarser) numbers than FSDP2",
       'composable_shard/_base/float8.py',
       'fp8.scales.copy_(amax_to_scale(amaxes, fp8.dtype))',
       'fp8.scales.copy_(amax_to_scale(amaxes.max(), fp8.dtype))',
       'tests/distributed/test_float8.py'),
    _m('st57_amax_param_start_offset', "each weight's amax is read at its offset inside the parameter instead of inside this rank's shard, i.e. from another weight's (or no) elements: wrong scales and numbers for any weight not starting the shard, or an error on an empty slice",
       'composable_shard/_base/float8.py',
       'amaxes[i] = shard[s.shard_start:s.shard_start + s.numel]',
       'amaxes[i] = shard[s.param_start:s.param_start + s.numel]',
       'tests/distributed/test_float8.py'),
    _m('st57_offsets_end_not_start', "each weight's float8 view starts where the weight ends in the gathered bytes, so modules compute on the next weight's bytes/padding and the last weight runs past the buffer (wrong numbers or a view error in forward)",
       'composable_shard/_base/float8.py',
       '        out.append(at)',
       '        out.append(at + n)',
       'tests/distributed/test_float8.py'),
    _m('st57_backward_drops_grad', "the float8 weight's gradient never reaches the group's gradient leaf, so float8 linears' weights get no (or zero) gradient and do not train while FSDP2's do",
       'composable_shard/_base/float8.py',
       '        return grad, None, None, None',
       '        return None, None, None, None',
       'tests/distributed/test_float8.py'),
    _m('st57_gradient_leaf_param_dtype', "under MixedPrecision(param_dtype=bfloat16) the Float8TrainingTensor's original dtype is float32 instead of bf16, so float8 linears output float32 and the numbers/dtypes differ from FSDP2 bf16 with float8 all-gather",
       'composable_shard/_runtime/flat_param.py',
       'unsharded = _float8.gradient_leaf(padded, compute_dtype, self.compute_device)',
       'unsharded = _float8.gradient_leaf(padded, dtype, self.compute_device)',
       'tests/distributed/test_float8.py'),
    _m('st57_aliases_ignores_float8', 'at W=1 (no mixed precision, same device) the float8 group is treated as aliasing its shard, so it is never gathered and its float8 bytes keep no storage: the forward fails or reads garbage on one rank',
       'composable_shard/_runtime/flat_param.py',
       '                   and float8_dtype is None)',
       '                   )',
       'tests/distributed/test_float8.py'),
    _m('st57_reshard_keeps_float8_bytes', "resharding frees the non-float8 buffer (the float8 group's one-element gradient leaf) instead of the float8 bytes, so the gathered float8 weights stay allocated after forward/backward (memory of the unsharded module held, unsharded_storage_freed False) and the next gather is skipped",
       'composable_shard/_runtime/flat_param.py',
       '                    _free_storage(group.gathered_buffer)',
       '                    _free_storage(group.padded_unsharded_flat)',
       'tests/distributed/test_float8.py'),
    _m('st57_group_key_without_float8', "torchao's float8 weights are grouped with plain parameters and all-gathered in their own precision (4x the bytes of float8 all-gather in float32), the module slot gets a plain tensor instead of a float8 weight, and the float8 group disappears from the plan",
       'composable_shard/_runtime/flat_param.py',
       '                   _float8.float8_weight_info(p)[1] if _float8.is_float8_weight(p) else None)',
       '                   None)',
       'tests/distributed/test_float8.py'),
    _m('st57_validation_tp_float8_allowed', 'a tensor-parallel (DTensor) float8 weight with float8 all-gather is no longer refused at fully_shard with the NotImplementedError naming the setting; it fails later with an unrelated error (or mis-gathers) after the model was changed',
       'composable_shard/_setup/validation.py',
       '        if is_float8_weight(tensor) and not isinstance(param, DTensor):',
       '        if is_float8_weight(tensor):',
       'tests/distributed/test_float8.py'),
    # ---------------------------------------------------------------- describe() of float8-gathered groups
    _m("describe_float8_gathered_at_compute_size", "describe() counts a float8 group's all-gathers at the compute dtype's bytes (4x float32's)",
       'composable_shard/_planning/describe.py', 'add("all_gather", gathers, g_chunk * _itemsize(g.gather_dtype))',
       'add("all_gather", gathers, g_chunk * _itemsize(g.compute_dtype))', 'tests/distributed/test_float8.py'),
    _m("describe_float8_amax_not_counted", "describe() leaves out the amax all-reduce each float8 gather makes",
       'composable_shard/_planning/describe.py', '        if g.float8_dtype is not None and h.shard_world > 1:  # each gather agrees the weights\' amaxes first',
       '        if False:', 'tests/distributed/test_float8.py'),
    # 2026-11-28 (sixth session): the hang under the profiler, the reduction in flight below replicated blocks
    _m("poll_before_wait", "the runtime polls a work (is_completed) before waiting: under torch's profiler inside a checkpointed forward, gloo's worker needs the GIL the poll keeps (a rare hang)",
       'composable_shard/_runtime/collectives.py', '    if not _WATCHDOG:\n        _start_watchdog()\n    ident',
       '    if work.is_completed():\n        work.wait()\n        return\n    if not _WATCHDOG:\n        _start_watchdog()\n    ident',
       'tests/distributed/test_host_reads.py'),
    _m("plan_reduction_next_block_only", "a reduction in flight is counted only in the backward of the block just below it, not below replicated blocks",
       f"{PACKAGE}/plan.py", "    for j in range(k + 1, len(costs)):\n        if options[j].api == \"fully_shard\"",
       "    for j in range(k + 1, min(k + 2, len(costs))):\n        if options[j].api == \"fully_shard\"",
       "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    _m("plan_replicate_releases", "a replicated block is taken to release the reduction in flight below it",
       f"{PACKAGE}/plan.py", 'if options[j].api == "fully_shard" and (costs[j].unsharded_grad or options[j].checkpoint):',
       'if True:',
       "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions"),
    # 2026-11-28 (sixth session): my own quick round on checkpoint files, the step watch and the compress hooks
    # (not a stranger's: the helper briefed for that, /work/briefs/stranger58.md, did not report in time)
    _m("own58_checksum_mismatch_accepted", "a checkpoint file whose sha256 differs from checksums.json loads anyway",
       f"{PACKAGE}/_state/checkpoint_files.py", "        if actual != expected[name]:", "        if False:",
       "tests/distributed/test_checkpoint_crash.py"),
    _m("own58_unlisted_file_accepted", "a file in the checkpoint folder that checksums.json does not list is accepted",
       f"{PACKAGE}/_state/checkpoint_files.py", "    if extra:", "    if False:",
       "tests/distributed/test_checkpoint_crash.py"),
    _m("own58_hash_first_block_only", "only the first 4 KB of each MB of a file is hashed: a flipped bit further in loads silently",
       f"{PACKAGE}/_state/checkpoint_files.py", "            digest.update(block)", "            digest.update(block[:4096])",
       "tests/distributed/test_checkpoint_crash.py"),
    _m("own58_steps_agreed_capped_at_one", "ranks that stepped 1 and 2 times between synced backwards agree (silently different models)",
       f"{PACKAGE}/_runtime/watch.py", "        d = min(self.pending, _MAX_STEPS_AGREED)", "        d = min(self.pending, 1)",
       "tests/distributed/test_fully_shard_divergence.py"),
    _m("own58_compress_hook_not_averaged", "replicate's bf16/fp16 compress hooks sum the gradients instead of averaging (W times too large)",
       f"{PACKAGE}/comm_hooks.py", "    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))",
       "    compressed = buffer.to(dtype)", "tests/distributed/test_replicate.py"),
    # 2026-11-29 (seventh session): a stranger's round on checkpoint files, the load transaction, the step watch and
    # the comm hooks (/work/briefs/stranger58.md; its st58_compress_hook_no_average is own58_compress_hook_not_averaged)
    _m('st58_rank1_gets_empty_tmp_dir', "With W>1 only rank 0 knows the temporary directory; the other ranks dcp.save into '' (the working directory or an error), so save_checkpoint raises or publishes a checkpoint missing their data files, which then cannot be loaded.",
       f'{PACKAGE}/_state/checkpoint_files.py', '    return from_rank(tmp, 0)\n',
       '    return tmp\n', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_save_writes_into_final_path', 'Saves write straight into <path> (rename onto itself is a no-op), so a save that fails or is killed part-way (e.g. extra that does not pickle) leaves a <path> without checksums.json that latest_checkpoint returns and load_checkpoint then refuses.',
       f'{PACKAGE}/_state/checkpoint_files.py', '        tmp = f"{path}.tmp-{secrets.token_hex(6)}"\n',
       '        tmp = path\n', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_latest_picks_oldest_step', 'latest_checkpoint returns the oldest step_<N> instead of the newest, so a resumed run silently restarts from an early checkpoint.',
       f'{PACKAGE}/_state/checkpoint_files.py', '            step = max(steps)\n',
       '            step = min(steps)\n', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_last_listed_file_not_verified', "The alphabetically last file (extra.pt, or the last rank's __<r>_0.distcp when there is no extra) is never checksummed, so a corrupted or altered one is accepted and loads as wrong values / a wrong extra dict.",
       f'{PACKAGE}/_state/checkpoint_files.py', '    for name in sorted(expected):\n        reason = _leaves_folder(path, name)\n',
       '    for name in sorted(expected)[:-1]:\n        reason = _leaves_folder(path, name)\n', 'tests/distributed/test_checkpoint_crash.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_rollback_copies_into_snapshot', "A load that fails after writing (a peer fails at the final agreement, a read fails midway) raises but leaves the model's shards/optimizer tensors with the partially loaded values instead of the originals.",
       f'{PACKAGE}/_state/load_transaction.py', '            live.copy_(saved)\n',
       '            saved.copy_(live)\n', 'tests/distributed/test_checkpoint_faults.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_optim_snapshot_aliases_live_dict', "Any failed load_checkpoint/set_optimizer_state_dict (even a checksum failure before anything is written) empties every per-parameter optimizer state on rollback, so the next step restarts Adam's moments and step count: different numbers after a caught load error.",
       f'{PACKAGE}/_state/load_transaction.py', '    entries = [(p, entry, dict(entry)) for p, entry in optim.state.items()]\n',
       '    entries = [(p, entry, entry) for p, entry in optim.state.items()]\n', 'tests/distributed/test_checkpoint_faults.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_final_agreement_drops_error', "An error in the transaction body (dcp.load's CheckpointException, a set_*_state_dict failure, a failure on one rank at the final agreement) is swallowed: the load returns normally, nothing is restored, and the model is partially loaded or differs between ranks.",
       f'{PACKAGE}/_state/load_transaction.py', '                agree_or_raise(error, api, group)\n',
       '                agree_or_raise(None, api, group)\n', 'tests/distributed/test_checkpoint_faults.py', 'tests/distributed/test_state_dict.py'),
    _m('st58_steps_counted_only_if_optim_holds_only_ours', 'An optimizer that also holds parameters outside this handle/module (the usual one optimizer over a model with several fully_shard units) is never counted: kept unsharded buffers are not regathered after its step (stale forward) and skipped steps on one rank are not reported.',
       f'{PACKAGE}/_runtime/watch.py', '            cached = (size, any(id(p) in self.param_ids for g in groups for p in g["params"]))\n',
       '            cached = (size, all(id(p) in self.param_ids for g in groups for p in g["params"]))\n', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st58_step_sums_unpacked_swapped', "The step agreement compares n*sum(d) with sum(d*d)**2: ranks that all stepped twice in a window (two optimizers, or two steps per backward) get a false 'stepped a different number of times' error, and the reported average is wrong.",
       f'{PACKAGE}/_runtime/watch.py', '        total, squares = summed\n',
       '        squares, total = summed\n', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st58_model_change_never_recorded', 'A parameter registered/replaced or a submodule with parameters added after fully_shard is never recorded, so the next forward raises nothing and the new parameter is silently left out of training.',
       f'{PACKAGE}/_runtime/watch.py', '    if state.model_change is None:\n',
       '    if state.model_change is not None:\n', 'tests/distributed/test_fully_shard_divergence.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st58_allreduce_hook_divides_by_world', "allreduce_hook with a process group smaller than the world (a subgroup, HSDP's replicate group) divides by the world size, so gradients come out too small by world/group size (no change when the group is the world).",
       f'{PACKAGE}/comm_hooks.py', '    buffer.div_(dist.get_world_size(process_group))\n',
       '    buffer.div_(dist.get_world_size())\n', 'tests/distributed/test_replicate.py'),
    # the neighbours of the two survivors above (mine, next to the tests written for them)
    _m("own59_latest_by_name", "latest_checkpoint takes the largest folder name as text (step_1 after step_000002)",
       f"{PACKAGE}/_state/checkpoint_files.py", "            step = max(steps)\n",
       "            step = max(steps, key=lambda n: steps[n])\n", "tests/distributed/test_checkpoint_crash.py"),
    _m("own59_compress_hook_divides_by_world", "the fp16/bf16 compress hooks divide by the world's size, not their group's",
       f"{PACKAGE}/comm_hooks.py", "    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))",
       "    compressed = buffer.to(dtype).div_(dist.get_world_size())", "tests/distributed/test_replicate.py"),
    # 2026-11-29 (seventh session): a stranger's round on optimizer state dicts, torch compatibility, data-parallel
    # setup, module state and wrap policies (/work/briefs/stranger59.md)
    _m('st59_optim_load_groups_take_group0_hyperparams', "set_optimizer_state_dict gives every param group the first group's saved hyper-parameters (lr, weight_decay, betas), so a resumed run with per-group settings continues with different numbers.",
       f'{PACKAGE}/_state/optim_state_dict.py', '        local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": [index_of[f] for f in mine]})',
       '        local_groups.append({**{k: v for k, v in saved_groups[0].items() if k != "params"}, "params": [index_of[f] for f in mine]})', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py'),
    _m('st59_optim_load_step_aliases_caller_tensor', "set_optimizer_state_dict keeps the state dict's own `step` tensor: two optimizers loaded from one state dict share (and both advance) one step counter, and stepping changes the caller's state dict, so Adam's bias correction after resume is wrong.",
       f'{PACKAGE}/_state/optim_state_dict.py', "        return value.detach().clone()  # torch's loader keeps a step's dtype and device",
       "        return value  # torch's loader keeps a step's dtype and device", 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py'),
    _m('st59_optim_sharded_copy_branch_swapped', "get_optimizer_state_dict(full=False) returns ShardedSlices that alias the optimizer's live exp_avg/momentum (they change with training), while the checkpoint functions' views become copies, so dcp.load into them never reaches the optimizer and a resume starts from stale state.",
       f'{PACKAGE}/_state/optim_state_dict.py', '                elif copy:',
       '                elif not copy:', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py'),
    _m('st59_optim_fqn_missing_module_prefix', "Sharded parameters of nested fully sharded modules are not recognised as managed: get_optimizer_state_dict(full=True) returns each rank's 1-D local slices instead of gathered full-shape states, and a full optimizer state dict no longer loads (shape mismatch).",
       f'{PACKAGE}/_state/optim_state_dict.py', '            fqn = f"{path}.{name}" if path else name',
       '            fqn = name', 'tests/distributed/test_state_dict.py', 'tests/distributed/test_torch_state_dict_api.py'),
    _m('st59_compat_grad_hooks_ignore_post_accumulate', 'A register_post_accumulate_grad_hook on a fully sharded parameter is no longer refused at the next forward; the hook silently never runs (e.g. an optimizer-in-backward never steps).',
       f'{PACKAGE}/_base/torch_compat.py', '    return bool(tensor._backward_hooks) or bool(tensor._post_accumulate_grad_hooks)  # private, see module docstring',
       '    return bool(tensor._backward_hooks)  # private, see module docstring', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_state_dict.py'),
    _m('st59_compat_tensor_slots_nonpersistent_saved', 'Non-persistent buffers are treated as state-dict entries: set_model_state_dict(strict=True) of a model with a non-persistent buffer (rotary cache) raises missing keys for a state dict the model itself produced, and the expected-keys check disagrees with module.state_dict().',
       f'{PACKAGE}/_base/torch_compat.py', '        yield module._buffers, name, buf, buf is not None and name not in module._non_persistent_buffers_set',
       '        yield module._buffers, name, buf, buf is not None', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_state_dict.py'),
    _m('st59_dp_broadcast_only_last_group', "With a 2-D (HYBRID) mesh the init broadcast (sync_module_states) skips the replicate group, so each replica keeps its own shard-group rank 0's initial weights and replicas train from different parameters.",
       f'{PACKAGE}/_setup/data_parallel.py', '            for group in taking_part:',
       '            for group in taking_part[-1:]:', 'tests/distributed/test_fully_shard_init.py', 'tests/distributed/test_data_parallel_shared.py'),
    _m('st59_dp_digest_ignores_layout_hash', 'fully_shard on ranks holding different models (different shapes or parameter names) no longer raises the agreed RuntimeError before its first collective; it proceeds and hangs or mixes up data in the broadcast/all-gathers.',
       f'{PACKAGE}/_setup/data_parallel.py', '        differs = int(any(row[1] or row[2:] != rows[0][2:] for row in rows))',
       '        differs = int(any(row[1] for row in rows))', 'tests/distributed/test_fully_shard_init.py', 'tests/distributed/test_data_parallel_shared.py'),
    _m('st59_state_divisor_uses_shard_size', 'Under HYBRID_SHARD (2-D mesh) reduced gradients are divided by the shard group size instead of shard x replicate, so gradients (and the parameters after a step) are larger by the replicate degree than single-process training on the combined batch.',
       f'{PACKAGE}/_runtime/module_state.py', '        return float(self.dp_world_size) if self.gradient_divide_factor is None else self.gradient_divide_factor',
       '        return float(self.world_size) if self.gradient_divide_factor is None else self.gradient_divide_factor', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_fully_shard_training.py'),
    _m('st59_state_first_forward_skips_change_check', "A structural change made to the model after fully_shard and before the first forward (a replaced submodule or parameter) is not refused at that forward; training silently uses stale flat parameters or the new module's unsharded weights.",
       f'{PACKAGE}/_runtime/module_state.py', '        self.changes_to_check: bool = True  # a tracked module changed since the last check (_runtime/watch.py); the first forward checks',
       '        self.changes_to_check: bool = False  # a tracked module changed since the last check (_runtime/watch.py); the first forward checks', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_fully_shard_training.py'),
    _m('st59_wrap_remainder_counts_claimed_params', "Function policies see the whole subtree's numel at the select step, so size_based_auto_wrap_policy also selects parents whose parameters were all claimed by wrapped children: extra (empty or tiny) fully sharded modules and a different set of targets than torch FSDP's policy picks.",
       f'{PACKAGE}/wrap.py', '            remainder = sum(p.numel() for p in params if p not in claimed)',
       '            remainder = sum(p.numel() for p in params)', 'tests/unit/test_wrap.py'),
    _m('st59_wrap_size_threshold_off_by_one', "size_based_auto_wrap_policy neither descends into nor selects a module holding exactly min_num_params elements, so such a block is not fully sharded on its own (its parameters fall to the parent: more memory per rank, different module set than torch's policy).",
       f'{PACKAGE}/wrap.py', '    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(classes))',
       '    return nonwrapped_numel > min_num_params and not isinstance(module, tuple(classes))', 'tests/unit/test_wrap.py'),
    # 2026-11-29 (seventh session): a stranger's round on the flat parameter handle, mixed precision and replicate
    # (/work/briefs/stranger60.md)
    _m('st60_init_values_rank0_chunk', "After to_empty + init_weights() on a sharded meta model, every rank's shard holds rank 0's chunk, so at W>=2 parameters (and the next step's numbers) are wrong for elements owned by ranks other than 0.",
       f'{PACKAGE}/_runtime/flat_param.py', 'group.flat_param.data.copy_(full.view(self.world_size, -1)[self.rank])',
       'group.flat_param.data.copy_(full.view(self.world_size, -1)[0])', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_build_shard_padding_ignored', 'fully_shard raises a size-mismatch RuntimeError on the ranks whose chunk contains padding (a group whose numel is not divisible by W, or tiny groups at W=4), while it works when the numel divides evenly.',
       f'{PACKAGE}/_runtime/flat_param.py', '            valid = max(0, min(end, total) - start)',
       '            valid = max(0, end - start)', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_accumulate_overwrites_view', "Two synced backwards without zero_grad (or with zero_grad(set_to_none=False) followed by several backwards) leave only the last backward's averaged gradient in .grad instead of the sum, so accumulation across synced steps is silently lost.",
       f'{PACKAGE}/_runtime/flat_param.py', '            old.add_(reduced)  # every .grad is still our view: accumulate in place',
       '            old.copy_(reduced)  # every .grad is still our view: accumulate in place', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_unreduced_kept_narrow', "Under param_dtype=bf16, reduce_dtype=fp32 with set_requires_gradient_sync(False), the unsynced .grad views are bf16 (not fp32) and micro-batch sums are rounded in bf16, so accumulated gradients differ from torch FSDP2's.",
       f'{PACKAGE}/_runtime/flat_param.py', '        if _wider(reduce_dtype, grad.dtype):',
       '        if _wider(grad.dtype, reduce_dtype):', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_attach_drops_earlier_grad', 'A parameter that had a .grad from an earlier backward but is unused (on every rank) in the next synced backward gets .grad = None, losing its accumulated gradient.',
       f'{PACKAGE}/_runtime/flat_param.py', 'and (group.had_grad[i] or used[i])',
       'and used[i]', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_partial_freeze_stops_grads', 'Freezing one parameter of a flat group after fully_shard makes the whole unsharded buffer not require grad, so the still-trainable parameters of that group get no gradient (.grad None, weights never updated).',
       f'{PACKAGE}/_runtime/flat_param.py', '            group.padded_unsharded_flat.requires_grad_(any(mask))',
       '            group.padded_unsharded_flat.requires_grad_(all(mask))', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_lifecycle.py', 'tests/distributed/test_meta_init.py', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_full_precision_needs_both_dtypes', "With MixedPrecision(param_dtype=bf16) and no buffer_dtype, BatchNorm (and other _module_classes_to_ignore) is no longer kept in fp32: its parameters are gathered and computed in bf16, changing the numbers and the gathered dtype; with only buffer_dtype set, BatchNorm's running stats get cast too.",
       f'{PACKAGE}/_runtime/mixed_precision.py', '    if mp is None or (mp.param_dtype is None and mp.buffer_dtype is None):',
       '    if mp is None or (mp.param_dtype is None or mp.buffer_dtype is None):', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_buffer_cast_only_ignored_classes', 'buffer_dtype casts the buffers of BatchNorm (kept in full precision) instead of those of every other owned module, so ordinary buffers keep their dtype and the running statistics become low precision.',
       f'{PACKAGE}/_runtime/mixed_precision.py', '            if not isinstance(m, classes):',
       '            if isinstance(m, classes):', 'tests/distributed/test_fully_shard_mixed_precision.py', 'tests/distributed/test_mixed_precision_options.py'),
    _m('st60_replicate_unsynced_use_forgotten', "A parameter that gets a gradient only in set_requires_gradient_sync(False) micro-batches counts as unused at the next synced backward, so its .grad stays each rank's own un-averaged local sum (replicas drift).",
       f'{PACKAGE}/replicate.py', '    state.used_since_sync[param_index] = True',
       '    state.used_since_sync[param_index] = backward.syncs', 'tests/distributed/test_replicate.py', 'tests/distributed/test_compose.py'),
    _m('st60_replicate_slot_view_not_scaled', 'When p.grad already is its bucket slot (zero_grad(set_to_none=False), or a no_sync accumulation after the first synced step) the gradient is not multiplied by 1/W, so .grad is the sum over ranks (W times too large); with a comm hook it raises a TypeError instead.',
       f'{PACKAGE}/replicate.py', '        if scale is not None:',
       '        if scale is None:', 'tests/distributed/test_replicate.py', 'tests/distributed/test_compose.py'),
    _m('st60_replicate_cast_grad_adds_local', 'With MixedPrecision(reduce_dtype=bf16) on fp32 parameters, .grad after a synced backward is the local gradient plus the average instead of the average (wrong numbers, different on every rank).',
       f'{PACKAGE}/replicate.py', '        local_piece(param.grad).copy_(reduced)',
       '        local_piece(param.grad).add_(reduced)', 'tests/distributed/test_replicate.py', 'tests/distributed/test_compose.py'),
    _m('st60_replicate_buffers_not_broadcast', 'replicate broadcasts only parameters at init: buffers (BatchNorm running stats, any registered buffer) that differ between ranks stay different, so forwards in eval mode and state dicts differ across ranks.',
       f'{PACKAGE}/replicate.py', '    broadcast_from_rank0([local_piece(t) for _, t in states], [_group_or_world(process_group)], None,',
       '    broadcast_from_rank0([local_piece(t) for _, t in states if isinstance(t, nn.Parameter)], [_group_or_world(process_group)], None,', 'tests/distributed/test_replicate.py', 'tests/distributed/test_compose.py'),
    # 2026-11-29 (seventh session): a stranger's round on the runtime hooks, unshard_params and sharded slices
    # (/work/briefs/stranger61.md)
    _m('st61_sync_branch_swapped', 'post-backward reduces gradients when sync is off and only keeps them locally when sync is on, so parameters after a synced step differ from single-process training and no_sync accumulation is reduced too early',
       f'{PACKAGE}/_runtime/hooks.py', '        if state.sync_gradients:\n            handle.reduce(group, unsharded_grad)',
       '        if not state.sync_gradients:\n            handle.reduce(group, unsharded_grad)', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_grad_ready_not_reset', 'grad_ready stays True after a step, so the next backward reshards a multi-group handle after its first group and a synced backward skips reducing gradients left over from unsynced backwards (lost gradient, wrong parameters after the step)',
       f'{PACKAGE}/_runtime/hooks.py', '                g.grad_ready = False\n',
       '                pass\n', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_needs_pre_backward_not_reset', "after the first backward no pre-backward hook runs again, so the second iteration's backward runs on resharded parameters (shape error or wrong gradients) and no end-of-backward callback is queued",
       f'{PACKAGE}/_runtime/hooks.py', '            h.needs_pre_backward = True\n',
       '            pass\n', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_stale_kept_buffer_not_freed', "a kept unsharded buffer (root, SHARD_GRAD_OP, reshard_after_forward=False) is not regathered after the optimizer stepped, so the next forward computes with the previous step's parameters and the losses drift from single-process training",
       f'{PACKAGE}/_runtime/hooks.py', '    if handle.is_stale():  # kept from an earlier step; the shards changed since\n        handle.reshard(free=True)',
       '    if handle.is_stale():  # kept from an earlier step; the shards changed since\n        handle.reshard(free=False)', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_abort_forward_keeps_in_progress', "after a forward that raised, the root still believes a forward is in progress, so unshard_params / state_dict between steps raise 'cannot be used during forward or backward'",
       f'{PACKAGE}/_runtime/hooks.py', '    state.ctx.forward_in_progress = False\n    _end_iteration(state)',
       '    _end_iteration(state)', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_used_offset_not_advanced', "the agreed 'parameter was used' flags of every group after the first of a process-group batch are read from the first group's slots, so an unused parameter gets a zero .grad (AdamW/weight decay moves it) or a used one keeps .grad None",
       f'{PACKAGE}/_runtime/hooks.py', '            offset += len(group.orig_params)\n',
       '            offset += 0\n', 'tests/distributed/test_fully_shard_runtime.py', 'tests/distributed/test_fully_shard_training.py', 'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st61_writeback_chunk_off_by_one', "on exit of unshard_params(writeback=True) each rank writes its neighbour's chunk (the last rank a short one: copy error) into its shard, so values after the context differ from what was (or was not) edited",
       f'{PACKAGE}/_state/unshard_params.py', '        start = item.state.rank * fp.numel()\n',
       '        start = (item.state.rank + 1) * fp.numel()\n', 'tests/distributed/test_unshard_params.py'),
    _m('st61_saved_shard_condition_inverted', 'with one rank in the shard group, edits under writeback=False persist in the shard while edits under writeback=True are reverted on exit',
       f'{PACKAGE}/_state/unshard_params.py', '    saved = shard.clone() if full is shard and not writeback else None',
       '    saved = shard.clone() if full is shard and writeback else None', 'tests/distributed/test_unshard_params.py'),
    _m('st61_summon_state_not_reset', "after unshard_params exits every module stays in SUMMON_FULL_PARAMS, so the next forward raises 'forward called inside summon_full_params' and a second unshard_params raises as nested",
       f'{PACKAGE}/_state/unshard_params.py', '            s.training_state = TrainingState.IDLE\n            if s.handle is not None:',
       '            pass\n            if s.handle is not None:', 'tests/distributed/test_unshard_params.py'),
    _m('st61_whole_rows_overlap_partial_row', "a range starting mid-row gets a whole-rows box that also covers its first (partial) row, overlapping the partial box and larger than the rank's elements, so a DCP save of a sharded state dict fails or writes overlapping chunks that load wrong",
       f'{PACKAGE}/_state/sharded_slice.py', '        whole_from = first + 1\n',
       '        whole_from = first\n', 'tests/unit/test_sharded_tensor.py', 'tests/distributed/test_state_dict.py'),
    _m('st61_dcp_box_ignores_start', 'DCP reads each box at its global flat position inside the rank-local slice, so on every rank but the first the checkpoint saves/loads the wrong elements (or fails with a view/size error)',
       f'{PACKAGE}/_state/sharded_slice.py', '                box = self.local[flat - self.start:flat - self.start + math.prod(sizes)].view(sizes)',
       '                box = self.local[flat:flat + math.prod(sizes)].view(sizes)', 'tests/unit/test_sharded_tensor.py', 'tests/distributed/test_state_dict.py'),
    _m('st61_elements_ignores_start', 'ShardedSlice.elements indexes local from the global start, so loading a sharded state dict through load_state_dict copies wrong elements (or fails with a size mismatch) on ranks whose slice does not start at 0',
       f'{PACKAGE}/_state/sharded_slice.py', '        return self.local[start - self.start:end - self.start]',
       '        return self.local[start:end - self.start]', 'tests/unit/test_sharded_tensor.py', 'tests/distributed/test_state_dict.py'),
    # the neighbours of this round's survivors (mine, next to the tests written for them)
    _m("own59_loaded_state_aliased", "set_optimizer_state_dict keeps the caller's tensor when dtype and device already match",
       f"{PACKAGE}/_state/optim_state_dict.py", "    return value.detach().to(device=param.device, dtype=dtype, copy=True)",
       "    return value.detach().to(device=param.device, dtype=dtype, copy=False)", "tests/distributed/test_state_dict.py"),
    _m("own59_full_state_piece_aliased", "set_optimizer_state_dict keeps a view of the caller's full tensor",
       f"{PACKAGE}/_state/optim_state_dict.py", "if isinstance(value, ShardedSlice) else piece.clone()",
       "if isinstance(value, ShardedSlice) else piece", "tests/distributed/test_state_dict.py"),
    _m("own59_sync_states_shard_group_only", "fully_shard(sync_module_states=True) on a 2-D mesh broadcasts over the shard group only",
       f"{PACKAGE}/_setup/fully_shard_init.py", "[root_groups.replicate, root_groups.shard],", "[root_groups.shard],",
       "tests/distributed/test_fully_shard_init.py"),
    _m("own59_had_grad_forgotten", "a synced backward forgets which parameters had a .grad before it (accumulated gradients dropped)",
       f"{PACKAGE}/_runtime/flat_param.py", "        group.had_grad = [g is not None for g in grads]",
       "        group.had_grad = [False for g in grads]", "tests/distributed/test_fully_shard_lifecycle.py"),
    _m("own59_leftover_unsynced_never_reduced", "a unit with gradients from unsynced backwards only keeps each rank's own sum after the synced one",
       f"{PACKAGE}/_runtime/hooks.py", "            if group.unreduced_grad is not None and not group.grad_ready:",
       "            if False:", "tests/distributed/test_fully_shard_lifecycle.py::test_parameters_without_gradient_keep_grad_none"),
    _m('st62_failed_apply_stays_registered',
       "A fully_shard/replicate call that fails argument validation (TypeError/ValueError) leaves the API registered and its state attached, so the corrected retry raises 'already applied' (half-applied state).",
       'composable_shard/contract.py',
       '        except BaseException:\n            for m in roots:',
       '        except RuntimeError:\n            for m in roots:',
       'tests/unit/test_contract.py',
       'tests/distributed/test_fully_shard_errors.py',
       'tests/distributed/test_replicate.py'),
    _m('st62_deepcopy_returns_error_object',
       'copy.deepcopy (and pickling) of a fully_shard/replicate-managed module no longer raises: deepcopy silently returns a RuntimeError object instead of failing loudly.',
       'composable_shard/_setup/subclass.py',
       '    raise RuntimeError(\n        f"cannot copy or pickle',
       '    return RuntimeError(\n        f"cannot copy or pickle',
       'tests/unit/test_subclass.py',
       'tests/unit/test_no_pickle.py'),
    _m('st62_traversal_skips_replicated_start',
       "When the start module is managed by replicate (fully_shard'd children inside), _get_fsdp_states finds no states, so unshard_params/state dicts on it silently see sharded 1-D views instead of full parameters.",
       'composable_shard/_runtime/traversal.py',
       '        if current is not module and not _composable(current):',
       '        if not _composable(current):',
       'tests/unit/test_traversal.py',
       'tests/distributed/test_fully_shard_composable.py',
       'tests/distributed/test_compose.py',
       'tests/distributed/test_unshard_params.py',
       'tests/distributed/test_state_dict.py'),
    _m('st62_owned_modules_enter_ignored',
       'owned_modules descends into ignored_modules subtrees, so mixed-precision buffer_dtype casts the buffers of ignored modules (and the watchdog tracks them) although they must be left alone.',
       'composable_shard/_runtime/traversal.py',
       '        if m is not module and (not _composable(m) or m in state.ignored_modules):',
       '        if m is not module and not _composable(m):',
       'tests/unit/test_traversal.py',
       'tests/distributed/test_mixed_precision_options.py',
       'tests/distributed/test_fully_shard_init.py',
       'tests/distributed/test_fully_shard_composable.py'),
    _m('st62_tensors_in_dict_keys',
       "tensors_in iterates a dict's keys instead of its values, so a module returning a dict (or HF ModelOutput) gets no pre-backward hook and backward runs on resharded parameters (wrong grads or an autograd error).",
       'composable_shard/_base/tree.py',
       '            stack.extend(item.values())',
       '            stack.extend(item)',
       'tests/unit/test_common_utils.py',
       'tests/distributed/test_fully_shard_runtime.py',
       'tests/distributed/test_hf_models.py'),
    _m('st62_gloo_rs_sends_own_chunk',
       "On gloo with two ranks the point-to-point reduce-scatter sends this rank's own chunk instead of the peer's chunk, so every reduced gradient shard is wrong.",
       'composable_shard/_runtime/collectives.py',
       'dist.isend(chunks[peer], dst=global_peer, group=group, tag=p2p_tag)',
       'dist.isend(mine, dst=global_peer, group=group, tag=p2p_tag)',
       'tests/distributed/test_fully_shard_training.py',
       'tests/distributed/test_collective_budget.py'),
    _m('st62_json_gather_rank0_length',
       "all_gather_json pads to rank 0's payload length instead of the longest, so a rank with a longer payload (a refusal or differing layout on an error path) fails while the others block in the second gather: a hang instead of a clear error.",
       'composable_shard/_runtime/collectives.py',
       '    longest = int(lengths.max().item())',
       '    longest = int(lengths[0].item())',
       'tests/distributed/test_fully_shard_divergence.py',
       'tests/distributed/test_fully_shard_errors.py',
       'tests/distributed/test_data_parallel_shared.py',
       'tests/distributed/test_meta_init.py'),
    _m('st62_muon_lr_ratio_inverted',
       "Muon's default ('original') learning-rate adjustment uses sqrt(max(1, cols/rows)) instead of rows/cols, so wide matrices get a too-large step and tall ones too small versus torch.optim.Muon.",
       'composable_shard/optim.py',
       '    return lr * math.sqrt(max(1.0, rows / cols))',
       '    return lr * math.sqrt(max(1.0, cols / rows))',
       'tests/distributed/test_muon.py',
       'tests/distributed/test_muon_agreement.py'),
    _m('st62_muon_no_nesterov_drops_momentum',
       'With nesterov=False Muon orthogonalizes the raw gradient instead of the momentum buffer, so momentum is silently ignored.',
       'composable_shard/optim.py',
       'return grad.lerp(buffer, momentum) if settings["nesterov"] else buffer',
       'return grad.lerp(buffer, momentum) if settings["nesterov"] else grad',
       'tests/distributed/test_muon.py',
       'tests/distributed/test_muon_agreement.py'),
    _m('st62_muon_owned_matrices_zeroed',
       'In the sharded Muon step the zeroing cursor stops at the start of each owned matrix, so each orthogonalized matrix is zeroed afterwards and sharded matrices receive only weight decay, no update.',
       'composable_shard/optim.py',
       '        end = m.flat_start + numel',
       '        end = m.flat_start',
       'tests/distributed/test_muon.py',
       'tests/distributed/test_muon_agreement.py'),
    _m('st62_buffer_dtype_unchecked',
       'MixedPrecision.buffer_dtype is no longer validated, so a non-floating (torch.int64) or non-dtype buffer_dtype is accepted and buffers are silently cast/truncated or fail later instead of a ValueError/TypeError at fully_shard.',
       'composable_shard/_setup/validation.py',
       'for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):',
       'for name in ("param_dtype", "reduce_dtype"):',
       'tests/distributed/test_mixed_precision_options.py',
       'tests/distributed/test_fully_shard_errors.py'),
    _m('st62_nonmember_group_typeerror',
       "Passing the GroupMember.NON_GROUP_MEMBER that dist.new_group returns on ranks outside the group raises TypeError ('must be a ProcessGroup') instead of the ValueError saying the rank is not a member.",
       'composable_shard/_setup/validation.py',
       'if (isinstance(group, int) and group == non_member) or (',
       'if (isinstance(group, dist.ProcessGroup) and group == non_member) or (',
       'tests/distributed/test_fully_shard_errors.py'),
    _m("own62_tracker_watches_ignored", "the change tracker watches every module of the subtree, ignored modules included (a user replacing a parameter of an ignored module is refused)",
       _RUNTIME, "    _watch.track(state, owned_modules(state, module), slots)",
       "    _watch.track(state, list(module.named_modules()), slots)",
       "tests/distributed/test_mixed_precision_options.py", "tests/distributed/test_fully_shard_lifecycle.py"),
    _m("own62_param_dtype_integer_accepted", "an integer mixed_precision.param_dtype is accepted",
       "composable_shard/_setup/validation.py", "        if dtype is not None and not dtype.is_floating_point:",
       "        if dtype is not None and name != \"param_dtype\" and not dtype.is_floating_point:",
       "tests/distributed/test_fully_shard_errors.py"),
    _m('st63_no_root_input_cast',
       "MixedPrecision's cast_root_forward_inputs defaults to False, so forward inputs are no longer cast to param_dtype (dtype mismatch / full-precision compute).",
       'composable_shard/api.py',
       '    cast_root_forward_inputs: bool = True\n',
       '    cast_root_forward_inputs: bool = False\n',
       'tests/distributed/test_fully_shard_mixed_precision.py',
       'tests/distributed/test_mixed_precision_options.py'),
    _m('st63_batchnorm_low_precision',
       'MixedPrecision no longer keeps BatchNorm in full precision by default, so BatchNorm computes (and reduces) in param_dtype and outputs/gradients differ.',
       'composable_shard/api.py',
       '    _module_classes_to_ignore: Sequence[Type[nn.Module]] = (BATCH_NORM,)',
       '    _module_classes_to_ignore: Sequence[Type[nn.Module]] = ()',
       'tests/distributed/test_mixed_precision_options.py',
       'tests/distributed/test_fully_shard_mixed_precision.py'),
    _m('st63_caller_checks_need_all',
       'Caller checks only run when every registered framework is imported, so e.g. torch pipelining (without Lightning imported) is no longer refused where it should be.',
       'composable_shard/_base/callers.py',
       '    if not any(prefix in sys.modules for prefix, _ in entries):',
       '    if not all(prefix in sys.modules for prefix, _ in entries):',
       'tests/unit/test_caller_checks.py',
       'tests/distributed/test_pipelining.py'),
    _m('st63_guard_ignores_data_swap',
       "model.half()/.to(dtype) on a sharded model swaps parameters' .data without being refused, silently cutting them loose from the flat shards.",
       'composable_shard/_setup/apply_guard.py',
       'if id(p) in owners and (getattr(m, name, None) is not p or not same_view(*tensors[id(p)][:2]))}',
       'if id(p) in owners and (getattr(m, name, None) is not p)}',
       'tests/distributed/test_fully_shard_lifecycle.py',
       'tests/distributed/test_data_parallel_shared.py',
       'tests/distributed/test_replicate.py'),
    _m('st63_guard_grad_alias',
       'After a refused cast, gradients are not put back: each .grad keeps the cast/moved data because the saved grad data aliases the grad object.',
       'composable_shard/_setup/apply_guard.py',
       'tensors[id(p)] = (p, p.data, p.grad, None if p.grad is None else p.grad.data)',
       'tensors[id(p)] = (p, p.data, p.grad, None if p.grad is None else p.grad)',
       'tests/distributed/test_fully_shard_lifecycle.py',
       'tests/distributed/test_data_parallel_shared.py',
       'tests/distributed/test_replicate.py'),
    _m('st63_ckpt_rng_not_recorded',
       'checkpoint with the default preserve_rng_state=True no longer records the RNG state, so dropout masks differ in recomputation and gradients are wrong.',
       'composable_shard/checkpoint.py',
       '    if state.preserve_rng_state:\n        frame.record_rng_state()',
       '    if not state.preserve_rng_state:\n        frame.record_rng_state()',
       'tests/unit/test_checkpoint.py',
       'tests/distributed/test_activation_checkpointing.py'),
    _m('st63_ckpt_context_fn_ignored',
       "checkpoint(context_fn=...) is silently ignored: the user's forward/recompute contexts are never entered.",
       'composable_shard/checkpoint.py',
       '    state.context_fn = context_fn if context_fn is not None else _default_context_fn',
       '    state.context_fn = _default_context_fn',
       'tests/unit/test_checkpoint.py',
       'tests/distributed/test_activation_checkpointing.py'),
    _m('st63_inf_norm_min_reduce',
       'Global gradient norm with norm_type=inf combines ranks with MIN instead of MAX (and -inf with MAX), so clipping uses a wrong, per-rank-dependent norm.',
       'composable_shard/_runtime/interop.py',
       'dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN',
       'dist.ReduceOp.MIN if order > 0 else dist.ReduceOp.MAX',
       'tests/distributed/test_clip_grad_norm.py',
       'tests/distributed/test_interop.py',
       'tests/distributed/test_fully_shard_runtime.py'),
    _m('st63_ddp_wrap_not_refused',
       'Wrapping a managed module in DistributedDataParallel no longer raises (the DDP constructor is excluded from the foreign-wrapper match), silently broadcasting shards and double-reducing.',
       'composable_shard/_runtime/interop.py',
       '(key[0] != "distributed" or module.endswith(_DDP_MODULE_SUFFIX))',
       '(key[0] != "distributed" or not module.endswith(_DDP_MODULE_SUFFIX))',
       'tests/distributed/test_interop.py',
       'tests/distributed/test_replicate.py'),
    _m('st63_accel_clip_subset_accepted',
       "ShardedAccelerator.clip_grad_norm_ given only a subset of a sharded model's parameters clips the whole model by its global norm instead of raising.",
       'composable_shard/integrations/transformers.py',
       '            if ids == own:',
       '            if ids <= own:',
       'tests/distributed/test_hf_trainer.py'),
    _m('st63_describe_root_gathers_twice',
       'describe/plan count two all-gathers per step for the root handle (which gathers once), overstating all_gather count and bytes.',
       'composable_shard/_planning/describe.py',
       '    gathers = 1 if h.is_root or h.strategy in _KEPT_FROM_FORWARD_TO_BACKWARD else 2',
       '    gathers = 1 if h.strategy in _KEPT_FROM_FORWARD_TO_BACKWARD else 2',
       'tests/unit/test_describe.py',
       'tests/distributed/test_plan.py'),
    _m('st63_cli_empty_wrap_ignored',
       "`python -m composable_shard describe --wrap ''` (root only) plans the default ModuleList item classes instead of the root alone.",
       'composable_shard/__main__.py',
       '    if wrap is None:\n        return {type(item)',
       '    if not wrap:\n        return {type(item)',
       'tests/unit/test_describe.py',
       'tests/distributed/test_examples.py'),
    _m("own63_cli_wrap_names_not_stripped", "describe --wrap 'A, B' does not strip the names (a space after a comma fails to find the class)",
       "composable_shard/__main__.py", '    names = [n.strip() for n in wrap.split(",") if n.strip()]',
       '    names = [n for n in wrap.split(",") if n.strip()]', "tests/unit/test_describe.py"),
    _m('st64_wrap_overrides_lose_priority',
       "wrap(module, **overrides) inside enable_wrap lets the block's wrapper_kwargs win over the per-call overrides, so e.g. a per-module strategy/mixed_precision/ignored_states passed to wrap() is silently ignored.",
       'composable_shard/wrap.py',
       'return wrapper_cls(module, **{**wrapper_kwargs, **wrap_overrides})',
       'return wrapper_cls(module, **{**wrap_overrides, **wrapper_kwargs})',
       'tests/unit/test_wrap.py'),
    _m('st64_size_policy_strict_threshold',
       'size_based_auto_wrap_policy no longer selects (or descends into) a module whose unclaimed numel equals min_num_params exactly (torch uses >=), so that module gets no handle of its own.',
       'composable_shard/wrap.py',
       'return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(classes))',
       'return nonwrapped_numel > min_num_params and not isinstance(module, tuple(classes))',
       'tests/unit/test_wrap.py',
       'tests/distributed/test_fully_shard_composable.py'),
    _m('st64_buffer_dtype_check_uses_cast_dtype',
       "With MixedPrecision(buffer_dtype=...), set_model_state_dict rejects the model's own state dict (buffers saved in their original dtype) with a spurious 'dtype mismatch' error, because the expected dtype is the cast one.",
       'composable_shard/_state/model_state_dict.py',
       'registry[name].shape if name in registry else t.shape, cast.get(name, t.dtype))',
       'registry[name].shape if name in registry else t.shape, t.dtype)',
       'tests/distributed/test_mixed_precision_options.py',
       'tests/distributed/test_state_dict.py'),
    _m('st64_sharded_sd_aliases_shards',
       'get_model_state_dict(full=False) returns ShardedSlices that alias the live flat shards and buffers instead of copies, so the returned state dict changes as training continues.',
       'composable_shard/_state/model_state_dict.py',
       '    if not full:  # views of the shards and buffers: copied',
       '    if full:  # views of the shards and buffers: copied',
       'tests/distributed/test_state_dict.py',
       'tests/distributed/test_state_dict_ownership.py',
       'tests/distributed/test_torch_state_dict_api.py'),
    _m('st64_dp_world_ignores_replicas',
       "dp_world_size omits the replicate group's size, so under NO_SHARD and the hybrid strategies reduced gradients are divided by the shard group size only (summed, not averaged, across replicas).",
       'composable_shard/_setup/fully_shard_init.py',
       'return _Groups(shard, replicate, rank, world, world * replicas)',
       'return _Groups(shard, replicate, rank, world, world)',
       'tests/distributed/test_fully_shard_training.py',
       'tests/distributed/test_fully_shard_lifecycle.py',
       'tests/distributed/test_fully_shard_composable.py'),
    _m('st64_deferred_meta_params_unfrozen',
       'In the FSDP2 meta-device flow (no reset_parameters, init after to_empty), parameters that were frozen (requires_grad=False) become trainable after fully_shard, so they get gradients and the optimizer updates them.',
       'composable_shard/_setup/fully_shard_init.py',
       'replaced[id(p)] = nn.Parameter(_empty_on(p, plan.compute_device), requires_grad=p.requires_grad)',
       'replaced[id(p)] = nn.Parameter(_empty_on(p, plan.compute_device))',
       'tests/distributed/test_meta_init.py',
       'tests/distributed/test_fsdp2_dropin.py',
       'tests/distributed/test_fully_shard_tensor_parallel.py'),
    _m('st64_param_reassign_not_detected',
       'Reassigning (or deleting) a parameter that a handle owns after fully_shard is no longer recorded, so the next forward silently trains without it instead of raising naming the FQN.',
       'composable_shard/_runtime/watch.py',
       'if tracked is None or tracked.slots.get(name) is param:',
       'if tracked is None or tracked.slots.get(name) is not None:',
       'tests/distributed/test_fully_shard_lifecycle.py'),
    _m('st64_restore_copy_reversed',
       'A failed (rolled-back) set_model_state_dict/load_checkpoint copies the live, partially loaded bytes over the snapshot instead of restoring them, so the model keeps the half-applied load.',
       'composable_shard/_state/load_transaction.py',
       '            live.copy_(saved)',
       '            saved.copy_(live)',
       'tests/distributed/test_checkpoint_faults.py',
       'tests/distributed/test_checkpoint_crash.py',
       'tests/distributed/test_state_dict.py'),
    _m('st64_plan_buffers_aliased',
       "plan()'s timing pass saves the model's buffers as aliases instead of clones, so buffers a forward updates (BatchNorm running stats) stay changed after planning a materialized model.",
       'composable_shard/_planning/plan_profile.py',
       'buffers = [(b, b.detach().clone()) for b in model.buffers()]',
       'buffers = [(b, b.detach()) for b in model.buffers()]',
       'tests/unit/test_plan.py',
       'tests/unit/test_plan_fake.py',
       'tests/distributed/test_plan.py'),
    _m('st64_resume_skips_optimizer_state',
       'ShardedTrainer resuming from a checkpoint reloads the model but not the optimizer state (moments restart from zero), so losses after resume differ from an uninterrupted run.',
       'composable_shard/integrations/transformers.py',
       'self._load_sharded(checkpoint, model, optim)',
       'self._load_sharded(checkpoint, model, None)',
       'tests/distributed/test_hf_trainer.py'),
    _m('st64_clip_coef_min_instead_of_max',
       'clip_grad_norm_ clamps the clip coefficient from below instead of above, so gradients whose total norm is under max_norm are scaled UP to max_norm instead of being left alone.',
       'composable_shard/fully_shard.py',
       'coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)',
       'coef = torch.clamp(max_norm / (total + 1e-6), min=1.0)',
       'tests/distributed/test_fully_shard_runtime.py::test_clip_grad_norm_over_all_shards',
       'tests/distributed/test_clip_grad_norm.py'),
    _m('st64_grad_sync_ignores_recurse',
       'FSDPModule.set_requires_gradient_sync(flag, recurse=False) also changes every nested fully sharded module, so their gradients are left unreduced (local, full-shape) when only the root was meant to skip sync.',
       'composable_shard/fully_shard.py',
       '        for s in self._states(recurse):\n            s.sync_gradients = requires_gradient_sync',
       '        for s in self._states(True):\n            s.sync_gradients = requires_gradient_sync',
       'tests/distributed/test_fully_shard_runtime.py',
       'tests/distributed/test_fsdp2_arguments.py',
       'tests/distributed/test_fully_shard_lifecycle.py'),
    _m("own64_reset_flow_unfreezes", "a frozen parameter materialized from the meta device by reset_parameters() at fully_shard becomes trainable",
       _INIT, "replaced[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty",
       "replaced[id(t)] = nn.Parameter(empty) if is_param else empty", "tests/distributed/test_meta_init.py"),
    _m('st65_float8_amax_signed',
       'float8 all-gather scales each weight by its largest signed value instead of its largest magnitude, so weights whose extreme element is negative are cast with a wrong scale and saturate (wrong forward outputs and gradients).',
       'composable_shard/_base/float8.py',
       'amaxes[i] = shard[s.shard_start:s.shard_start + s.numel].abs().max().to(torch.float32)',
       'amaxes[i] = shard[s.shard_start:s.shard_start + s.numel].max().to(torch.float32)',
       'tests/distributed/test_float8.py'),
    _m('st65_piece_floor_chunk',
       "a tensor-parallel DTensor whose sharded dimension does not divide evenly by the mesh size is refused at fully_shard with a bogus local-shape mismatch error (floor instead of torch.chunk's ceil split).",
       'composable_shard/_base/pieces.py',
       'chunk = -(-sizes[d] // n) if sizes[d] else 0',
       'chunk = sizes[d] // n if sizes[d] else 0',
       'tests/distributed/test_fully_shard_tensor_parallel.py',
       'tests/distributed/test_tensor_parallel.py'),
    _m('st65_piece_norm_groups_inverted',
       'gradient norms of tensor-parallel pieces are completed over the replicating mesh dimensions instead of the sharding ones, so clip_grad_norm_ returns/clips with a wrong global norm under TP.',
       'composable_shard/_base/pieces.py',
       'return [piece.mesh.get_group(i) for i, p in enumerate(piece.placements) if isinstance(p, Shard)]',
       'return [piece.mesh.get_group(i) for i, p in enumerate(piece.placements) if not isinstance(p, Shard)]',
       'tests/distributed/test_fully_shard_tensor_parallel.py',
       'tests/distributed/test_tensor_parallel.py',
       'tests/distributed/test_clip_grad_norm.py'),
    _m('st65_mp_policy_param_only_dropped',
       "FSDP2's MixedPrecisionPolicy with only param_dtype (or only reduce_dtype) set is silently ignored, so the model computes/reduces in full precision instead of the requested dtype.",
       'composable_shard/_setup/fsdp2_compat.py',
       'if policy.param_dtype is None and policy.reduce_dtype is None:',
       'if policy.param_dtype is None or policy.reduce_dtype is None:',
       'tests/distributed/test_fsdp2_arguments.py',
       'tests/distributed/test_fsdp2_dropin.py'),
    _m('st65_divide_factor_zero_accepted',
       'set_gradient_divide_factor(0) (or 0.0) is accepted instead of raising ValueError, and the reduced gradients become inf/nan.',
       'composable_shard/_setup/fsdp2_compat.py',
       'if not value > 0 or value == float("inf"):',
       'if not value >= 0 or value == float("inf"):',
       'tests/distributed/test_fsdp2_arguments.py',
       'tests/distributed/test_fsdp2_dropin.py'),
    _m('st65_init_draws_chain_inverted',
       "consecutive fully_shard calls on a meta model no longer extend one RNG record, so to_empty puts the generator back only to before the last call's draws and the model's own init draws different weights than the unsharded flow.",
       'composable_shard/_setup/init_draws.py',
       'if _record is None or not _same(_record.after, self.before):',
       'if _record is None or _same(_record.after, self.before):',
       'tests/distributed/test_meta_init.py'),
    _m('st65_async_stage_aliases',
       "save_checkpoint_async's staging copy of CPU tensors aliases the live shards, so training steps taken while the write runs leak into the checkpoint (it no longer holds the state of the call).",
       'composable_shard/_state/async_checkpoint.py',
       'copies[key] = tensor.detach().to("cpu", copy=True)',
       'copies[key] = tensor.detach().to("cpu")',
       'tests/distributed/test_async_checkpoint.py'),
    _m('st65_async_copy_key_no_offset',
       'the staging de-duplication key ignores the storage offset, so two same-shaped parameters (or optimizer states) that are views of one flat shard are saved with the same values by save_checkpoint_async.',
       'composable_shard/_state/async_checkpoint.py',
       'key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),',
       'key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),',
       'tests/distributed/test_async_checkpoint.py'),
    _m('st65_pipe_replicate_sync_inverted',
       "under the composable PipelineStage, replicated modules synchronize on every micro-batch except the last, so the last micro-batch's gradients stay unreduced and ranks end the step with different gradients.",
       'composable_shard/integrations/pipelining.py',
       'r.set_requires_gradient_sync(last_backward)',
       'r.set_requires_gradient_sync(not last_backward)',
       'tests/distributed/test_pipelining.py'),
    _m('st65_pipe_reshard_setting_overwritten',
       'the configured reshard_after_backward is re-recorded at every micro-batch (after the stage turned it off), so after a pipelined step with several micro-batches fully sharded modules stay unsharded instead of being resharded as configured.',
       'composable_shard/integrations/pipelining.py',
       'saved.setdefault(id(state), (state, state.reshard_after_backward))',
       'saved[id(state)] = (state, state.reshard_after_backward)',
       'tests/distributed/test_pipelining.py'),
    _m('st65_fabric_no_sync_inverted',
       'fabric.no_backward_sync(model, enabled=...) turns gradient sync off exactly when enabled=False (the last accumulated micro-batch) and leaves it on otherwise, so accumulated gradients are never reduced across ranks at the step.',
       'composable_shard/integrations/lightning.py',
       'return gradient_sync_off(module) if enabled else contextlib.nullcontext()',
       'return gradient_sync_off(module) if not enabled else contextlib.nullcontext()',
       'tests/distributed/test_lightning.py'),
    _m('st65_fabric_load_keeps_internal_key',
       "fabric.load returns the strategy's internal 'composable_shard' bookkeeping entry in the remainder dict given back to the user.",
       'composable_shard/integrations/lightning.py',
       'saved = extra.pop(_FABRIC_KEYS, {})',
       'saved = extra.get(_FABRIC_KEYS, {})',
       'tests/distributed/test_lightning.py'),
    _m("describe_aliasing_per_handle", "at one rank describe() counts an all-gather for every group of a handle with a float8 (or cast) group, also for the groups that alias their shard",
       'composable_shard/_planning/describe.py', 'if h.gathers_in_group and not g.aliases_shard:', 'if h.gathers_in_group:', 'tests/distributed/test_float8.py', 'tests/unit/test_describe.py'),
]


# ---------------------------------------------------------------------------- running
@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str
    detail: str = ""
    seconds: float = 0.0


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache")
    for name in COPIED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=ignore)
    for name in COPIED_FILES:
        shutil.copy2(REPO / name, dest / name)


def _apply(root: Path, mutant: Mutant) -> Optional[str]:
    """Apply ``mutant`` under ``root``; return a status if it cannot be applied."""
    path = root / mutant.file
    if not path.is_file():
        return "STALE"
    text = path.read_text()
    count = text.count(mutant.original)
    if count == 0:
        return "STALE"
    if count > 1:
        return "AMBIGUOUS"
    path.write_text(text.replace(mutant.original, mutant.replacement, 1))
    return None


def _env(root: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    env.pop("COMPOSABLE_SHARD_DEBUG", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_CHECK_IMPORT = textwrap.dedent("""
    import sys
    import composable_shard
    from tests._harness import _rank_context

    def child(queue):
        import composable_shard
        queue.put(composable_shard.__file__)

    if __name__ == "__main__":
        ctx = _rank_context()  # the ranks' forkserver, preloaded as in the harness
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue,))
        process.start()
        print(composable_shard.__file__)
        print(queue.get(timeout=120))
        process.join()
""")


def check_imports_copy(root: Path) -> None:
    """The copy, not the installed (editable) package, is what the tests import, in the parent
    and in a rank started as the test harness starts them (a fork of a preloaded forkserver)."""
    script = root / "_check_import.py"
    script.write_text(_CHECK_IMPORT)
    out = subprocess.run([sys.executable, str(script)], cwd=root, env=_env(root), capture_output=True, text=True,
                         timeout=300)
    script.unlink()
    files = out.stdout.split()
    if out.returncode != 0 or len(files) != 2 or not all(Path(f).resolve().is_relative_to(root.resolve()) for f in files):
        raise SystemExit(f"mutants: the copy in {root} is not what gets imported: {out.stdout!r} {out.stderr[-2000:]!r}")


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        match = re.match(r"^(FAILED|ERROR) (\S+)", line)
        if match:
            return match.group(2)
    return ""


def _pytest(root: Path, tests: Sequence[str], timeout: float) -> Tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, ""
    return out.returncode, out.stdout + out.stderr


def _cuda_available() -> bool:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                         capture_output=True, text=True)
    return out.stdout.strip() == "True"


def run_mutant(mutant: Mutant, timeout: float, keep: bool, has_cuda: bool) -> Result:
    root = Path(tempfile.mkdtemp(prefix=f"cs_mutant_{mutant.name}_"))
    try:
        _copy_tree(root)
        problem = _apply(root, mutant)
        if problem is not None:
            return Result(mutant, problem, f"original substring {'not found' if problem == 'STALE' else 'not unique'} "
                                           f"in {mutant.file}")
        if mutant.requires == "cuda" and not has_cuda:
            return Result(mutant, "NEEDS-CUDA", "applies cleanly; its line only runs on an accelerator")
        code, output = _pytest(root, mutant.tests, timeout)
        if code == -1:
            status, detail = "ERROR", f"timed out after {timeout:g} s"
        elif code == 0:
            status, detail = "SURVIVED", "every selected test passed"
        elif code == 1:
            status, detail = "CAUGHT", _first_failure(output) or "(a test failed)"
        else:
            status, detail = "ERROR", f"pytest exit code {code}: {output.strip().splitlines()[-1:] or ''}"
        return Result(mutant, status, detail)
    finally:
        if keep:
            print(f"  kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def baseline(mutants: Sequence[Mutant], timeout: float, has_cuda: bool) -> None:
    """Run every selection once, unmutated: each must pass, or 'caught' would mean nothing."""
    selections: List[str] = []
    for m in mutants:
        if m.requires == "cuda" and not has_cuda:
            continue
        selections.extend(t for t in m.tests if t not in selections)
    root = Path(tempfile.mkdtemp(prefix="cs_mutant_baseline_"))
    try:
        _copy_tree(root)
        check_imports_copy(root)
        print(f"baseline: {len(selections)} selections on an unmutated copy ...", flush=True)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *selections],
                             cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout * 4)
        if out.returncode != 0:
            raise SystemExit(f"mutants: the unmutated selections fail (pytest exit code {out.returncode}), so no "
                             f"mutant result would mean anything; first failure: {_first_failure(out.stdout)}\n"
                             + out.stdout[-3000:])
        print("baseline: all selections pass", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(results: Sequence[Result]) -> str:
    rows = [("mutant", "file", "status", "first failing test / detail", "s")]
    for r in results:
        rows.append((r.mutant.name, r.mutant.file.replace(f"{PACKAGE}/", ""), r.status, r.detail, f"{r.seconds:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) if i < 4 else cell.rjust(4) for i, cell in enumerate(row)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this mutant (repeatable, or comma-separated)")
    parser.add_argument("--list", action="store_true", help="list the mutants and whether each still applies")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    parser.add_argument("--keep", action="store_true", help="keep each mutant's temporary copy")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per mutant (default {TIMEOUT_S})")
    args = parser.parse_args(argv)

    names = [n for item in args.only for n in item.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; see --list")
    if len({m.name for m in MUTANTS}) != len(MUTANTS):
        parser.error("duplicate mutant names")
    selected = [m for m in MUTANTS if not names or m.name in names]

    if args.list:
        for m in selected:
            text = (REPO / m.file).read_text() if (REPO / m.file).is_file() else ""
            count = text.count(m.original)
            state = "applies" if count == 1 else "STALE" if count == 0 else "AMBIGUOUS"
            extra = f" (needs {m.requires})" if m.requires else ""
            print(f"{m.name:40s} {m.file.replace(PACKAGE + '/', ''):20s} {state}{extra}\n    {m.what}\n    tests: "
                  + " ".join(m.tests))
        print(f"{len(selected)} mutants")
        return 0

    has_cuda = _cuda_available()
    if not args.no_baseline:
        baseline(selected, args.timeout, has_cuda)
    else:
        probe = Path(tempfile.mkdtemp(prefix="cs_mutant_probe_"))
        try:
            _copy_tree(probe)
            check_imports_copy(probe)
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    results: List[Result] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        starts: Dict[str, float] = {}

        def run(m: Mutant) -> Result:
            starts[m.name] = time.monotonic()
            result = run_mutant(m, args.timeout, args.keep, has_cuda)
            result.seconds = time.monotonic() - starts[m.name]
            return result

        for result in pool.map(run, selected):
            print(f"{result.status:10s} {result.mutant.name}: {result.detail}", flush=True)
            results.append(result)

    print()
    print(_table(results))
    counts: Dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    print("\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" of {len(results)} mutants")
    bad = [r for r in results if r.status not in ("CAUGHT", "NEEDS-CUDA")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
