"""The README's ten-minute tier: the smallest honest case of each capability.

``tests/conftest.py`` marks every test not named here ``slow``; the README's command runs
``-m "not slow and not zoo and not soak"`` and ``.ci/run`` runs ``-m "slow and not zoo and not soak"``
after it, so every test still runs in CI. An entry is a file (``test_x.py``), a test with all its cases
(``test_x.py::test_f``), one case (``test_x.py::test_f[id]``) or the cases an id with ``*`` wildcards matches
(``test_x.py::test_f[p2p-*``, ``test_x.py::test_f[*-4w]``); an entry that names no test fails the session. Add a capability's smallest honest case here; everything else belongs to the slow tier by default.
The times of both tiers, measured, are in docs/testing.md."""

from __future__ import annotations

import re

FAST: dict[str, list[str]] = {
    "geometry, the verdict and its planted errors, the layers' import structure": [
        "test_geometry.py", "test_verify.py", "test_verdict_panel.py::test_the_panel_on_small_models",
        "test_architecture.py", "test_seams.py", "test_engine_step.py", "test_launch_env.py", "test_cli_help.py",
        "test_recorder.py", "test_provenance.py",
    ],
    "each layer family, driver mode (1D on 2 workers, 2D and 3D on 4)": [
        "test_layers.py::test_layer_matches_single_process[*-2w]",
        "test_layers.py::test_layer_matches_single_process[*-4w]",
    ],
    "the driver mode's two transports, whole networks and losses": [
        "test_equivalence.py::test_matches_single_process_float64[p2p-cnn2d-4w-2x2]",
        "test_equivalence.py::test_matches_single_process_float64[rpc-cnn2d-4w-2x2]",
        "test_equivalence.py::test_matches_single_process_float64[p2p-mixed3d-4w-2x1x2]",
        "test_equivalence.py::test_matches_single_process_float64[rpc-mixed3d-4w-2x1x2]",
        "test_equivalence.py::test_matches_single_process_float64[p2p-cnn1d-4w-thin]",
        "test_equivalence.py::test_matches_single_process_float64[rpc-cnn1d-4w-thin]",
        "test_equivalence.py::test_dense_loss_never_gathers_output",
        "test_several_outputs.py::test_several_outputs_match_single_process[p2p-deep-supervision]",
        "test_several_outputs.py::test_several_outputs_match_single_process[rpc-dict-heads]",
        "test_zoo.py::test_zoo_model[torchvision/resnet18]",
        "test_zoo.py::test_zoo_model[monai/SegResNet]",
    ],
    "each layer family and whole networks on SPMD ranks (one spawn of 2, one of 4)": [
        "test_spmd.py::test_matches_single_process[layer/conv1d-padding-modes/(2,)]",
        "test_spmd.py::test_matches_single_process[layer/batchnorm1d/(2,)]",
        "test_spmd.py::test_matches_single_process[cnn1d/(2,)/uneven]",
        "test_spmd.py::test_matches_single_process[checkpoint/(2,1)]",
        "test_spmd.py::test_matches_single_process[layer/maxpool2d-ceil/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/avgpool2d-exclude-pad/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/adaptive-max2d-local/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/batchnorm2d/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/groupnorm2d/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/layernorm2d/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/convtranspose2d/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/upsample-bilinear/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/pads2d/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/conv2d-padding-modes/(2,2)]",
        "test_spmd.py::test_matches_single_process[layer/instancenorm3d/(2,1,2)]",
        "test_spmd.py::test_matches_single_process[cnn2d/(2,2)/uneven]",
        "test_spmd.py::test_matches_single_process[thin/(4,1)]",
        "test_spmd.py::test_matches_single_process[hybrid/R2/(2,1)/batchnorm]",
        "test_spmd.py::test_matches_single_process[fcn2d/ce-per-pixel/(2,2)]",
        "test_spmd.py::test_matches_single_process[random/(2,2)]",
        "test_spmd.py::test_matches_single_process[zoo/timm/resnet18]",
        "test_spmd.py::test_the_sabotage_panel_on_spmd_ranks[panel/bn_net-True-False]",
        "test_spmd.py::test_halo_exchange_is_its_own_adjoint",
        "test_spmd.py::test_bad_layouts_refused_on_every_rank",
        "test_spmd.py::test_a_nan_gradient_behind_a_finite_loss_is_refused_on_every_rank",
        "test_spmd.py::test_prediction_from_sources_matches_single_process[sources/R2]",
        "test_spmd_agreement.py::test_ranks_with_different_grids_fail_on_every_rank_naming_rank_and_field",
    ],
    "faults: a dead worker or rank named in bounded time, nothing left behind": [
        "test_failures.py::test_worker_failure_raises_in_bounded_time[p2p-False-die-*",
        "test_failures.py::test_worker_failure_raises_in_bounded_time[rpc-False-die-*",
        "test_failures.py::test_world_shuts_down_after_driver_exception",
        "test_failures.py::test_faults_leave_no_process_and_no_lost_record[driver_kill]",
        "test_spmd.py::test_dead_or_stalled_rank_is_an_error_naming_it[kill]",
    ],
    "bad input refused before any remote work": [
        "test_errors.py::test_world_rejects_bad_arguments", "test_errors.py::test_parallelize_rejects",
        "test_errors.py::test_first_call_rejects_before_remote_work",
        "test_errors.py::test_dtype_mismatch_names_both_dtypes_and_the_fix",
        "test_errors.py::test_train_step_needs_optimizer",
    ],
    "users' habits: their own loop, Lightning, EMA, SyncBatchNorm, checkpointing, non-finite gradients": [
        "test_native_loop.py",
        "test_lightning.py::test_an_unchanged_lightning_module_trains_as_one_process[(2,2)/cls]",
        "test_lightning.py::test_each_broken_habit_is_seen[plant/no_replica_average]",
        "test_driver_ema.py::test_the_workers_ema_is_one_processs",
        "test_sync_batchnorm.py::test_sync_batchnorm_matches_single_process[p2p]",
        "test_checkpointing.py::test_checkpointed_blocks_match_single_process[non-reentrant-2d]",
        "test_habits.py::test_training_randomness_is_one_process_draw",
        "test_habits.py::test_torch_compile_trains_exactly[compiled_model]",
        "test_check_finite_gradients.py::test_a_nan_gradient_behind_a_finite_loss_is_refused_before_the_step[p2p]",
    ],
    "attention: ring and gathered ops, a ViT with its class token, shifted windows": [
        "test_ring_attention.py::test_op_exact_forward_and_backward_on_uneven_shards",
        "test_ring_attention.py::test_op_with_whole_tokens_in_front_exact",
        "test_ring_attention.py::test_ring_backward_is_the_adjoint_of_its_forward",
        "test_ring_attention.py::test_vit_with_class_token_split_by_ring_attention[class-token]",
        "test_ring_attention.py::test_vit_with_class_token_on_the_rpc_transport_gathers_exactly",
        "test_ops_sequence_attention.py::test_op_with_mask_exact",
        "test_ops_sequence_attention.py::test_planted_ring_pass_that_keeps_its_own_block_fails",
        "test_attention_windows.py::test_torchvision_swin_windows_split_exactly[swin-v1-unaligned]",
        "test_attention_windows.py::test_windows_cut_by_shards_refused_naming_sizes_that_work",
    ],
    "slides: each worker reads its own region; corrupt input refused with its path": [
        "test_data_sources.py::test_sources_read_the_stored_pixels",
        "test_data_sources.py::test_jpeg_slide_boxes_match_the_whole_page_decode",
        "test_data_sources.py::test_training_on_sources_equals_one_process_2x2[tiff-1]",
        "test_data_sources.py::test_bad_sources_are_refused_before_remote_work",
        "test_data_sources.py::test_predict_writes_the_single_process_output_into_zarr",
        "test_source_validation.py::test_truncated_tiff_is_refused_at_open",
        "test_source_validation.py::test_missing_zarr_chunks_are_named",
        "test_source_validation.py::test_a_corrupt_chunk_names_slide_level_box_and_codec",
    ],
    "outputs and checkpoints: pyramids, nothing lost, resume": [
        "test_pyramid.py", "test_predict_outputs.py", "test_outputs_partials.py",
        "test_predict_safety.py::test_predict_refuses_an_out_that_is_or_holds_an_input",
        "test_predict_safety.py::test_overwrite_replaces_only_outputs_bigconv_wrote",
        "test_predict_safety.py::test_a_failed_predict_leaves_the_old_output_and_a_usable_world",
        "test_pyramid_spmd.py",
        "test_saving.py::test_a_bad_checkpoint_is_refused_and_leaves_the_model_alone",
        "test_saving.py::test_a_crash_while_writing_keeps_the_previous_file",
        "test_saving.py::test_resume_equals_uninterrupted_training",
        "test_capture.py::test_capture_of_a_segmentation_model_is_exact",
        "test_capture.py::test_bad_captures_are_refused_before_remote_work",
        "test_capture_spmd_out.py",
    ],
    "documented commands: every block's tools parse, links resolve, the README's driver-mode example and the "
    "cluster example run": [
        "test_docs.py::test_blocks_run_as_written[README.md:63]",
        "test_docs.py::test_documented_commands_parse", "test_docs.py::test_fragments_say_why_and_still_parse",
        "test_docs.py::test_relative_links_point_at_files", "test_docs.py::test_commands_are_found_in_blocks",
        "test_check_cli.py::test_bad_arguments_name_the_fix", "test_check_cli.py::test_model_specs_and_file_builders",
        "test_check_cli.py::test_the_check_can_fail",
        "test_harness_cluster.py::test_spmd_example_runs_as_documented_with_local_ranks",
    ],
    "multidsn: losses, and each domain's encoder on its own worker": [
        "test_multidsn_losses.py",
        "test_multidsn_parallel.py::test_domain_placement_k1_head_on_source[dann]",
        "test_multidsn_parallel.py::test_too_few_workers_says_how_many",
    ],
}


def fast_match(nodeid: str) -> str | None:
    """The ``FAST`` entry that selects ``nodeid`` (relative to tests/), or None."""
    for group in FAST.values():
        for entry in group:
            if "*" in entry:  # the one wildcard; brackets are literal
                if re.fullmatch(re.escape(entry).replace(r"\*", ".*"), nodeid):
                    return entry
            elif nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "["):
                return entry
    return None
