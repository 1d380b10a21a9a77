"""Planted bugs: each one patched into a copy of the package in turn, the tests that should
catch it run on that copy, and a table of what failed.

    python tests/mutations.py                 # every mutation, after a clean baseline run
    python tests/mutations.py tied-bytes      # some of them
    python tests/mutations.py --list

A mutation is a textual replacement in one file of a copy of the checkout (dlab/, tests/,
data/, pyproject.toml under a temporary directory), so the ranks that torchrun starts import
the planted bug like any other code (the launcher puts the copy first on their PYTHONPATH).
The replaced text must occur exactly once, so a mutation that no longer applies fails loudly
rather than testing nothing. The same tests first run on an unpatched copy: a mutation counts
as caught only if its tests pass there and fail with it.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# notebooks/ and the reference solutions: python -m dlab assignments builds its course from them
COPIED = ("dlab", "tests", "data", "pyproject.toml", "notebooks", "docs/instructor/solutions")


@dataclass
class Mutation:
    name: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (text, its replacement), each text found once
    tests: tuple[str, ...]


FLATTEN = "        flat_grad = self.transient.held(\"reduce\", u.flatten_grads())\n"

MUTATIONS = [
    Mutation(
        "mp-zero-missing-div",
        "ZeRO reduce-scatter skips the /N in mixed precision only (fp32 untouched)",
        "dlab/parallel/zero/sharded.py",
        (("        flat_grad.div_(self.n)\n",
          "        if not self.mixed:\n            flat_grad.div_(self.n)\n"),),
        ("tests/test_zero.py::test_mixed_precision_matches_a_bf16_reference",),
    ),
    Mutation(
        "ddp-doubled-div",
        "ddp divides each bucket by N twice",
        "dlab/parallel/data_parallel/ddp.py",
        (("        bucket.flat.div_(comm.size)  #",
          "        bucket.flat.div_(comm.size).div_(comm.size)  #"),),
        ("tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ddp-2]",),
    ),
    Mutation(
        "rank1-skips-last-step",
        "ddp: rank 1 skips its last optimizer step (losses are all-reduced, so they agree)",
        "dlab/parallel/data_parallel/ddp.py",
        (("        with tl.span(\"optimizer\"):\n            self.optimizer.step()\n",
          "        with tl.span(\"optimizer\"):\n"
          "            if not (self.ctx.rank == 1 and tl.step == self.ctx.config.steps - 1):\n"
          "                self.optimizer.step()\n"),),
        ("tests/test_data_parallel.py::test_matches_single_and_moves_the_formula_bytes[ddp-2]",),
    ),
    Mutation(
        "tied-bytes",
        "pipeline: a stage leaves the tied embedding/head matrix out of its parameters",
        "dlab/parallel/nd/sharding.py",
        (("        return {\"parameters\": storage_bytes(self.params + shards),\n",
          "        kept = [p for name, p in self.named if name != \"embed.tok.weight\"]\n"
          "        return {\"parameters\": storage_bytes(kept + shards),\n"),),
        ("tests/test_pipeline_parity.py::test_tied_embedding_is_held_by_first_and_last_stage",),
    ),
    Mutation(
        "expert-lost-grad",
        "expert dispatch: the experts run on detached weights, so their gradients are lost",
        "dlab/parallel/expert/dispatch.py",
        (("                done = done.index_add(0, mine, mlp(rows[mine]))\n",
          "                weights = {k: v.detach() for k, v in mlp.named_parameters()}\n"
          "                out = torch.func.functional_call(mlp, weights, rows[mine])\n"
          "                done = done.index_add(0, mine, out)\n"),),
        ("tests/test_expert_dispatch.py::test_expert_parallel_layer_equals_the_whole_layer[2-1]",),
    ),
    Mutation(
        "async-ckpt-no-copy",
        "checkpoint pieces reference the live tensors instead of copying them",
        "dlab/runtime/checkpoint.py",
        (("    data = to_host(flat)\n", "    data = flat\n"),),
        ("tests/test_checkpoint.py::test_async_and_full_checkpoints_resume_the_same",
         "tests/test_checkpoint.py::test_an_async_save_holds_the_values_of_the_step_it_was_called_at"),
    ),
    Mutation(
        "zero-grads-early",
        "zero2/3: a unit's gradients are flattened before the previous unit's buffer is freed",
        "dlab/parallel/zero/stage2.py",
        (("        self._wait_in_flight()\n" + FLATTEN, FLATTEN + "        self._wait_in_flight()\n"),),
        ("tests/test_zero.py::test_stage_matches_single_and_its_formulas[zero2-4-options3]",),
    ),
    Mutation(
        "zero-grads-kept",
        "zero2/3: a reduced unit's flattened gradient is kept, not freed (what a booked "
        "release would still call freed)",
        "dlab/parallel/zero/stage2.py",
        (("            self.transient.free(flat_grad)\n",
          "            self.__dict__.setdefault(\"kept\", []).append(flat_grad)\n"),),
        ("tests/test_zero.py::test_stage_matches_single_and_its_formulas[zero2-4-options3]",),
    ),
    Mutation(
        "recv-not-posted",
        "pipeline: receives are posted only at their action, recv_ahead ignored",
        "dlab/parallel/pipeline/executor.py",
        (("        posted = [self._post_recv(r, act_shape) for r in self.recvs[: self.recv_ahead]]\n",
          "        posted = []\n"),
         ("                    while len(posted) < min(done + 1 + self.recv_ahead, len(self.recvs)):\n",
          "                    while len(posted) < min(done + 1, len(self.recvs)):\n")),
        ("tests/test_pipeline_parity.py::test_receives_posted_at_the_action_or_ahead_train_like_single[1f1b-2-2]",),
    ),
    Mutation(
        "dualpipev-backward-first",
        "pipeline: DualPipeV's steady phase runs each pair's backward before its forward (peak "
        "2p chunks, not the 2p + 1 the formula derives)",
        "dlab/layout/schedules.py",
        (("        fwd(0)\n        bwd(1)\n        fwd(1)\n        bwd(0)\n",
          "        bwd(1)\n        fwd(0)\n        bwd(0)\n        fwd(1)\n"),),
        ("tests/test_pipeline_schedules.py::test_dualpipev_pairs_a_forward_with_a_backward",
         "tests/test_pipeline_schedules.py::test_activations_in_flight_match_the_formula"),
    ),
    Mutation(
        "one-f-one-b-judge-stage-0",
        "exercises: the one_f_one_b checker bounds the activations in flight on stage 0 only",
        "dlab/exercises/local.py",
        (("    for s, got in enumerate(orders):\n", "    for s, got in enumerate(orders[:1]):\n"),),
        ("tests/test_exercises.py::test_the_checker_looks_at_every_rank[one_f_one_b]",),
    ),
    Mutation(
        "zero-resume-cut-state",
        "zero: a resume restores the optimizer state only of parameters wholly inside a rank's "
        "chunk; those a shard boundary cuts restart from zero momentum",
        "dlab/parallel/zero/sharded.py",
        (("                    for k in state:\n",
          "                    for k in state if n == s.numel else ():\n"),),
        ("tests/test_checkpoint.py::test_zero2_resumes_and_reshards_parameters_its_shard_boundary_cuts",),
    ),
    Mutation(
        "zero-ring-skips-div",
        "zero: with reduce_scatter=\"ring\" the gradient is summed, not averaged (no /N)",
        "dlab/parallel/zero/sharded.py",
        (("        flat_grad.div_(self.n)\n",
          "        if self.ctx.comm.reduce_scatter_algorithm != \"ring\":\n"
          "            flat_grad.div_(self.n)\n"),),
        ("tests/test_reduce_scatter_option.py::test_zero_reduce_scatter_option[zero3-2-ring]",),
    ),
    Mutation(
        "hfu-recompute-tripled",
        "HFU counts a recomputed forward three times (as if it were a whole forward and backward)",
        "dlab/models/gpt.py",
        (("        return self.flops_per_token() + self.recompute_flops_per_token(recompute, every)\n",
          "        return self.flops_per_token() + 3 * self.recompute_flops_per_token(recompute, every)\n"),),
        ("tests/test_recompute.py::test_strategy_with_recompute_trains_like_single[pipeline-1f1b-gpt-full]",),
    ),
    Mutation(
        "lab-unchecked",
        "python -m dlab lab starts (URL and token printed) without checking that JupyterLab is there",
        "dlab/tools/jupyter.py",
        (("    if missing:\n", "    if False:\n"),),
        ("tests/test_lab.py::test_without_jupyterlab_the_lab_says_what_to_install_before_any_url",),
    ),
    Mutation(
        "plan-recompute-free",
        "planner: recomputation's repeated forward left out of the step",
        "dlab/theory/plan/time.py",
        (("             \"recompute\": recompute,\n", "             \"recompute\": 0.0,\n"),),
        ("tests/test_plan.py::test_recomputation_trades_time_for_memory",
         "tests/test_plan.py::test_the_step_is_the_sum_of_every_part_and_none_is_left_out"),
    ),
    Mutation(
        "plan-tp-half",
        "planner: tensor parallelism's two all-reduces per layer priced as one",
        "dlab/theory/plan/time.py",
        (("else ((\"all_reduce\", 2),)", "else ((\"all_reduce\", 1),)"),),
        ("tests/test_plan.py::test_tensor_parallel_bytes_are_korthikantis_per_layer_count",),
    ),
    Mutation(
        "dispatch-any-collective",
        "the dispatch checker lets the rows travel by all-gather or send/recv",
        "dlab/exercises/model_parallel.py",
        (('    others = sorted({op for op, _, _ in calls if op != "all_to_all_single"})\n',
          "    others = []\n"),),
        ("tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[dispatch-0]",),
    ),
    Mutation(
        "dispatch-bytes-unchecked",
        "the dispatch checker accepts an all-to-all that sends every row to every rank",
        "dlab/exercises/model_parallel.py",
        (("    if payload[0] != leaving:\n", "    if payload[0] < leaving:\n"),),
        ("tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way[dispatch-2]",),
    ),
    Mutation(
        "mp-master-not-cast-back",
        "mixed precision: the optimizer updates the fp32 master but the fp16/bf16 compute copy is "
        "never refreshed from it",
        "dlab/runtime/mixed_precision.py",
        (("                        p.copy_(m)\n", "                        pass\n"),),
        ("tests/test_mixed_precision.py::test_the_master_is_fp32_and_the_compute_copy_is_it_cast",),
    ),
    Mutation(
        "accumulation-not-averaged",
        "gradient accumulation sums the micro-batches' gradients instead of averaging them",
        "dlab/runtime/mixed_precision.py",
        (("            objective = loss * (self.loss_weight / k)\n"
          "            if self.scaler is not None:\n"
          "                objective = self.scaler.scale_loss(objective)\n",
          "            objective = loss * self.loss_weight\n"
          "            if self.scaler is not None:\n"
          "                objective = self.scaler.scale_loss(objective)\n"),),
        ("tests/test_mixed_precision.py::test_accumulated_micro_batches_give_the_whole_batch_step",),
    ),
    Mutation(
        "nd-ckpt-drops-optim",
        "nd's loader restores a resharded parameter but not its momentum (ZeRO 0 ranks)",
        "dlab/parallel/nd/state.py",
        (("                    opt.state[q] = state\n", "                    pass\n"),),
        ("tests/test_nd_checkpoint.py::test_pp2_dp2_zero2_reshards_into_tp2_and_single",),
    ),
    Mutation(
        "nd-ckpt-tp-offset",
        "nd's checkpoint puts every tensor-parallel rank's slice at offset 0",
        "dlab/parallel/nd/state.py",
        (('    return (dim, nd.mesh.rank(TP) * size, size), shape\n',
          "    return (dim, 0, size), shape\n"),),
        ("tests/test_nd_checkpoint.py::test_pp2_dp2_zero2_reshards_into_tp2_and_single",),
    ),
    Mutation(
        "nd-mp-masters-not-refreshed",
        "nd, mixed precision, ZeRO >= 1: the bf16 copy is not refreshed from the updated fp32 master",
        "dlab/parallel/nd/sharding.py",
        (("            if self.mixed:\n                refresh(u.shard, u.master)\n", ""),),
        ("tests/test_nd_precision.py::test_mixed_precision_trains_like_single_in_that_precision"
         "[2-{'dp': 2, 'zero': 1}-bf16]",),
    ),
    Mutation(
        "nd-mp-reduce-in-compute-dtype",
        "bf16-fp32-grads accumulates and reduces its gradients in bf16, not fp32",
        "dlab/parallel/mixed.py",
        (("    return torch.float32 if prec.grad_bytes == 4 else prec.compute\n",
          "    return prec.compute\n"),),
        ("tests/test_nd_precision.py::test_adam_bytes_are_the_zero_papers[bf16-fp32-grads-2-4]",),
    ),
    Mutation(
        "nd-tied-unreduced",
        "nd with pp > 1: the tied embedding/head matrix's gradient is not summed over its stages",
        "dlab/parallel/nd/strategy.py",
        (("                self.tied_comm.all_reduce(self.dense.grad(self.stages_param("
          "\"embed.tok.weight\")))\n",
          "                pass\n"),),
        ("tests/test_nd_parity.py::test_pipeline_and_zero_on_two_ranks_train_like_single[{'pp': 2}]",),
    ),
    Mutation(
        "comm-busy-summed",
        "a step's busy communication time the plain sum of the ops' spans, not their union",
        "dlab/core/events.py",
        (("    busy = covered(c)\n", "    busy = sum(e - s for s, e in c)\n"),),
        ("tests/test_comm_time.py::test_overlapping_collectives_are_counted_once_and_compute_hides_them",
         "tests/test_comm_time.py::test_ddp_with_overlapping_buckets_never_reports_more_than_the_step"),
    ),
    Mutation(
        "comm-exposed-hides-waits",
        "exposed communication time counts a wait inside a compute span as hidden",
        "dlab/core/events.py",
        (("    return busy - overlap(c, k) + overlap(k, s), busy\n",
          "    return busy - overlap(c, k), busy\n"),),
        ("tests/test_comm_time.py::test_a_wait_inside_a_compute_span_is_exposed",),
    ),
    Mutation(
        "nd-flat-grads-uncounted",
        "nd, ZeRO 2-3: the flat gradient buffers allocated for the step are not registered as "
        "transient, so comm_buffers leaves them out",
        "dlab/parallel/nd/sharding.py",
        (("                if self.stage >= 2:\n"
          "                    self.transient.held(\"reduce\", u.flat_grad)\n", ""),),
        ("tests/test_nd_buffers.py::test_comm_buffers_are_the_formula_on_every_rank_and_step"
         "[2-dp2-zero3]",),
    ),
    Mutation(
        "zero3-judge-rank0-only",
        "the zero3_forward checker looks at rank 0's gathered parameters only",
        "dlab/exercises/zero.py",
        (("    for r, (_, log) in enumerate(answers):\n        one =",
          "    for r, (_, log) in enumerate(answers[:1]):\n        one ="),),
        ("tests/test_exercises.py::test_the_checker_looks_at_every_rank[zero3_forward]",),
    ),
    Mutation(
        "wire-mixed-booked-to-first",
        "the wire meter books a period that mixes ops on one Comm to its first op",
        "dlab/comm/wire.py",
        (("        if len({(id(t.comm), t.op) for t in ops}) > 1:\n",
          "        if len({id(t.comm) for t in ops}) > 1:\n"),),
        ("tests/test_wire_bytes.py::test_a_mixed_busy_period_is_booked_whole_and_apart",),
    ),
    Mutation(
        "busy-nested-twice",
        "the span union adds a span nested inside another to it again",
        "dlab/core/events.py",
        (("            out[-1][1] = max(out[-1][1], e)\n",
          "            out[-1][1] = e if e > out[-1][1] else out[-1][1] + e - s\n"),),
        ("tests/test_comm_time.py::test_a_span_nested_in_another_counts_once",
         "tests/test_comm_time.py::test_random_spans_nested_or_overlapping_count_as_the_cells_they_cover"),
    ),
    Mutation(
        "ddp-judge-buckets-unchecked",
        "the bucketed_ddp checker compares the total bytes all-reduced, not each bucket",
        "dlab/exercises/data_parallel.py",
        (("        if sizes != want:\n", "        if sum(sizes) != sum(want):\n"),),
        ("tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way"
         "[bucketed_ddp-0]",),
    ),
    Mutation(
        "ddp-judge-wait-unchecked",
        "the bucketed_ddp checker passes an answer that waits for each all-reduce in its hook",
        "dlab/exercises/data_parallel.py",
        (("        if all(c.get(\"waited\", float(\"inf\")) < min(nxt, backward_end)\n",
          "        if False and all(c.get(\"waited\", float(\"inf\")) < min(nxt, backward_end)\n"),),
        ("tests/test_exercises.py::test_the_checker_fails_a_right_result_reached_the_wrong_way"
         "[bucketed_ddp-1]",),
    ),
    Mutation(
        "cp-allgather-mask-s-s",
        "the activation estimate sizes all-gather attention's mask s x s, not c x s",
        "dlab/theory/activations.py",
        (("\"core.mask\": \"c s\"", "\"core.mask\": \"s s\""),),
        ("tests/test_nd_parity.py::test_deferred_weight_gradients_and_gathered_attention_hold_the_estimate"
         "[2-{'cp': 2, 'attention': 'allgather'}]",),
    ),
    Mutation(
        "nd-buffers-two-blocks",
        "the transient-buffer formula always counts two gathered ZeRO-3 blocks in backward",
        "dlab/theory/nd_buffers.py",
        (("    at_once = 2 if max(blocks.values()) >= 2 else 1\n", "    at_once = 2\n"),),
        ("tests/test_nd_buffers.py::test_comm_buffers_are_the_formula_on_every_rank_and_step"
         "[4-pp2-dp2-zero3-scheduleinterleaved]",),
    ),
    Mutation(
        "nd-resume-cut-moments",
        "nd, ZeRO >= 1: a resume restores the optimizer state (Adam's moments) only of parameters "
        "wholly inside a rank's chunk; those a chunk boundary cuts restart from zero",
        "dlab/parallel/nd/state.py",
        (("                for k in state:\n",
          "                for k in state if n == slot.numel else ():\n"),),
        ("tests/test_checkpoint_state.py::"
         "test_a_resume_restores_every_moment_master_working_copy_and_scale",),
    ),
    Mutation(
        "nd-main-grads-in-bf16",
        "bf16-fp32-grads: the micro-batches' gradients accumulate in the bf16 .grad (no hook folds "
        "each into the fp32 main_grad), folded once after the last",
        "dlab/parallel/mixed.py",
        (("            p.register_post_accumulate_grad_hook(self._fold_one)\n", ""),),
        ("tests/test_nd_precision_steps.py::test_bf16_fp32_grads_accumulates_micro_batches_in_fp32",),
    ),
    Mutation(
        "fp16-skip-per-rank",
        "fp16: each rank decides alone whether its gradients overflowed (the flag is not reduced "
        "over the world), so a rank with an inf skips while the others step",
        "dlab/parallel/mixed.py",
        (("        dist.all_reduce(found, op=dist.ReduceOp.MAX)\n", "        pass\n"),),
        ("tests/test_nd_precision_steps.py::test_an_overflow_on_one_rank_skips_the_step_on_every_rank",),
    ),
    Mutation(
        "nd-resume-stale-working-copy",
        "nd, ZeRO-3, mixed precision: a resume loads the fp32 masters but leaves the 16-bit shard "
        "the model computes with at its initial values",
        "dlab/parallel/nd/state.py",
        (("                u.shard.copy_(master)\n", "                pass\n"),),
        ("tests/test_checkpoint_state.py::"
         "test_a_resume_restores_every_moment_master_working_copy_and_scale",),
    ),
    Mutation(
        "single-resume-drops-masters",
        "single, mixed precision: a resume loads the 16-bit model but not the fp32 masters the "
        "optimizer steps, so the next step starts from the initial weights",
        "dlab/runtime/checkpoint_load.py",
        (("                masters[i].copy_(saved)\n                p.copy_(masters[i])\n",
          "                p.copy_(saved)\n"),),
        ("tests/test_checkpoint_resume.py::test_a_resume_reproduces_the_uninterrupted_run[single-bf16]",),
    ),
    Mutation(
        "resume-drops-loss-scale",
        "fp16: a resume leaves the loss scaler at its initial scale and counters",
        "dlab/worker/main.py",
        (("        strategy.scaler.load_state_dict(reader.scaler())\n", "        pass\n"),),
        ("tests/test_checkpoint_resume.py::"
         "test_a_resume_reproduces_the_uninterrupted_run[nd-dp2-zero1-fp16]",),
    ),
    Mutation(
        "plan-overlap-twice",
        "planner: a stack's overlap share applied twice (f x f of a collective hides, not f)",
        "dlab/theory/plan/time.py",
        (("    return getattr(stack, name) * knobs.overlap\n",
          "    return getattr(stack, name) * knobs.overlap * getattr(stack, name)\n"),),
        ("tests/test_plan.py::test_an_overlap_share_of_f_hides_f_of_each_collective_its_window_covers[0.5]",
         "tests/test_plan.py::test_every_overlap_share_hides_in_proportion_to_itself[grads]"),
    ),
    Mutation(
        "plan-range-swapped",
        "planner: a prediction's range returned as (high, low)",
        "dlab/theory/plan/ranges.py",
        (("    return (t0 * (1 - math.sqrt(sum(d * d for d in downs))),\n"
          "            t0 * (1 + math.sqrt(sum(d * d for d in ups))))\n",
          "    return (t0 * (1 + math.sqrt(sum(d * d for d in ups))),\n"
          "            t0 * (1 - math.sqrt(sum(d * d for d in downs))))\n"),),
        ("tests/test_plan_ranges.py::test_a_range_holds_its_prediction_and_its_low_is_below_its_high"
         "[70b-3d-torchtitan-fsdp2]",),
    ),
    Mutation(
        "plan-config-tie-ignored",
        "planner: a Hugging Face config's tie_word_embeddings ignored (the activation's default used)",
        "dlab/theory/plan/spec.py",
        (("        tied=not gated if tied is None else tied,\n", "        tied=not gated,\n"),),
        ("tests/test_plan.py::test_tied_embeddings_in_a_config_hold_one_vocab_by_width_matrix_fewer"
         "[silu-True]",),
    ),
    Mutation(
        "plan-profile-drops-attention",
        "planner: a calibrated profile's attention table dropped on load (the kernel shares used "
        "silently)",
        "dlab/theory/plan/cluster.py",
        (("                      attention_table=tuple(tuple(r) for r in k[\"attention_table\"]))\n",
          "                      attention_table=())\n"),),
        ("tests/test_plan_profile.py::test_each_field_of_a_profile_moves_the_prediction_it_feeds"
         "[kernels.attention_table]",),
    ),
    Mutation(
        "gpu-kernel-by-its-start",
        "the GPU session sums a kernel into the phase in which it started, not the one that launched it",
        "dlab/tools/gpu/trace_summary.py",
        (("(launched.get(e.get(\"args\", {}).get(\"correlation\"), e[\"ts\"]), e)",
          "(e[\"ts\"], e)"),),
        ("tests/test_gpu_session.py::test_kernels_are_summed_by_the_phase_that_launched_them",),
    ),
    Mutation(
        "gpu-schema-open",
        "the GPU session's schema lets a field it does not name through",
        "dlab/tools/gpu/schema.py",
        (("            elif extra is False:\n", "            elif extra is None:\n"),),
        ("tests/test_gpu_session.py::test_the_schema_refuses_a_file_naming_the_field",),
    ),
    Mutation(
        "gpu-hang-left-running",
        "a GPU session step past its budget is recorded as timed out but its process is left running",
        "dlab/tools/gpu/session.py",
        (("                kill_tree(proc, grace=5.0)\n", "                pass\n"),),
        ("tests/test_gpu_session.py::test_a_failing_crashing_or_hanging_step_is_recorded_and_the_session_goes_on",),
    ),
    Mutation(
        "gpu-allocator-peak-as-held",
        "the allocator step books the forward's peak activations as held at every phase's end",
        "dlab/tools/gpu/allocator.py",
        (("        mem[\"activations\"] = holder[\"strategy\"].meter.current  # held now, not the peak\n",
          "        mem[\"activations\"] = holder[\"strategy\"].meter.peak\n"),),
        ("tests/test_gpu_session.py::test_the_allocator_step_counts_the_models_state_by_category",),
    ),
    Mutation(
        "assignment-solution-leaks",
        "the assignments' builder closes each solution region one line early: the last line ships",
        "dlab/tools/assignments.py",
        (("[indent + BEGIN, *body.splitlines(), indent + END]",
          "[indent + BEGIN, *body.splitlines()[:-1], indent + END, *body.splitlines()[-1:]]"),),
        ("tests/test_assignments.py::test_no_release_holds_a_line_of_a_reference_solution",),
    ),
    Mutation(
        "assignment-pointer-kept",
        "the assignments keep the notebooks' pointer to docs/instructor/solutions/",
        "dlab/tools/assignments.py",
        (("return Part(ex, POINTER.sub(\"\", text), setup,", "return Part(ex, text, setup,"),),
        ("tests/test_assignments.py::test_no_release_holds_a_line_of_a_reference_solution",),
    ),
    Mutation(
        "assignment-grades-nothing",
        "an assignment's autograder cell prints the report and asserts nothing: every answer scores",
        "dlab/tools/assignments.py",
        (("\\nprint(report)\\nassert report.ok, report.message\"", "\\nprint(report)\""),),
        ("tests/test_assignments.py::test_the_autograder_passes_the_reference_and_names_the_mistake",),
    ),
    Mutation(
        "plan-flops-own-count",
        "planner: the lab GPT's FLOPs per token counted by the planner's own formula, not the "
        "runtime's",
        "dlab/theory/plan/spec.py",
        (("        if self.gpt is not None:\n"
          "            return dataclasses.replace(self.gpt, seq_len=seq_len).flops_per_token()\n", ""),),
        ("tests/test_plan_sharding.py::test_the_planners_flops_per_token_are_the_runtimes_for_the_lab_gpt[options0]",),
    ),
    Mutation(
        "plan-hfu-every-ignored",
        "planner: HFU counts every layer recomputed whatever recompute_every says",
        "dlab/theory/plan/spec.py",
        (("flops.recomputed_per_token(recompute, every, self.n_layer",
          "flops.recomputed_per_token(recompute, 1, self.n_layer"),),
        ("tests/test_plan_sharding.py::test_hfu_follows_recompute_every[2]",),
    ),
    Mutation(
        "plan-zero3-no-window",
        "planner: ZeRO-3's forward gathers hide behind nothing (the layer before's compute ignored)",
        "dlab/theory/plan/data_comm.py",
        (("    add(ag, f_layer, params, m * (layers - 1 + layers * again))\n",
          "    add(ag, 0.0, params, m * (layers - 1 + layers * again))\n"),),
        ("tests/test_plan_sharding.py::test_a_zero3_step_whose_window_is_shorter_than_its_gathers_exposes_the_difference",),
    ),
    Mutation(
        "plan-per-tensor-as-block",
        "planner: a stack that gathers each parameter tensor alone priced as one gather a layer",
        "dlab/theory/plan/data_comm.py",
        (("    if unit == \"tensor\":\n", "    if unit == \"each tensor\":\n"),),
        ("tests/test_plan_sharding.py::test_a_stack_that_gathers_per_tensor_pays_each_collectives_latency",),
    ),
    Mutation(
        "plan-recompute-gathers-once",
        "planner: a stack whose hooks fire on recomputation gathers a recomputed layer's weights "
        "no more than once",
        "dlab/theory/plan/data_comm.py",
        (("             if sh.recompute_gathers and lay.recompute == \"full\" else 0.0)\n",
          "             if sh.recompute_gathers and lay.recompute == \"none\" else 0.0)\n"),),
        ("tests/test_plan_sharding.py::test_module_hooks_gather_again_for_a_recomputed_forward_and_keep_what_is_reused_soon",),
    ),
    Mutation(
        "plan-reuse-distance-ignored",
        "planner: DeepSpeed's reuse distance ignored: every tensor gathered again for backward "
        "after its recomputed forward",
        "dlab/theory/plan/data_comm.py",
        (("if 2 * later[i] >= stack.sharding.reuse]", "if 2 * later[i] >= 0]"),),
        ("tests/test_plan_sharding.py::test_module_hooks_gather_again_for_a_recomputed_forward_and_keep_what_is_reused_soon",),
    ),
    Mutation(
        "plan-live-limit-ignored",
        "planner: a module as large as stage3_max_live_parameters still prefetches the next",
        "dlab/theory/plan/data_comm.py",
        (("    return [gathers[i - 1][0] < live for i in range(len(gathers))]\n",
          "    return [True for i in range(len(gathers))]\n"),),
        ("tests/test_plan_sharding.py::test_a_module_as_large_as_the_live_limit_prefetches_nothing",),
    ),
    Mutation(
        "plan-post-step-gather-dropped",
        "planner: DeepSpeed 2021's gather of the kept tensors after each step left out",
        "dlab/theory/plan/data_comm.py",
        (("    if sh.step_rank_ops and dense_group:", "    if sh.step_rank_ops and not dense_group:"),),
        ("tests/test_plan_sharding.py::test_the_tensors_kept_gathered_are_gathered_again_after_each_step_a_copy_per_rank",),
    ),
    Mutation(
        "plan-rank-copies-host-only",
        "planner: each rank's piece copied costs the host its launch but the device nothing",
        "dlab/theory/plan/data_comm.py",
        (("    on_device = sh.rank_kernels * k * cluster.kernels.launch  #",
          "    on_device = 0 * k * cluster.kernels.launch  #"),),
        ("tests/test_plan_sharding.py::test_a_stack_that_gathers_per_tensor_pays_each_collectives_latency",),
    ),
    Mutation(
        "plan-pp-scatter-ignored",
        "planner: every tensor-parallel rank sends the whole pipeline boundary, as if no stack "
        "split it over them",
        "dlab/theory/plan/time.py",
        (("        scatter = stack.pp_scatter and not lay.sequence_parallel and t > 1",
          "        scatter = False"),),
        ("tests/test_plan_stacks.py::test_a_stack_that_splits_the_boundary_sends_a_tth_and_gathers_what_it_receives",),
    ),
    Mutation(
        "plan-hp-grad-pass-dropped",
        "planner: DeepSpeed's BF16_Optimizer adds the micro-batches' gradients into fp32 for free",
        "dlab/theory/plan/time.py",
        (("    if not stack.hp_grad_pass or g <= w:", "    if True:"),),
        ("tests/test_plan_stacks.py::test_the_bf16_optimizer_adds_each_micro_batchs_gradients_into_fp32_by_a_pass_of_its_own",),
    ),
    Mutation(
        "plan-hp-grads-memory-dropped",
        "planner: DeepSpeed's BF16_Optimizer holds only its fp32 gradients, not autograd's bf16 ones",
        "dlab/theory/plan/memory.py",
        (("            if stack is not None and stack.hp_grad_pass and g > w:",
          "            if False:"),),
        ("tests/test_plan_stacks.py::test_the_bf16_optimizer_adds_each_micro_batchs_gradients_into_fp32_by_a_pass_of_its_own",),
    ),
    Mutation(
        "plan-reduce-copies-dropped",
        "planner: a reduce-scatter from a list of one tensor per rank copies nothing into its "
        "flat buffer on the device",
        "dlab/theory/plan/data_comm.py",
        (("        rs = sum(_reduce(place, p) + on_device for p, _ in reductions)",
          "        rs = sum(_reduce(place, p) for p, _ in reductions)"),),
        ("tests/test_plan_sharding.py::test_a_stack_that_gathers_per_tensor_pays_each_collectives_latency",),
    ),
    Mutation(
        "failed-rank-closes-its-group-first",
        "runtime: a rank whose body raised destroys its process group before its report, so its "
        "peers fail at once and torchrun ends it before it says why",
        "dlab/runtime/rank.py",
        (("        if exc_type is None:\n            dist.destroy_process_group()",
          "        dist.destroy_process_group()"),),
        ("tests/test_magic.py::test_a_rank_slow_to_report_its_error_is_still_the_one_named",),
    ),
    Mutation(
        "plan-blind-overwritten",
        "planner: a source's blind score written over by a later one",
        "dlab/theory/plan/published.py",
        (("    if again or missing:\n", "    if missing:\n"),),
        ("tests/test_plan_sharding.py::test_a_blind_score_is_written_once",),
    ),
    Mutation(
        "plan-sp-regather-dropped",
        "planner: sequence parallelism's backward re-gather of the matmul inputs left out (8 "
        "(t-1)/t a layer where Megatron and dlab move 10)",
        "dlab/theory/plan/time.py",
        (("        regather = 2 if lay.sequence_parallel and stack.sp_regather else 0\n",
          "        regather = 0\n"),),
        ("tests/test_plan.py::test_tensor_parallel_bytes_are_korthikantis_per_layer_count"
         "[megatron-core-2024-True-10]",),
    ),
    Mutation(
        "plan-saved-input-whole",
        "planner: a recomputed layer's saved input kept whole on every tp rank where the layout "
        "distributes it",
        "dlab/theory/plan/memory.py",
        (("            kept /= lay.tp\n", "            kept /= 1\n"),),
        ("tests/test_plan_sharding.py::test_memory_follows_what_the_stack_keeps",),
    ),
    Mutation(
        "plan-deepspeed-two-layers",
        "planner: DeepSpeed's ZeRO-3 charged two gathered layers, not its largest submodule and "
        "prefetch bucket",
        "dlab/theory/plan/memory.py",
        (("    return min(2 * layer, max(modules.values()) + sharding.prefetch)\n",
          "    return 2 * layer\n"),),
        ("tests/test_plan_sharding.py::test_memory_follows_what_the_stack_keeps",),
    ),
    Mutation(
        "quota-said-full",
        "the disk checks: a quota error (EDQUOT) reported as a full disk (ENOSPC)",
        "dlab/core/disk.py",
        (("        return DiskError(path, error.errno, instead)\n",
          "        return DiskError(path, errno.ENOSPC if error.errno in FULL else error.errno, "
          "instead)\n"),),
        ("tests/test_disk_faults.py::test_each_disk_error_is_said_in_its_own_words_naming_the_path",),
    ),
    Mutation(
        "capstone-bf16-grads",
        "capstone checker: a layout with the ZeRO paper's 2-byte gradients judged as it stands, "
        "not as Megatron-Core 2024 runs it (fp32 gradients)",
        "dlab/exercises/capstone.py",
        (("    if layout.precision != brief[\"precision\"]:\n",
          "    if layout.precision not in (brief[\"precision\"], \"bf16\"):\n"),),
        ("tests/test_capstone.py::test_a_layout_that_fits_only_with_two_byte_gradients_fails",),
    ),
    Mutation(
        "capstone-zero3-offered",
        "capstone checker: ZeRO-2 and 3 accepted on Megatron-Core 2024, whose distributed "
        "optimizer is ZeRO-1",
        "dlab/exercises/capstone.py",
        (("    if layout.zero not in brief[\"zero_stages\"]:\n",
          "    if layout.zero not in (0, 1, 2, 3):\n"),),
        ("tests/test_capstone.py::test_a_zero_stage_the_stack_lacks_fails",),
    ),
    Mutation(
        "zero1-train-judge-final-unchecked",
        "the train_zero1 checker compares every step's loss but not the final parameters, which "
        "no loss sees after the last step",
        "dlab/exercises/zero.py",
        (("    for r, (got, _) in enumerate(answers):\n        final = got[\"params\"]\n",
          "    for r, (got, _) in enumerate(answers[:0]):\n        final = got[\"params\"]\n"),),
        ("tests/test_exercises_assemble_dp.py::test_each_mistake_is_named_with_what_to_change"
         "[last-not-written]",
         "tests/test_exercises_assemble_dp.py::test_on_ranks_each_mistake_fails_saying_what_to_change"
         "[last-not-written]"),
    ),
    Mutation(
        "gang-judge-reservation-unchecked",
        "gang_admit checker: a backfilled job that would delay the first job in line goes "
        "unnamed (only a final comparison left to catch it, without saying why)",
        "dlab/exercises/scheduling.py",
        (("            if hours > shadow and gpus > spare:\n",
          "            if False and hours > shadow and gpus > spare:\n"),),
        ("tests/test_exercises_scheduling.py::test_the_checker_names_the_rule_a_mistake_breaks"
         "[backfill-without-reservation]",),
    ),
    Mutation(
        "gang-late-ranks-left-running",
        "the gang drill raises at its deadline but leaves the late ranks running",
        "dlab/procs/gang.py",
        (("                kill_tree(p, grace=1.0)\n", "                pass\n"),),
        ("tests/test_gang.py::test_ranks_still_running_at_the_deadline_are_killed_and_reaped",),
    ),
    Mutation(
        "tp-assembled-judge-calls-unchecked",
        "the train_tp_mlp checker leaves the collectives uncounted (a block whose input skips f "
        "is then judged by its losses alone)",
        "dlab/exercises/tp_assembled.py",
        (("        wrong = _tp_calls(a[\"calls\"])\n", "        wrong = None\n"),),
        ("tests/test_exercises_assemble_mp.py::test_a_wrong_tensor_parallel_block_is_named"
         "[input-detached]",),
    ),
    Mutation(
        "pipeline-assembled-judge-order-unchecked",
        "the train_pipeline_1f1b checker counts each stage's messages but not their order (GPipe's "
        "order, the same messages, passes)",
        "dlab/exercises/pipeline_assembled.py",
        (("    if got != want:\n", "    if len(got) != len(want):\n"),),
        ("tests/test_exercises_assemble_mp.py::test_a_wrong_pipeline_is_named[gpipe-order]",),
    ),
    Mutation(
        "teardown-signal-makes-any-rank-a-casualty",
        "the diagnosis takes every rank torchrun signalled at the teardown for its casualty, one "
        "that had already exited with its own code included",
        "dlab/analysis/diagnose.py",
        (("                               pid is not None and int(code) in closed.get(int(pid), ()))\n",
          "                               pid is not None and int(pid) in closed)\n"),),
        ("tests/test_faults.py::test_a_rank_that_exited_on_its_own_is_named_though_the_teardown_"
         "signalled_it",),
    ),
    Mutation(
        "stop-raises-its-teardown",
        "a run stopped from its dashboard raises, as its failure, the error a rank reports when "
        "the Stop's teardown breaks its collective",
        "dlab/procs/run.py",
        (("        if failure and not self._stopped_healthy:\n", "        if failure:\n"),),
        ("tests/test_faults.py::test_a_stop_names_a_rank_that_failed_before_it_not_one_the_"
         "teardown_broke",),
    ),
    Mutation(
        "registry-reads-the-top-level-only",
        "the strategy registry reads @register in dlab/parallel's own files and not its "
        "subpackages'",
        "dlab/parallel/__init__.py",
        (("root.rglob(\"*.py\")", "root.glob(\"*.py\")"),),
        ("tests/test_registry.py::test_the_names_read_from_the_sources_are_the_names_importing_"
         "registers",),
    ),
]


def copy_checkout(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "runs"))
        else:
            shutil.copy2(src, dest / name)


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: the text to replace occurs {text.count(old)} times, not once:\n{old}")
    path.write_text(text.replace(old, new))


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, list[str], float]:
    """(pytest's exit status, the failed test ids with the first line of each one's error,
    seconds) for ``tests`` run in ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                               *tests], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, ["(timed out)"], time.monotonic() - start
    # -rf's summary: "FAILED <test id> - <first line of the error>"
    failed = re.findall(r"^FAILED (\S+(?: - .{0,120})?)", done.stdout, re.MULTILINE)
    if done.returncode not in (0, 1):
        failed.append(f"(pytest exit {done.returncode}: {done.stdout.strip().splitlines()[-1:]})")
    return done.returncode, failed, time.monotonic() - start


