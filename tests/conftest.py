"""Suite-wide pytest hooks: the longest tests start first.

``python -m pytest -n 2 tests`` (pytest-xdist's load scheduling) hands tests to its workers in
collection order, alternating at first. A long test collected late ran alone at the end while the
other worker had finished (the suite took 769 s quiet with 1,223 s of test time on two workers), so
the tests measured longest (``--durations=0`` on a quiet machine, 2026-11-28, 8 s or more in their
call) are moved to the front in that order, where the first batch splits them between the workers.
Not a test whose time is a module-scoped fixture's (moved away from its module's other tests, the
fixture would be made twice). A name not collected is ignored; a test that grows past 8 s belongs in
the list.
"""

from __future__ import annotations

from typing import Any, Dict, List

LONGEST_FIRST = [
    "tests/distributed/test_torchtitan.py::test_torchtitan_llama3_equals_fsdp2_in_every_parallelism",
    "tests/distributed/test_hf_models.py::test_hf_decoders",
    "tests/distributed/test_plan_peak.py::test_llama_peaks_are_within_their_budgets_and_predictions",
    "tests/unit/test_plan_fake.py::test_large_config_plans_on_fake_tensors_in_seconds[8b-worlds0]",
    "tests/distributed/test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix_2",
    "tests/distributed/test_plan_peak.py::test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions",
    "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[2]",
    "tests/distributed/test_fully_shard_memory.py::test_unsharded_gradients_alive_at_once_are_bounded[4]",
    "tests/distributed/test_compile.py::test_compile_per_block[gpt2-inductor]",
    "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives[schedules0-zero_bubble0]",
    "tests/distributed/test_fully_shard_divergence.py::test_unagreed_divergence_times_out_naming_the_collective",
    "tests/unit/test_plan_search.py::test_no_block_can_move_to_a_cheaper_option_and_still_fit[llama]",
    "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_sequence_loss_parallel_and_a_llama_plan_equals_fsdp2_and_one_process",
    "tests/distributed/test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix_4",
    "tests/distributed/test_harness.py::test_ranks_die_with_a_killed_test_process",
    "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[1]",
    "tests/distributed/test_plan.py::test_plan_applied_agrees_with_describe",
    "tests/distributed/test_compile.py::test_compile_with_activation_checkpointing",
    "tests/distributed/test_harness.py::test_hang_is_killed_and_reported_with_stack",
    "tests/distributed/test_hf_trainer.py::test_trainer_parity_resume_and_save_model",
    "tests/distributed/test_fully_shard_lifecycle.py::test_updates_are_visible_after_a_forward_without_backward",
    "tests/distributed/test_examples.py::test_examples_on_two_ranks",
    "tests/distributed/test_activation_checkpointing.py::test_every_way_of_checkpointing_matches_training_without[4]",
    "tests/distributed/test_muon.py::test_parity_with_torch_muon_every_step[4]",
    "tests/distributed/test_pipelining.py::test_schedules_match_one_process_and_fsdp2s_collectives[schedules1-zero_bubble1]",
    "tests/unit/test_plan_fake.py::test_measured_and_fake_sources_choose_alike",
    "tests/distributed/test_no_numpy.py::test_two_rank_job_runs_without_numpy",
    "tests/distributed/test_fully_shard_composable.py::test_composable_fully_shard_behaviours[4]",
    "tests/distributed/test_compile.py::test_compile_per_block[benchmark-aot_eager]",
    "tests/distributed/test_torchtitan_blocks.py::test_torchtitan_style_llama[4]",
    "tests/distributed/test_fully_shard_training.py::test_parity_with_local_and_torch_fsdp[2]",
    "tests/distributed/test_fully_shard_tensor_parallel.py::test_fully_shard_over_tensor_parallel_blocks_trains_and_checkpoints_exactly",
    "tests/distributed/test_fully_shard_training.py::test_parity_with_local_and_torch_fsdp[4]",
    "tests/distributed/test_fully_shard_lifecycle.py::test_hybrid_sharding_at_four_ranks",
    "tests/distributed/test_torchtitan_blocks.py::test_torchtitan_style_llama[2]",
    "tests/distributed/test_interop.py::test_torch_clip_grad_norm_uses_the_global_norm[4]",
    "tests/distributed/test_lightning.py::test_trainer_matches_single_process_lightning_and_resumes",
    "tests/distributed/test_fully_shard_composable.py::test_composable_fully_shard_behaviours[2]",
]


def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
    rank: Dict[str, int] = {nodeid: i for i, nodeid in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))  # stable: the rest keep their order
