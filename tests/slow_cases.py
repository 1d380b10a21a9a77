"""The cases ``make test`` leaves to ``make test-slow`` by hand, each with what stands for it
(tests/conftest.py marks them; tests/test_slow_cases.py holds that each exists)."""
from __future__ import annotations

#: cases ``make test`` leaves to ``make test-slow`` to stay within its 35 minutes on 2 cores
#: (measured on 2026-11-28, idle: the default tests took 28.8 min and the notebooks 20.4 before
#: the first 62 cases here moved, 19 and 17.8 min after, with faster launches), each with what
#: stands for it in the default run: the same code path, checked faster
SLOW_BY_HAND = {
    # the exercises' checkers at 4 ranks: test_the_checker_looks_at_every_rank runs each on a
    # wrong answer by default; the reference solutions pass in test_assignments' slow grid too
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[ring_all_reduce]":
        "test_the_checker_looks_at_every_rank[ring_all_reduce]",
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[reduce_scatter]":
        "test_the_checker_looks_at_every_rank[reduce_scatter]",
    "tests/test_exercises.py::test_the_checker_looks_at_every_rank[average_gradients]":
        "test_the_checker_passes_the_solution_and_names_the_mistake[average_gradients]",
    # options of a strategy whose plain case runs by default
    "tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ddp-ring-2]":
        "[ddp-2] (the same hooks) and test_allreduce's ring",
    "tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ddp-accumulate-2]":
        "[ddp-2] and test_nd_precision_steps' accumulation",
    "tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ps-async-bound0-2]":
        "test_ps_async_trains_what_its_recorded_staleness_says",
    "tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[torch-ddp-builtin-2]":
        "[ddp-2]; torch-ddp's own hook in test_dashboard",
    "tests/test_nd_precision.py::test_mixed_precision_trains_like_single_in_that_precision"
    "[2-{'dp': 2, 'zero': 3}-fp16]":
        "test_nd_precision_steps' fp16 cases and [2-{'pp': 2}-bf16-fp32-grads]",
    "tests/test_nd_precision.py::test_mixed_precision_trains_like_single_in_that_precision"
    "[2-{'dp': 2, 'zero': 1}-bf16]":
        "[2-{'pp': 2}-bf16-fp32-grads] and test_checkpoint_resume[single-bf16]",
    "tests/test_checkpoint_resume.py::test_a_resume_reproduces_the_uninterrupted_run[nd-dp2-zero1-fp16]":
        "[single-bf16] and test_checkpoint_state (every moment, master and the loss scale)",
    "tests/test_context_parity.py::test_cp_trains_like_single_and_sends_the_formula_bytes[allgather-zigzag-2]":
        "[ring-zigzag-2] and test_context_attention[4] (every attention against full attention)",
    "tests/test_context_parity.py::test_cp_trains_like_single_and_sends_the_formula_bytes[usp-zigzag-2]":
        "[ring-zigzag-2] and test_context_attention[4]",
    "tests/test_nd_parity.py::test_two_dimensions_on_four_ranks_train_like_single[gpt-cp4-attentionusp-ulysses2]":
        "[moe-dp2-ep2-tp2-sequence_parallelTrue] and test_context_attention[4]",
    "tests/test_nd_buffers.py::test_comm_buffers_are_the_formula_on_every_rank_and_step[4-pp2-dp2-zero1-precisionbf16]":
        "[4-pp2-dp2-zero3-scheduleinterleaved]",
    "tests/test_nd_buffers.py::test_comm_buffers_are_the_formula_on_every_rank_and_step[2-dp2-zero3]":
        "[4-pp2-dp2-zero3-scheduleinterleaved]",
    "tests/test_collectives.py::test_collectives_equal_torch[3]": "[2] and [4]",
    "tests/test_allreduce.py::test_every_algorithm_equals_dist_all_reduce[3]": "[2] and [4]",
    "tests/test_moe_training.py::test_ep_trains_like_single_with_each_option[losses-2]":
        "[capacity-2] (the same routing and exchange)",
    "tests/test_nd_checkpoint.py::test_same_layout_resumes_bit_for_bit":
        "test_checkpoint_resume[single-bf16] and test_pp2_dp2_zero2_reshards_into_tp2_and_single",
    "tests/test_plan_published.py::test_the_plan_counts_the_collectives_a_run_makes[cp2-tp2-sp-zero1]":
        "[pp2-dp2-zero1]",
    "tests/test_torch_tp_precision.py::test_fsdp2_tp_trains_like_single_in_that_precision[bf16]":
        "test_zero's torch-fsdp2 bf16 case (PyTorch's own API, the same mixed-precision policy)",
    "tests/test_context_attention.py::test_ring_allgather_ulysses_and_usp_attention_equal_full_causal_attention[2]":
        "[4]",
    "tests/test_expert_dispatch.py::test_expert_parallel_layer_equals_the_whole_layer[4-1]": "[4-2]",
    "tests/test_local_sgd.py::test_torch_model_averaging_trains_the_same[4-2]":
        "test_trains_like_the_papers_rules[average-4-2] (the same rule, dlab's own)",
    "tests/test_local_sgd.py::test_trains_like_the_papers_rules[diloco-2-2]": "[average-4-2]",
    "tests/test_plots_theory.py::test_memory_panel_shows_the_model_state_beside_the_measured_bars[zero2]":
        "[ddp] (the same panel)",
    "tests/test_reduce_scatter_option.py::test_zero_reduce_scatter_option[zero3-2-ring]":
        "test_sequence_parallel_reduce_scatter_option[2] (the same option's code)",
    "tests/test_pipeline_parity.py::test_dualpipev_at_four_ranks_matches_single":
        "test_schedule_matches_single's dualpipev case at 2 ranks",
    "tests/test_launch.py::test_two_torchrun_nodes_write_one_run_directory":
        "test_run_directory_holds_the_contract (one node)",
    "tests/test_launch.py::test_notebook_00s_own_torchrun_leaves_nothing_in_the_temp_dir":
        "notebook 00 under nbval runs the same cell",
    "tests/test_proxy.py::test_the_audit_passes_a_faithful_run": "notebook 14 under nbval runs the audit",
    "tests/test_elastic.py::test_an_elastic_worker_started_with_flags_resumes_as_with_a_config":
        "test_ranks_that_disagree_on_the_config_or_the_step_do_not_train_together and notebook 13",
    "tests/test_dashboard.py::test_the_dashboard_and_wait_let_torchrun_restart_a_rank_that_failed_once":
        "the dashboard has no loop of its own (it supervises through Run.wait: "
        "test_stop_button_stops_a_run_while_the_cell_is_busy), test_faults' restarts",
    "tests/test_stragglers_preemption.py::test_a_preempted_run_checkpoints_and_resumes_bit_for_bit":
        "notebook 13 §3 (the same drill) and test_a_preempted_cli_run_exits_75_so_a_scheduler_requeues_it",
    "tests/test_disk_faults.py::test_the_launchers_deadline_holds_while_the_record_of_the_end_blocks":
        "test_a_step_stuck_on_a_hung_disk_still_ends_at_its_deadline",
    "tests/test_faults.py::test_cli_deadline_bounds_the_whole_run":
        "test_a_single_rank_stuck_outside_a_collective_ends_at_its_deadline (the same deadline)",
    "tests/test_nd_parity.py::test_recomputation_changes_nothing_but_memory_and_bytes"
    "[4-{'recompute': 'full', 'recompute_every': 2}-"
    "{'dp': 2, 'zero': 3, 'tp': 2, 'sequence_parallel': True}]":
        "its 2-rank cases and test_recompute's",
    "tests/test_recompute.py::test_strategy_with_recompute_trains_like_single[ep-moe-full]":
        "[pipeline-1f1b-gpt-full] (the same recomputation wrapper)",
    "tests/test_dashboard.py::test_launch_with_dashboard_blocks_then_summarises_or_raises":
        "notebook 00 under nbval (a dashboard launch to its summary) and "
        "test_stop_button_stops_a_run_while_the_cell_is_busy",
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[zero1_step]":
        "[train_zero1], which runs the reference zero1_step on every step, and "
        "test_exercises_assemble_dp's mistakes",
    "tests/test_exercises.py::test_the_checker_looks_at_every_rank[bucketed_ddp]":
        'test_the_checker_fails_a_right_result_reached_the_wrong_way[bucketed_ddp-0]',
    "tests/test_exercises.py::test_the_checker_looks_at_every_rank[column_parallel_linear]":
        "[train_tp_mlp] (runs this piece's own check first)",
    "tests/test_exercises.py::test_the_checker_looks_at_every_rank[zero1_step]":
        '[train_zero1] and test_exercises_assemble_dp',
    "tests/test_exercises.py::test_the_checker_looks_at_every_rank[zero3_forward]":
        'test_the_checker_passes_the_solution_and_names_the_mistake[zero3_forward]',
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[column_parallel_linear]":
        "[train_tp_mlp], which sends this piece's reference and checks it first",
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[row_parallel_linear]":
        "[train_tp_mlp], which sends this piece's reference and checks it first",
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[dispatch]":
        'test_the_checker_fails_a_right_result_reached_the_wrong_way[dispatch-0]',
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[bucketed_ddp]":
        'test_the_checker_fails_a_right_result_reached_the_wrong_way[bucketed_ddp-0] and [-1]',
    "tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[row_parallel_linear-1]":
        '[row_parallel_linear-0] (the same collective count)',
    "tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[row_parallel_linear-2]":
        '[row_parallel_linear-0] (the same collective count)',
    "tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[dispatch-2]":
        '[dispatch-0] (the same count of rows that leave)',
    "tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[dispatch-3]":
        '[dispatch-0] (the same count of rows that leave)',
    "tests/test_compression.py::test_bytes_per_step_are_the_formulas":
        "test_formulas_by_hand and notebook 13's compression section (bytes beside the formula)",
    "tests/test_compression.py::test_powersgd_and_topk_train_as_their_rules":
        "notebook 13's compression section, which trains each",
    "tests/test_compression.py::test_loss_stays_near_uncompressed":
        "notebook 13's compression section",
    "tests/test_compression.py::test_compressed_buckets_overlap_backward":
        "test_data_parallel's bucket overlap (the same hooks)",
    "tests/test_compression.py::test_state_is_counted_as_comm_buffers":
        'test_formulas_by_hand',
    "tests/test_checkpoint.py::test_zero2_resumes_and_reshards_parameters_its_shard_boundary_cuts":
        "test_nd_checkpoint's pp2_dp2_zero2 resharding and notebook 12's 4 -> 2 -> 1",
    "tests/test_stragglers_preemption.py::test_backup_workers_drop_the_straggler_and_follow_their_rule":
        "notebook 13 §2's checked cell (N - b = 3 gradients a step, never the straggler's)",
    "tests/test_context_parity.py::test_cp_times_dp_trains_like_single":
        "[ring-zigzag-2] and test_nd_parity's data-parallel layouts",
    "tests/test_launch.py::test_two_runs_at_once_do_not_collide":
        'test_run_directory_holds_the_contract',
    "tests/test_pipeline_parity.py::test_schedule_matches_single[gpipe-2]":
        '[1f1b-2] (the same executor and its list of actions)',
    "tests/test_expert_dispatch.py::test_expert_parallel_layer_equals_the_whole_layer[2-1]":
        "[2-2] and [4-2] (the same exchange, top-2)",
    "tests/test_nd_parity.py::test_pipeline_and_zero_on_two_ranks_train_like_single[{'dp': 2, 'zero': 1}]":
        "[{'dp': 2, 'zero': 2}] (the same sharded optimizer step) and test_zero's zero1 case",
    "tests/test_nd_precision.py::test_adam_bytes_are_the_zero_papers[bf16-2-2]":
        "[bf16-fp32-grads-2-4] (the same count, four ranks)",
    "tests/test_exercises.py::test_the_checker_passes_the_solution_and_names_the_mistake[train_pipeline_1f1b]":
        "test_exercises_assemble_mp's test_a_pipeline_with_isend_irecv_and_a_batched_exchange_passes "
        "(a right answer through check on ranks) and test_a_wrong_pipeline_is_named",
    "tests/test_exercises_assemble_mp.py::test_a_wrong_tensor_parallel_block_is_named[input-detached]":
        "[piece-wrong] and test_exercises' [train_tp_mlp] (the reference and a mistake on ranks)",
}
