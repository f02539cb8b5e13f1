"""The tiers of the suite beyond the markers written in the test files.

``make test-quick`` leaves out the ``slow`` tests. Besides the files and tests marked ``slow``
where they are written, the tests named here are slow too: each cost more than 1.5 CPU-seconds
(user + system, its child processes included) in a full run on 2 cores on 2026-12-03, and
together about 480 CPU-seconds of the 640 that ``make test-quick`` spent. ``make test`` runs
them all. A name covers every parameter of the test. Refresh the table when a test's cost moves
much: ``tests/conftest.py`` applies it, and ``tests/test_tiers.py`` fails on a name that is no
test of its file.
"""

from __future__ import annotations

MEASURED_SLOW: dict[str, tuple[str, ...]] = {
    "test_bad_input.py": (
        "test_a_deeply_nested_history_is_ignored_and_gc_still_runs",
        "test_a_deeply_nested_manifest_is_a_malformed_manifest_naming_it",
        "test_a_deeply_nested_node_map_is_no_gpu_info_naming_the_node",
        "test_a_file_name_with_escapes_in_the_store_is_reported_without_them",
        "test_a_spec_copied_without_its_kernels_says_where_they_were_looked_for",
        "test_an_arch_no_toolchain_knows_is_refused_by_verify",
        "test_doctor_takes_a_key_or_generation_id_with_store",
        "test_doctor_without_an_arch_never_calls_the_stamp_a_hit",
        "test_explain_and_check_env_label_the_sides_the_same_way",
        "test_explain_of_a_directory_without_a_manifest_says_so",
        "test_explain_takes_keys_and_generation_ids_and_labels_both_sides",
        "test_gc_keep_negative_is_a_usage_error_and_removes_nothing",
        "test_gc_names_the_lock_holder_and_gives_up_after_its_timeout",
        "test_inspect_lists_healthy_keys_beside_one_with_a_broken_current",
    ),
    "test_bad_warmers.py": ("test_error_lines_and_warmer_output_carry_no_escapes_when_piped",),
    "test_build.py": (
        "test_a_build_is_up_to_date_only_when_strict_pods_would_load_every_kernel",
        "test_a_declared_warmer_that_produced_nothing_fails",
        "test_a_reverted_spec_makes_its_kept_generation_current_without_building",
        "test_build_publishes_every_arch_and_verifies",
        "test_materialized_generation_serves_a_fresh_process_with_zero_compiles",
        "test_rebuild_with_the_same_stamp_is_up_to_date_and_a_change_is_a_new_generation",
        "test_two_builders_of_one_key_publish_one_generation",
        "test_verify_names_a_flipped_byte_and_a_missing_generation",
    ),
    "test_chart_apply.py": (
        "test_rendered_chart_applies_server_side_then_the_example_kernelcache",
    ),
    "test_cli.py": (
        "test_a_failed_warm_says_why_once",
        "test_a_second_builder_says_it_waits_for_the_lock",
        "test_a_warm_result_fits_a_termination_message",
        "test_build_dry_run_says_what_would_be_compiled_from_which_stamp_and_why",
        "test_build_streams_the_warmers_output_and_kernels_as_plain_lines",
        "test_build_table_names_the_slowest_kernels_per_toolchain",
        "test_exit_codes_once_in_the_top_help_and_help_without_rst",
        "test_tables_at_60_columns_keep_the_key_columns_whole",
        "test_warm_verify_explain_inspect_json",
    ),
    "test_concurrency.py": (
        "test_disk_layer_counts_every_refusal_from_sixteen_threads",
        "test_eight_publishers_of_two_contents_on_one_key_serialise_and_dedup",
        "test_eight_warm_commands_of_eight_keys_in_one_store",
        "test_eight_warm_commands_of_one_key_publish_one_generation",
    ),
    "test_distribution_modes.py": (
        "test_image_mode_copies_only_what_toolchains_write_and_serves_cute_dsl_in_place",
    ),
    "test_docs.py": (
        "test_a_command_the_docs_show_runs",
        "test_the_readme_demo_output_is_what_the_demo_prints",
    ),
    "test_doctor.py": (
        "test_doctor_after_a_build_warns_only_of_what_to_act_on",
        "test_doctor_against_a_spec_and_its_store",
        "test_doctor_in_the_environment_the_generation_was_built_in",
        "test_doctor_names_what_is_broken",
        "test_doctor_of_a_spec_and_store_without_a_gpu_reports_every_check",
        "test_doctor_without_a_gpu_or_arch_fails_on_the_arch",
        "test_doctor_wraps_words_whole_on_a_narrow_terminal",
    ),
    "test_initcontainer.py": (
        "test_a_pod_on_the_previous_image_loads_the_kept_generation_built_for_it",
    ),
    "test_kubectl.py": (
        "test_kubectl_apply_then_get_shows_the_printer_columns",
        "test_kubectl_get_during_a_change_shows_what_serves_beside_what_builds",
    ),
    "test_oci.py": (
        "test_adopt_refuses_a_generation_of_another_key_and_keeps_current",
        "test_push_then_pull_is_byte_identical_and_skopeo_reads_the_artifact",
    ),
    "test_operator_integration.py": (
        "test_a_pruned_node_map_is_written_again_and_a_re_created_namespace_gets_one",
        "test_a_re_created_kernelcache_shows_what_its_store_still_serves",
        "test_a_reverted_spec_runs_a_job_that_makes_its_generation_current_again",
        "test_a_warmer_that_fills_the_volume_is_named_a_full_volume_in_status",
        "test_job_success_makes_the_arch_ready",
        "test_kernelcache_operator_command_serves_liveness_and_metrics",
        "test_restart_mid_reconcile_converges_without_duplicates",
        "test_spec_change_starts_new_jobs_and_keeps_the_published_generation",
        "test_two_replicas_only_one_reconciles",
    ),
    "test_operator_signing.py": (
        "test_key_rotation_through_the_operator_keeps_pods_starting_with_no_compile",
        "test_the_re_point_attack_through_the_operator",
    ),
    "test_properties.py": (
        "test_hostile_spec_parses_or_names_field",
        "test_manifest_parse_mutated_fields",
    ),
    "test_runtime.py": (
        "test_a_warmed_generation_serves_with_zero_cold_compiles",
        "test_flashinfer_finds_its_aot_modules_in_the_generation",
        "test_install_after_importing_inductor_still_serves_inductor_from_the_generation",
        "test_metrics_endpoint_serves_every_series_with_its_labels",
        "test_processes_started_by_a_serving_process_read_the_relocated_triton_cache",
        "test_stamp_mismatch_is_a_metric_and_a_line_and_strict_refuses",
        "test_strict_mode_refuses_a_kernel_missing_from_the_generation_in_one_line",
        "test_strict_mode_refuses_an_inductor_miss_before_compiling",
        "test_torch_compile_without_a_cache_is_a_cold_compile_of_the_frame",
        "test_torch_megacache_serves_a_fresh_process_with_zero_inductor_misses",
        "test_triton_counts_real_compiles_not_disk_hits_and_strict_refuses_first",
        "test_without_the_generation_every_kernel_is_a_cold_compile",
    ),
    "test_runtime_cute.py": (
        "test_a_hopper_tma_wgmma_gemm_is_exported_and_loaded_with_zero_compiles",
        "test_a_kernel_is_keyed_by_its_ir_not_by_its_source_text",
        "test_changed_dsl_stack_misses",
        "test_concurrent_processes_share_one_directory",
        "test_other_arch_lives_beside_the_first",
        "test_second_process_loads_every_kernel_with_zero_compiles",
    ),
    "test_settings.py": ("test_a_dsl_setting_that_changes_the_code_is_a_new_generation",),
    "test_sources.py": ("test_a_changed_helper_module_is_a_new_generation_and_refused_in_serving",),
    "test_store_trust.py": (
        "test_a_re_pointed_build_prints_json_its_schema_accepts",
        "test_an_unsigned_current_generation_among_signed_ones_is_compiled_anew",
        "test_another_signing_key_re_signs_when_the_old_one_is_trusted_and_compiles_otherwise",
        "test_every_signature_deleted_and_current_forged_is_not_signed_by_the_next_build",
        "test_key_rotation_as_documented_keeps_pods_starting_with_no_compile",
        "test_the_re_point_attack_compiles_anew_instead_of_signing_the_edit",
        "test_turning_signing_on_compiles_once_and_signs_what_it_built",
    ),
    "test_transport.py": (
        "test_a_local_registry_over_plain_http_takes_push_and_pull_with_plain_http",
    ),
    "test_vllm.py": (
        "test_a_build_warms_what_serving_learned_before_the_monitor_arms",
        "test_a_start_whose_generation_lacks_a_specialization_fails_before_ready",
        "test_a_tensor_parallel_warm_keeps_and_places_every_ranks_cache",
        "test_explain_names_vllms_own_cache_key_factors",
        "test_served_from_the_generation_the_sweep_meets_no_jit_in_error_mode",
        "test_strict_after_ready_serves_a_compile_and_counts_it",
        "test_the_startup_plan_serves_its_gpu_product_only_and_less_memory_profiles",
        "test_the_warm_reports_passes_until_a_fresh_engine_meets_no_jit",
    ),
    "test_vllm_tuning.py": (
        "test_a_build_tunes_keeps_the_table_as_tuning_and_enumerates_with_it",
        "test_serving_reads_the_tuned_table_and_a_start_without_it_fails_before_ready",
    ),
    "test_warm_flashinfer.py": (
        "test_a_declared_artifact_that_did_not_appear_fails_in_one_line",
        "test_a_tactics_file_stamped_for_another_gpu_is_refused_and_left_as_it_was",
        "test_an_entry_point_that_raises_is_one_line_naming_it",
        "test_flashinfer_puts_its_workspace_and_finds_aot_modules_where_we_say",
    ),
    "test_warm_torch_compile.py": ("test_a_warm_that_compiles_nothing_fails_in_one_line",),
    "test_warm_triton.py": ("test_a_warm_for_another_arch_than_the_visible_gpu_is_one_line",),
    "test_webhook_integration.py": (
        "test_an_engine_image_change_serves_the_old_image_and_says_which_pods_are_refused",
        "test_pods_created_through_the_api_are_injected_once_or_refused",
    ),
}
