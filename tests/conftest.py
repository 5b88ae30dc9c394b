"""Suite-wide pytest hooks: the longest tests start first, and the other worker yields to them.

``python -m pytest -n 2 tests`` runs on pytest-xdist's load scheduling. Its first batch hands each
worker a block of consecutive tests, an eighth of the collection each. So the tests measured longest
are moved to the front: the first worker runs them one after another, while the other worker runs the
short tests and then takes whatever is left. A long test collected late used to run alone at the end.

The list (2026-11-29): every test timed alone (``-n 0``, wall and the machine's CPU time per test),
the longest first until they add up to about 600 s of the suite's 864 s, leaving out the tests that
mostly wait (a process group's timeout: little CPU, they fit in the other worker's share) and those
whose time is a module-scoped fixture's (moved away from its module's other tests, the fixture would
be made twice). A name that is not collected is ignored. Keep it under an eighth of the collection
(see ``pytest_runtest_setup``).

Most long tests spawn 2-4 ranks, which keep both cores busy by themselves, so two of them running at
once gain nothing. ``--maxschedchunk=1`` makes the workers take the long tests in turn, so they run
two at a time; measured, that was slower (fresh-clone CI: 864 s against 791 s the session before,
with about 20 s of tests added).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

LONGEST_FIRST = [
    "tests/distributed/test_torchtitan.py::test_torchtitan_llama3_equals_fsdp2_in_every_parallelism",
    "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives[schedules0-zero_bubble0]",
    "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions",
    "tests/distributed/test_hf_models.py::test_hf_decoders",
    "tests/unit/test_api_surface.py::test_package_type_checks",
    "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions",
    "tests/unit/test_plan_fake.py::test_large_config_plans_on_fake_tensors_in_seconds[8b-worlds0]",
    "tests/distributed/test_state_dict.py::test_state_dicts[4]",
    "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_sequence_loss_parallel_and_a_llama_plan_equals_fsdp2_and_one_process",
    "tests/distributed/test_harness.py::test_ranks_die_with_a_killed_test_process",
    "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives[schedules1-zero_bubble1]",
    "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[2]",
    "tests/distributed/test_fully_shard_composable.py::test_composable_fully_shard_behaviours[4]",
    "tests/distributed/test_no_numpy.py::test_two_rank_job_runs_without_numpy",
    "tests/distributed/test_plan.py::test_plan_applied_agrees_with_describe",
    "tests/distributed/test_compile.py::test_compile_per_block[gpt2-inductor]",
    "tests/distributed/test_state_dict.py::test_state_dicts[2]",
    "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_tensor_parallel_blocks_trains_and_checkpoints_exactly",
    "tests/distributed/test_state_dict.py::test_resume_equals_the_uninterrupted_run",
    "tests/distributed/test_muon.py::test_parity_with_torch_muon_every_step[4]",
    "tests/distributed/test_float8.py::test_torchao_float8_under_fully_shard[4]",
    "tests/distributed/test_fully_shard_lifecycle.py::test_hybrid_sharding_at_four_ranks",
    "tests/distributed/test_examples.py::test_examples_on_two_ranks",
    "tests/distributed/test_hf_trainer.py::test_trainer_parity_resume_and_save_model",
    "tests/distributed/test_fully_shard_training.py::test_parity_with_local_and_torch_fsdp[4]",
    "tests/distributed/test_examples.py::test_train_gpt_as_a_plain_script",
    "tests/unit/test_plan_fake.py::test_measured_and_fake_sources_choose_alike",
    "tests/distributed/test_tensor_parallel.py::test_replicate_over_tensor_parallel_modules_is_one_process",
    "tests/distributed/test_compile.py::test_compile_with_activation_checkpointing",
    "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[4]",
    "tests/unit/test_caller_checks.py::test_the_lightning_check_loads_without_lightning",
    "tests/distributed/test_fully_shard_memory.py::test_unsharded_gradients_alive_at_once_are_bounded[4]",
    "tests/distributed/test_fully_shard_training.py::test_parity_with_local_and_torch_fsdp[2]",
    "tests/distributed/test_fully_shard_lifecycle.py::test_updates_are_visible_after_a_forward_without_backward",
    "tests/distributed/test_compile.py::test_compile_per_block[benchmark-aot_eager]",
    "tests/distributed/test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix_4",
    "tests/distributed/test_lightning.py::test_trainer_matches_single_process_lightning_and_resumes",
    "tests/distributed/test_hf_trainer.py::test_integration_needs_the_hf_extra_and_core_never_imports_it",
    "tests/distributed/test_torch_state_dict_api.py::test_state_dicts_held_by_rank0_load_everywhere_or_raise_everywhere[4-HYBRID_SHARD]",
    "tests/distributed/test_torchtitan_blocks.py::test_torchtitan_style_llama[4]",
    "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_two_tensor_parallel_mesh_dimensions",
    "tests/distributed/test_fully_shard_composable.py::test_composable_fully_shard_behaviours[2]",
    "tests/distributed/test_compose.py::test_composition_matrix[4]",
    "tests/distributed/test_fsdp2_arguments.py::test_fsdp2_arguments_have_fsdp2s_effect",
    "tests/distributed/test_float8.py::test_torchao_float8_under_fully_shard[2]",
    "tests/distributed/test_replicate.py::test_parity_with_ddp_and_local[4]",
    "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[4]",
    "tests/distributed/test_fsdp2_dropin.py::test_fsdp2_dropin[4]",
    "tests/distributed/test_fully_shard_divergence.py::test_disagreement_raises_on_every_rank[4]",
    "tests/distributed/test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix_2",
    "tests/distributed/test_fully_shard_divergence.py::test_disagreement_raises_on_every_rank[2]",
    "tests/distributed/test_fully_shard_lifecycle.py::test_changes_after_fully_shard_are_refused",
    "tests/distributed/test_fully_shard_lifecycle.py::test_parameters_without_gradient_keep_grad_none",
]


# See [Note: The other worker yields]. Niceness 10: CFS weight 110 against 1024.
YIELDING_NICENESS = 10
_LONGEST = frozenset(LONGEST_FIRST)


def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
    rank: Dict[str, int] = {nodeid: i for i, nodeid in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))  # stable: the rest keep their order


def pytest_runtest_setup(item: Any) -> None:
    """[Note: The other worker yields]  Two tests at once on two cores slow each other down by more
    than they gain: most spawn 2-4 ranks that wait on each other in every collective, and a rank
    waiting for a core delays all its peers (measured, 2026-11-29: the suite took 864 s run one
    test at a time and 882 s with ``-n 2``; one Llama plan test took 27 s alone and 139 s in the
    ``-n 2`` run). So the long tests get the machine: once a pytest-xdist worker reaches a test that
    is not in LONGEST_FIRST, it lowers its own priority and that of the ranks it starts from then
    on (``COMPOSABLE_SHARD_TEST_NICENESS``, applied by each rank in ``_harness.py``), and runs in the
    cores' idle time: the long tests' ranks leave about a quarter of two cores idle while they wait
    on each other. Niceness only ever goes up, and it is safe here: the long tests are the front of
    the first worker's first batch (LONGEST_FIRST is shorter than a batch, an eighth of the
    collection), so no worker meets one after a short one. Without pytest-xdist nothing changes."""
    if "PYTEST_XDIST_WORKER" in os.environ and item.nodeid not in _LONGEST \
            and "COMPOSABLE_SHARD_TEST_NICENESS" not in os.environ:
        os.nice(YIELDING_NICENESS)
        os.environ["COMPOSABLE_SHARD_TEST_NICENESS"] = str(YIELDING_NICENESS)
