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
_PREFETCH = "tests/distributed/test_fully_shard_runtime.py::test_prefetch_is_issued_before_compute"
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
_TORCH_SD_API = "tests/distributed/test_torch_state_dict_api.py"
_LIGHTNING_TESTS = "tests/distributed/test_lightning.py"
_TP_TESTS = "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_modules_left_out_train_exactly_and_checkpoint"
_TP_REPLICATE_TESTS = "tests/distributed/test_tensor_parallel.py::test_replicate_over_tensor_parallel_modules_is_one_process"
_TP_REFUSALS = "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_modules_are_refused_naming_the_parameter"
_FS_TP = ("tests/distributed/test_fully_shard_tensor_parallel.py::"
          "test_fully_shard_over_tensor_parallel_blocks_trains_and_checkpoints_exactly")
_FSDP2 = f"{PACKAGE}/_setup/fsdp2_compat.py"
_DROPIN = "tests/distributed/test_fsdp2_dropin.py::test_fsdp2_dropin"


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
       _RUNTIME, "return state.reshard_after_forward and not state.is_root",
       "return state.reshard_after_forward", f"{_STORAGE}[2]"),
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
       "tests/distributed/test_fully_shard_runtime.py::test_module_called_twice_in_one_forward"),
    _m("order_checked_on_every_call", "every call of a module, not only its first, is checked against exec order",
       _RUNTIME, "    if id(handle) in root.ctx.forward_seen:\n        return False\n", "",
       "tests/distributed/test_fully_shard_runtime.py::test_module_called_twice_in_one_forward"),
    _m("forward_prefetch_wrong_target", "forward prefetch gathers two handles ahead",
       _RUNTIME, "_prefetch(root, root.ctx.exec_order, handle.exec_index + 1)",
       "_prefetch(root, root.ctx.exec_order, handle.exec_index + 2)", _PREFETCH,
       "tests/distributed/test_fully_shard_runtime.py::test_at_most_two_handles_gathered"),
    _m("forward_prefetch_full_shard_only", "forward_prefetch only honoured under FULL_SHARD",
       _RUNTIME, "state.forward_prefetch and _root_of(state).ctx.exec_order_recorded:",
       "state.forward_prefetch and state.strategy is ShardingStrategy.FULL_SHARD and _root_of(state).ctx.exec_order_recorded:",
       _PREFETCH),
    _m("unused_prefetch_kept", "a block forward prefetch gathered and the forward skipped stays gathered",
       _RUNTIME, "        _release_unused_prefetches(state)\n", "",
       "tests/distributed/test_fully_shard_runtime.py::test_prefetched_block_skipped_by_the_forward_is_released"),
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
       _REDUCTION, "if group is not None and dist.get_world_size(group) > 1:", "if False:", f"{_STORAGE}[2]", f"{_TRAINING}[2]"),
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
       f"{_STATE_DICT_TESTS}::test_full_state_dict_is_the_plain_models"),
    _m("load_key_without_prefix", "load_state_dict() looks for nested entries without their prefix",
       _STATE_DICT, "        key = prefix + name\n", "        key = name\n",
       f"{_STATE_DICT_TESTS}::test_full_state_dict_is_the_plain_models"),
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
       f"{PACKAGE}/plan.py", "        comm += costs[k + 1].unsharded_grad", "        comm += 0",
       "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions"),
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
       f"{_DIVERGENCE_TESTS}::test_different_handle_order_raises_in_first_iteration"),
    _m("first_iteration_not_checked", "handle order only agreed on in debug mode",
       _RUNTIME, "if root is not None and (root.ctx.check_order or root.ctx.debug_checks) and handle.will_gather():",
       "if root is not None and root.ctx.debug_checks and handle.will_gather():",
       f"{_DIVERGENCE_TESTS}::test_different_handle_order_raises_in_first_iteration"),
    _m("debug_mode_never_on", "COMPOSABLE_SHARD_DEBUG=1 turns nothing on",
       _DIVERGENCE, 'return flag not in ("", "0") or', 'return False and',
       f"{_DIVERGENCE_TESTS}::test_debug_mode_checks_every_iteration"),
    _m("p2p_tag_without_handle", "gloo pairs a gather with the peers' gather of another handle (mixed shards)",
       _COLLECTIVES, "    return kind + 4 * (match % (1 << 24))", "    return kind",
       f"{_DIVERGENCE_TESTS}::test_order_diverging_after_the_first_iteration_times_out_instead_of_mixing_shards"),
    _m("reentrant_arrival_reduced_early", "a reentrant recomputation's part of a handle's gradient is reduced on its own",
       _RUNTIME, "    if group.forward_grad_due:  # a reentrant", "    if False:  # a reentrant",
       "tests/distributed/test_hf_models.py::test_hf_decoders[activation_checkpointing]"),
    # ---------------------------------------------------------------- misuse between steps
    _m("called_while_sharded_unchecked", "a module called while its owner is sharded computes on 1-D slices",
       _RUNTIME, "            if all(holder is not m for m in members):",
       "            if all(holder is not m for m in members) and False:",
       "tests/distributed/test_called_while_sharded.py"),
    _m("detached_params_unchecked", "a parameter whose .data was replaced after fully_shard trains on silently",
       _RUNTIME, "        if detached:\n", "        if False:\n",
       "tests/distributed/test_fully_shard_lifecycle.py::test_model_changes_after_fully_shard_raise_at_next_forward"),
    _m("unfrozen_params_not_adopted", "a parameter unfrozen after replicate keeps each rank's own gradient",
       _REPLICATE, "    if not unfrozen or state.backward is not None:", "    if True:",
       f"{_REPLICATE_TESTS}::test_parameters_unfrozen_after_replicate_are_averaged"),
    _m("casts_not_guarded", "model.half()/.to(dtype) after fully_shard or replicate goes through",
       f"{PACKAGE}/_setup/apply_guard.py", '    if _depth["init"] or _depth["apply"]:', "    if True:",
       "tests/distributed/test_fully_shard_lifecycle.py::test_casts_and_moves_after_fully_shard_are_refused_and_change_nothing",
       f"{_REPLICATE_TESTS}::test_errors_identity_and_skipped_parameters"),
    _m("collective_call_hint_dropped", "a state dict taken on one rank only times out blaming the training step",
       _UNSHARD, "state.process_group, tag=tag, hint=hint).wait()", "state.process_group, tag=tag).wait()",
       "tests/distributed/test_fully_shard_divergence.py::test_collective_call_made_on_one_rank_says_so"),
    _m("compile_wrapper_not_unwrapped", "a checkpoint taken through torch.compile's wrapper keeps its _orig_mod. names",
       f"{PACKAGE}/_base/torch_compat.py", "        module = module._orig_mod  #", "        break  #",
       "tests/distributed/test_compile.py::test_checkpoint_through_torch_compile_wrapper"),
    _m("param_hooks_not_refused", "a gradient hook on an original parameter is accepted and never runs",
       f"{PACKAGE}/_runtime/flat_param.py", "                if has_grad_hooks(p):", "                if False:",
       "tests/distributed/test_fully_shard_lifecycle.py::test_hooks_on_original_parameters_are_refused"),
    _m("step_disagreement_ignored", "an optimizer step skipped on one rank (GradScaler) goes unreported",
       f"{PACKAGE}/_runtime/watch.py", "if num_ranks * squares == total * total:", "if True:",
       f"{_DIVERGENCE_TESTS}::test_optimizer_stepped_on_some_ranks_raises"),
    _m("step_counter_counts_every_optimizer", "an optimizer of a rank's own model counts as one of the model's",
       f"{PACKAGE}/_runtime/watch.py", "any(id(p) in self.param_ids for g in groups for p in g[\"params\"])", "True",
       f"{_DIVERGENCE_TESTS}::test_optimizer_stepped_on_some_ranks_raises",
       "tests/distributed/test_two_models.py::test_optimizer_step_of_one_model_makes_the_other_gather_nothing"),
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
       _INTEROP, '        if current.f_globals.get("__name__") == _CLIP_MODULE:', "        if False:",
       "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[2]"),
    _m("torch_clip_frame_check_immediate_caller",
       "torch's clip under a torch function mode (set_default_device, torch.device) sees each rank's own norm",
       _INTEROP, "return below is None or _passes_on(below, func)", "return below is None", f"{_CLIP_MIX}_2"),
    _m("torch_clip_frame_check_anywhere_on_stack",
       "a norm taken inside a generator that torch's clip consumes (one rank logging) becomes collective",
       _INTEROP, "return below is None or _passes_on(below, func)", "return True",
       "tests/distributed/test_clip_grad_norm.py::test_norms_outside_torch_clipping_stay_local_under_modes"),
    _m("torch_clip_sums_norms_not_powers", "partial norms are summed instead of their p-th powers",
       f"{PACKAGE}/_runtime/interop.py", "    return norms if math.isinf(order) or order == 0 else norms.pow(order)",
       "    return norms", "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[2]"),
    _m("foreign_wrappers_allowed", "DistributedDataParallel around a sharded model broadcasts rank 0's slices",
       _INTEROP, "    if found is None:\n        return", "    if True:\n        return",
       "tests/distributed/test_interop.py::test_torch_data_parallel_wrappers_are_refused_at_construction"),
    _m("torch_contract_apis_allowed", "torch's composable replicate on a sharded model is set up, its DDP broadcasts",
       _INTEROP, "applied = _FOREIGN.get(_contract_api(frame)) if key == _CONTRACT else None", "applied = None",
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
       "                views = [view if tp is None else as_dtensor(tp, view) for view, tp in zip(views, fp._pieces)]",
       "                views = [view for view, tp in zip(views, fp._pieces)]", _FS_TP),
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
    _m("fs_tp_meta_pieces_deferred", "a meta-device DTensor is left for to_empty's init, which writes pieces as wholes",
       _INIT, "        if pieces:  # an init written for whole parameters", "        if False:  # an init written for whole parameters",
       _TP_REFUSALS),
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
       _OPTIM, "return agreed(api, [group] if collective else None, prepare,", "return agreed(api, None, prepare,",
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
       f"{_STATE_DICT_TESTS}::test_several_optimizers_and_extra_state"),
    _m("lightning_accumulation_syncs", "ShardedStrategy reduces every accumulated micro-batch",
       _LIGHTNING, "        with gradient_sync_off(self.model):\n            yield",
       "        with contextlib.nullcontext():\n            yield",
       f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("lightning_model_parallel_saves", "Lightning's ModelParallelStrategy writes a checkpoint it cannot resume",
       _INTEROP, '_LIGHTNING_MODEL_PARALLEL = ("lightning.pytorch.strategies.model_parallel", "lightning.fabric',
       '_LIGHTNING_MODEL_PARALLEL = ("lightning.pytorch.strategies.model_parallel_", "lightning.fabric',
       f"{_LIGHTNING_TESTS}::test_trainer_matches_single_process_lightning_and_resumes"),
    _m("pipeline_syncs_every_microbatch", "the pipelined stage reduces every micro-batch's gradients",
       f"{PACKAGE}/integrations/pipelining.py", "            m.set_requires_gradient_sync(False, recurse=False)",
       "            m.set_requires_gradient_sync(True, recurse=False)",
       "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"),
    _m("pipeline_step_never_reduced", "the pipelined stage's end of step does not reduce the accumulated sum",
       f"{PACKAGE}/integrations/pipelining.py", "            m.reduce_accumulated_gradients()",
       "            pass",
       "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"),
    _m("pipeline_zero_bubble_allowed", "zero-bubble schedules are built over fully sharded stages",
       f"{PACKAGE}/integrations/pipelining.py", "            if split and self._manages_fully_sharded():",
       "            if False:",
       "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives"),
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
       _FSDP2, "            s.reshard_after_forward = reshard_after_forward",
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