def check(mutations: list[Mutation], timeout: float, baseline: bool = True) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlab-mutations-") as tmp:
        if baseline:
            clean = Path(tmp) / "clean"
            copy_checkout(clean)
            tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
            rc, failed, seconds = run_tests(clean, tests, timeout * len(mutations))
            print(f"baseline: {len(tests)} test selections, exit {rc} in {seconds:.0f} s", flush=True)
            if rc != 0:
                raise SystemExit(f"the tests fail without any mutation: {failed}")
        for m in mutations:
            root = Path(tmp) / m.name
            copy_checkout(root)
            for old, new in m.edits:
                replace_once(root / m.path, old, new)
            rc, failed, seconds = run_tests(root, m.tests, timeout)
            row = {"mutation": m.name, "what": m.what, "caught": rc == 1 and bool(failed),
                   "by": failed, "seconds": round(seconds)}
            print(f"{m.name}: {'caught' if row['caught'] else 'NOT CAUGHT'} by {failed} "
                  f"({seconds:.0f} s)", flush=True)
            rows.append(row)
            shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mutation | planted bug | caught? | by |", "|---|---|---|---|"]
    for r in rows:
        by = "<br>".join(t.split("tests/", 1)[-1].replace("|", "/") for t in r["by"]) or "-"
        lines.append(f"| {r['mutation']} | {r['what']} | {'yes' if r['caught'] else 'NO'} | {by} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--no-baseline", action="store_true", help="skip the unpatched run")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutation's tests")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:24s} {m.what}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutation(s) {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    start = time.monotonic()
    rows = check(chosen, args.timeout, baseline=not args.no_baseline)
    print(table(rows))
    print(f"{sum(r['caught'] for r in rows)} of {len(rows)} caught in {time.monotonic() - start:.0f} s")
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
