"""The quick tier: `bash scripts/test.sh --quick` (pytest's `--quick`), for while code changes.

Every library module is exercised, each at the device count that shows what it does: 2 devices
for anything sharded (the smallest count with a collective and a shard that is not the whole
tensor), 4 only where the test is about more replicas than that (resharding 4 -> 2, a launch of
4 replica threads), 1 never on its own (a single device shards nothing the 2-device runs do not).
Left out: the compiled-byte tests of test_memory.py (each compiles a dozen programs in a process
of its own, 40 s and more), the 4-replica launches of test_accelerate.py, test_launch.py,
test_trainer.py, test_trainer_tasks.py, test_trl.py and test_replica_failure.py, the fuzz and the killed saves.
The full suite (`bash scripts/test.sh`, CI) runs every test at 1, 2 and 4 devices and all of those;
run it before committing.

An entry is a test id below tests/: a file, a test (all its parameters) or one parametrized case.
An entry that matches no test stops the run, so a renamed test cannot drop out unseen.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

QUICK: Tuple[Tuple[str, str], ...] = (
    # engine: wrapping, options, errors (no devices, or one short step)
    ("test_wrap.py", "wrap.py: every policy and recursive wrapping"),
    ("test_errors.py", "options.py, fsdp.py: bad input named, at construction"),
    ("test_structure.py", "the import graph, the plugin's fields against FsdpOptions, shared options objects"),
    # engine: training equals one plain model (fsdp.py, unit_state.py, construction.py, param_group.py,
    # linear.py, checkpointing.py)
    ("test_parity.py::test_fsdp_matches_single_device[2dev-nested_linear-default-sgd]", "per-parameter shards"),
    (
        "test_parity.py::test_fsdp_matches_single_device[2dev-tied_transformer-flatten_parameters=True-adam-accum2]",
        "flat shards, tied weights and buffers, accumulation",
    ),
    (
        "test_parity.py::test_fsdp_matches_single_device[2dev-frozen_odd-shard_param_on_dim_0=True-sgd]",
        "dim-0 shards, frozen parameters, odd sizes (padding)",
    ),
    (
        "test_parity.py::test_fsdp_matches_single_device[2dev-llama-default-sgd-checkpointed]",
        "a transformers model, activation checkpointing",
    ),
    (
        "test_lm_loss_in_chunks.py::test_loss_from_lm_heads_chunks_trains_as_the_plain_model",
        "sharded_loss.py, sharded_tables.py: the vocabulary kept sharded, the loss from lm_head's chunks",
    ),
    (
        "test_training_loop.py::test_gradient_accumulation_matches_plain_model[2dev-flat-set_requires_gradient_sync]",
        "no_sync as Accelerate calls it",
    ),
    (
        "test_training_loop.py::test_freezing_and_unfreezing_units_after_wrapping[2dev-flat]",
        "requires_grad followed after wrapping",
    ),
    (
        "test_training_loop.py::test_odd_call_orders_leave_the_model_usable[2dev-forward_raises]",
        "hooks free what a failed forward gathered",
    ),
    ("test_training_loop.py::test_param_init_fn_materializes_a_meta_model[2dev-flat]", "meta-device models"),
    # what the compiler makes of it: byte and collective counts (scripts/hlo_dump.py)
    (
        "test_compiled_program.py::test_every_block_gathers_again_for_backward[2dev-barriers]",
        "ZeRO-3's 2L + 1 gathers and the barriers",
    ),
    (
        "test_collectives.py::test_coalescing_gathers_each_unit_once_per_pass[2dev]",
        "collectives.py: coalesced gathers",
    ),
    (
        "test_collectives.py::test_bucket_is_reduced_once_it_holds_more_than_its_limit[2dev]",
        "collectives.py: bucketing by bytes",
    ),
    # state dicts and checkpoints
    ("test_state_dict.py::test_torch_xla_consolidates_our_shards[2dev-flat-llama]", "state_dict.py, shard metadata"),
    ("test_state_dict.py::test_summon_full_params_gathers_then_frees[2dev]", "summon_full_params"),
    (
        "test_checkpoint.py::test_resume_on_the_same_ranks_is_bit_exact[2dev-llama-flat-False]",
        "checkpoint/sharded.py, files.py, format.py: bit-exact resume",
    ),
    (
        "test_checkpoint.py::test_resharding_to_another_world_size_and_layout[4-per-parameter-2-flat]",
        "resharding needs two device counts and two layouts",
    ),
    (
        "test_checkpoint.py::test_pretrained_weights_load_straight_into_shards[2dev-flat-False-None]",
        "checkpoint/pretrained.py",
    ),
    ("test_checkpoint.py::test_truncated_rank_file_is_named", "bad checkpoints named"),
    ("test_checkpoint_safety.py::test_malformed_metadata_is_refused_by_file_and_field", "untrusted metadata"),
    ("test_consolidate.py::test_from_pretrained_loads_the_trained_model[tied]", "checkpoint/consolidate.py"),
    (
        "test_checkpoint_store.py::test_transient_failures_are_retried_and_permanent_ones_end_the_save",
        "checkpoint/store.py: URLs, retries, the per-save record (memory filesystem, no server)",
    ),
    (
        "test_checkpoint_store.py::test_accelerate_save_state_load_state_and_save_model_in_a_bucket",
        "hf_accelerate/checkpoints.py, accelerate_files.py: save_state in an S3 bucket (moto's server)",
    ),
    ("test_consolidate.py::test_bad_arguments", "cli.py, in process"),
    ("test_consolidate.py::test_console_script_fails_cleanly", "__main__.py: python -m accel_xla_fsdp"),
    ("test_plan.py::test_bad_model_is_named", "plan.py: bad input named, nothing compiled"),
    ("test_plan.py::test_config_file_settings_and_overrides", "plan.py: the launch config file's settings"),
    (
        "test_torch_xla_conversion.py::test_torch_xla_rank_files_read_back_the_model[script-flat]",
        "checkpoint/torch_xla_files.py",
    ),
    ("test_torch_xla_conversion.py::test_a_pickle_that_would_run_code_is_refused", "no pickle code runs"),
    # the runner, replica threads and their meetings (xla_cpu/, runner.py)
    ("test_runner.py::test_results_in_rank_order_on_cpu[2dev]", "run on a pool"),
    ("test_runner.py::test_seeded_builds_identical_models_on_every_replica", "seeded"),
    ("test_runner.py::test_replica_exception_ends_the_run_promptly_and_pool_recovers", "a failing replica"),
    ("test_replica_run.py", "meetings at graph boundaries: in-process, no devices"),
    (
        "test_patches.py::test_what_is_installed_is_the_table_and_uninstall_restores_it[CPU]",
        "xla_cpu/patches.py: what is installed is the table, and uninstall() restores every name",
    ),
    # the Accelerate integration
    ("test_accelerator.py::test_accelerate_collectives_on_replica_threads", "xla_cpu/host_collectives.py"),
    (
        "test_accelerator.py::test_param_groups_keep_their_settings_in_every_layout[flat]",
        "hf_accelerate/accelerator.py, optimizer.py",
    ),
    ("test_accelerator.py::test_plugin_reads_code_then_environment_then_config_file", "hf_accelerate/plugin.py"),
    ("test_accelerator.py::test_bad_config_is_refused", "plugin errors"),
    (
        "test_accelerator.py::test_checkpoint_folders_commit_and_rotate[local]",
        "hf_accelerate/checkpoints.py: complete saves and rotation on a local disk",
    ),
    (
        "test_pretrained_loading.py::test_shards_come_from_the_files_and_equal_the_plain_model[tied]",
        "hf_accelerate/pretrained_loading.py",
    ),
    ("test_stock_save.py::test_save_on_the_main_process_only_is_refused_at_once", "the stock save's gather"),
    (
        "test_launch_habits.py::test_logs_print_as_on_the_cpu",
        "hf_accelerate/launch.py, xla_cpu/script_logging.py: one real accelerate launch of 4 replicas",
    ),
    (
        "test_launch_habits.py::test_set_seed_then_from_config_builds_the_same_model_everywhere",
        "xla_cpu/seeds.py (the same launch)",
    ),
    ("test_launch_habits.py::test_tied_from_pretrained_inside_main_loads_into_shards", "(the same launch)"),
    ("test_replica_datasets.py::test_replica_threads_take_turns_through_tqdm_lock", "xla_cpu/tqdm_lock.py"),
    ("test_replica_dill_capture.py::test_replica_threads_each_capture_their_own_stdout", "xla_cpu/dill_capture.py"),
    ("test_trainer.py::test_fsdp_config_keys_mean_what_the_trainer_documents", "hf_trainer/arguments.py"),
    ("test_trainer.py::test_what_xla_fsdp_does_not_take_is_refused_by_name", "hf_trainer/arguments.py errors"),
    (
        "test_trl.py::test_the_mixin_finds_the_training_arguments_wherever_they_are",
        "hf_trainer/trainer.py: XlaFsdpTrainerMixin, any signature (DPO's)",
    ),
    ("test_trl.py::test_every_trainer_class_gets_the_mixin_in_front_once", "what the launcher does to every Trainer"),
    (
        "test_trl.py::test_trl_batches_of_new_lengths_are_padded_or_refused",
        "hf_trainer/arguments.py: TRL's batch shapes",
    ),
    ("test_trl.py::test_a_script_that_uses_spmd_is_refused_at_start", "launcher.py: refused at start"),
    ("test_trainer_resume.py", "hf_trainer/resume.py: resume skips an incomplete checkpoint-N, on disk"),
    ("test_docs.py", "the settings table and the docs' links"),
    ("test_quick_tier.py", "this selection"),
)


def _selects(entry: str, test_id: str) -> bool:
    return test_id == entry or test_id.startswith(f"{entry}::") or test_id.startswith(f"{entry}[")


def select(test_ids: Sequence[str]) -> Tuple[List[bool], List[str]]:
    """Which of ``test_ids`` (relative to tests/) are in the quick tier, and the entries that
    matched none of them."""
    chosen = [any(_selects(entry, t) for entry, _ in QUICK) for t in test_ids]
    unmatched = [entry for entry, _ in QUICK if not any(_selects(entry, t) for t in test_ids)]
    return chosen, unmatched
