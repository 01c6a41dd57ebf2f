"""The planted bugs of scripts/checks/plant_bugs.py: each a text substitution in one file and the tests meant to
see it. A bug whose text is no longer in its file is "not applicable" there: update it here when the code moves."""

from dataclasses import dataclass


@dataclass
class Bug:
    name: str
    what: str  # the wrong number a user would see
    path: str
    old: str
    new: str
    tests: list[str]


VALIDATION_TEST = "tests/test_reference_checks.py::test_validation_loss_on_1_and_2_ranks_and_any_micro_batch_size"
TENSORBOARD_TEST = "tests/test_logs.py::test_tensorboard_after_a_kill_and_a_resume_equals_metrics"
TOKEN_FILES_TEST = "tests/test_token_files.py"
RUN_DIR_TEST = "tests/test_run_dir.py"
CHECKER_VERDICTS_TEST = "tests/test_checker_verdicts.py"
MEMORY_LIMIT_TEST = "tests/test_memory_limit.py"
HANG_UP_TEST = (
    "tests/test_signals.py::test_a_terminal_that_really_hangs_up_stops_the_run_with_a_checkpoint_and_exit_129"
)
CHUNKED_BF16_TEST = (
    "tests/test_chunked_loss.py::"
    "test_a_bf16_autocast_step_with_the_chunked_loss_equals_the_plain_one_and_the_float64_reference"
)

FUSED_SHRINK_TEST = "tests/test_oom.py::test_the_fused_update_after_an_out_of_memory_retry_is_the_update_without_one"
TWO_GROUPS_TEST = (
    "tests/test_pipeline_train.py::test_an_optimizer_state_of_two_groups_moves_between_pipeline_stages_and_one_process"
)

BUGS = [
    Bug(
        "val-loss-one-rank",
        "val_loss summed on one rank only (no all-reduce of the loss sums)",
        "accumulation/run/validation.py",
        "    if dist.is_initialized():\n        dist.all_reduce(loss_sum)\n",
        "",
        [VALIDATION_TEST],
    ),
    Bug(
        "val-batches-rounded-down",
        "validation micro-batches per rank rounded down: rows silently dropped",
        "accumulation/data/sources.py",
        "    for k in range(math.ceil(micro_batches_of_all_ranks / world_size)):",
        "    for k in range(micro_batches_of_all_ranks // world_size):",
        [VALIDATION_TEST],
    ),
    Bug(
        "tb-purge-off-by-one",
        "TensorBoard's purge step on resume one too early: the checkpoint's own point is dropped",
        "accumulation/run/sinks.py",
        "purge_step=counters.steps + after if resumed else None",
        "purge_step=counters.steps + after - 1 if resumed else None",
        [TENSORBOARD_TEST],
    ),
    Bug(
        "tb-no-purge-on-tokens",
        "no purge on the token axis: points of steps run twice appear twice",
        "accumulation/run/sinks.py",
        "purge_step=counters.tokens + after if resumed else None",
        "purge_step=None",
        [TENSORBOARD_TEST],
    ),
    Bug(
        "stop-flag-not-shared",
        "each rank reads its own stop flag: ranks stop at different steps and the others hang",
        "accumulation/step.py",
        "stop_requested=stops > 0,",
        "stop_requested=stop_here,",
        ["tests/test_signals.py::test_every_rank_learns_of_a_stop_request_at_the_same_step"],
    ),
    Bug(
        "norm-still-scaled",
        "clipping with the norm of the still-scaled gradient when a GradScaler is on",
        "accumulation/step.py",
        "grad_norm_tensor = summed[2].sqrt() / scale",
        "grad_norm_tensor = summed[2].sqrt()",
        ["tests/test_reference_checks.py::test_clipping_with_a_grad_scaler_on_equals_the_clipped_float64_gradient"],
    ),
    Bug(
        "clip-by-local-norm-share",
        "clipping by this rank's share of the squared norm, not the all-reduced whole: FSDP2 shards clip apart",
        "accumulation/step.py",
        "torch.nn.utils.clip_grads_with_norm_(parameters, setup.grad_clip, grad_norm_tensor)",
        "torch.nn.utils.clip_grads_with_norm_(parameters, setup.grad_clip, norm_share.sqrt() / scale)",
        [
            "tests/test_checker_configured_step.py::"
            "test_fsdp2_norm_shares_feed_the_clip_on_two_ranks_and_a_clip_by_one_rank_s_norm_fails"
        ],
    ),
    Bug(
        "examples-per-rank",
        "the step reports this rank's examples, not all ranks': the examples counter is short",
        "accumulation/batching.py",
        "GlobalCounts(tokens_all // ranks_per_replica, examples_all // ranks_per_replica)",
        "GlobalCounts(tokens_all // ranks_per_replica, examples_local)",
        ["tests/test_reference_checks.py::test_two_rank_step_result_equals_the_float64_full_batch"],
    ),
    Bug(
        "half-metrics-line",
        "a full disk leaves half a metrics line that a resume would keep as a record",
        "accumulation/run/sinks.py",
        "            os.ftruncate(self.descriptor, size_before)",
        "            pass",
        ["tests/test_logs.py::test_a_metrics_line_is_on_a_full_disk_whole_or_not_at_all"],
    ),
    Bug(
        "checkpoint-temporary-kept",
        "a failed save leaves its temporary file on the full disk",
        "accumulation/run/checkpoint.py",
        "                leftover.unlink(missing_ok=True)",
        "                pass",
        ["tests/test_logs.py::test_a_checkpoint_on_a_full_disk_is_one_line_and_the_older_ones_stay"],
    ),
    Bug(
        "dropout-stream-not-restored",
        "a resume starts dropout afresh instead of continuing each rank's stream",
        "accumulation/run/restore.py",
        '        torch.set_rng_state(per_rank[context.rank]["cpu"])',
        "        pass",
        ["tests/test_train.py::test_resume_is_bit_exact_with_dropout"],
    ),
    Bug(
        "signal-stop-without-checkpoint",
        "a stop signal ends the run without its checkpoint: the steps since the last one are lost",
        "train.py",
        "now=stop_reason is not None or result.stop_requested)",
        "now=stop_reason is not None)",
        ["tests/test_signals.py::test_a_stop_signal_mid_step_checkpoints_and_the_restart_is_bit_identical"],
    ),
    # Issue 21: holes an adversarial session found, each now seen by a test.
    Bug(
        "token-ids-signed",
        "nanoGPT token ids read as signed 16-bit: GPT-2's ids from 32,768 on come out negative",
        "accumulation/data/token_files.py",
        'NANOGPT_TOKEN_TYPE = np.dtype("<u2")',
        'NANOGPT_TOKEN_TYPE = np.dtype("<i2")',
        [f"{TOKEN_FILES_TEST}::test_ids_of_a_gpt2_sized_vocabulary_read_back_unsigned"],
    ),
    Bug(
        "token-files-writable",
        "token files memory-mapped for writing: a read-only mount fails with a traceback",
        "accumulation/data/token_files.py",
        'np.memmap(path, dtype=NANOGPT_TOKEN_TYPE, mode="r")',
        'np.memmap(path, dtype=NANOGPT_TOKEN_TYPE, mode="r+")',
        [f"{TOKEN_FILES_TEST}::test_token_files_on_a_read_only_mount_are_read"],
    ),
    Bug(
        "token-file-stamps-ignored",
        "a resume over a token file edited in place between the sampled blocks goes on silently",
        "accumulation/run/restore.py",
        '    check_token_files_unchanged(path, payload["data"].get("files", ()), data.file_stamps)\n',
        "",
        [f"{TOKEN_FILES_TEST}::test_a_resume_over_a_token_file_edited_in_place_is_refused_and_a_plain_copy_resumes"],
    ),
    Bug(
        "end-token-on-prompt",
        "the end token appended to the prompt, not the response: no row supervises it, the model never stops",
        "accumulation/data/jsonl.py",
        "(np.array(prompt, dtype=np.int64), np.array(response + end, dtype=np.int64))",
        "(np.array(prompt + end, dtype=np.int64), np.array(response, dtype=np.int64))",
        ["tests/test_jsonl.py::test_the_end_token_ends_the_response_and_is_supervised"],
    ),
    Bug(
        "resume-ignores-beta2",
        "a resume does not compare AdamW's beta2: config.toml says 0.99, AdamW keeps 0.95",
        "accumulation/run/restore.py",
        '    ("optim", "beta2"),\n',
        "",
        ["tests/test_checkpoints.py::test_every_setting_that_shapes_the_run_is_compared_on_resume"],
    ),
    Bug(
        "fsdp2-state-misplaced",
        "FSDP2 optimizer state sharded along the last dimension on load, not as its parameter",
        "accumulation/parallel/fsdp.py",
        "param.device_mesh, param.placements, src_data_rank=None",
        "param.device_mesh, [type(param.placements[0])(value.dim() - 1)], src_data_rank=None",
        ["tests/test_fsdp.py::test_one_sgd_update_under_fsdp2_equals_ddp_and_the_float64_reference"],
    ),
    Bug(
        "validation-every-n-updates",
        "the validation cadence counted in applied updates: after a skipped step it moves",
        "train.py",
        "if validator.should_validate(counters.steps):",
        "if validator.should_validate(counters.updates):",
        ["tests/test_nonfinite_steps.py::test_a_non_finite_step_is_skipped_or_stops_the_run"],
    ),
    Bug(
        "loss-sum-attached",
        "the logged loss sum accumulated without detaching (no value changes: only the assertion sees it)",
        "accumulation/step.py",
        "loss_sum_local += loss_sum.detach()",
        "loss_sum_local += loss_sum",
        ["tests/test_step.py::test_logged_loss_is_the_exact_global_token_mean"],
    ),
    Bug(
        "dropout-stream-of-rank-0",
        "a resume gives every rank rank 0's dropout stream",
        "accumulation/run/restore.py",
        'torch.set_rng_state(per_rank[context.rank]["cpu"])',
        'torch.set_rng_state(per_rank[0]["cpu"])',
        ["tests/test_checkpoints.py::test_each_rank_continues_its_own_dropout_stream_after_a_resume"],
    ),
    Bug(
        "no-run-lock",
        "no lock on the run directory: two jobs on one name interleave and lose metrics lines",
        "accumulation/run/run_dir.py",
        "fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "pass",
        [f"{RUN_DIR_TEST}::test_two_jobs_started_together_one_is_refused_and_a_killed_holder_blocks_nobody"],
    ),
    Bug(
        "error-line-rank-0-only",
        "only rank 0 prints a start-up error: under torchrun the agent can stop it before it prints",
        "accumulation/run/entry.py",
        "    except (LaunchError, ConfigError, DataError, CheckpointError, RunDirectoryError) as error:\n"
        "        print(",
        "    except (LaunchError, ConfigError, DataError, CheckpointError, RunDirectoryError) as error:\n"
        "        if job is not None and job.rank == 0:\n            print(",
        [f"{RUN_DIR_TEST}::test_the_error_line_survives_torchrun_when_rank_0_starts_last"],
    ),
    Bug(
        "ctrl-c-not-caught",
        "Ctrl-C ends the run without a checkpoint (SIGINT not among the stop signals)",
        "accumulation/run/signals.py",
        "STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)",
        "STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)",
        [
            "tests/test_signals.py::test_a_stop_signal_mid_step_checkpoints_and_the_restart_is_bit_identical[sigint-mid-step]"
        ],
    ),
    # Issue 35: the memory limit a cgroup sets.
    Bug(
        "cgroup-v2-path-absolute",
        "the cgroup's path joined with its leading '/': memory.max looked up outside the cgroup tree, no limit seen",
        "accumulation/data/memory.py",
        'limit_file = CGROUP_ROOT / group.lstrip("/") / "memory.max"',
        'limit_file = CGROUP_ROOT / group / "memory.max"',
        [MEMORY_LIMIT_TEST],
    ),
    Bug(
        "cgroup-v1-file-name",
        "cgroup v1's limit read from memory.max, a v2 name: a v1 job's limit is never seen",
        "accumulation/data/memory.py",
        '/ "memory.limit_in_bytes"',
        '/ "memory.max"',
        [MEMORY_LIMIT_TEST],
    ),
    Bug(
        "cgroup-max-not-handled",
        "memory.max = 'max' read as a number: every run in an unlimited cgroup v2 dies with a traceback",
        "accumulation/data/memory.py",
        "if limit.isdigit() and int(limit) < 2**60:",
        "if int(limit) < 2**60:",
        [MEMORY_LIMIT_TEST],
    ),
    Bug(
        "cgroup-v1-unlimited-is-a-limit",
        "cgroup v1's 'no limit' (2^63 rounded to a page) taken as a limit: the message names 8 EiB",
        "accumulation/data/memory.py",
        "if limit.isdigit() and int(limit) < 2**60:",
        "if limit.isdigit():",
        [MEMORY_LIMIT_TEST],
    ),
    Bug(
        "memory-limit-largest",
        "the memory a process can have is the largest of the limits, not the smallest: text over its cgroup is read",
        "accumulation/data/memory.py",
        "    return min((limit_bytes, limit) for limit_bytes, limit, _ in memory_limits())",
        "    return max((limit_bytes, limit) for limit_bytes, limit, _ in memory_limits())",
        [MEMORY_LIMIT_TEST],
    ),
    # Issue 35: the chunked loss under CPU autocast.
    Bug(
        "chunked-softmax-in-bf16",
        "the chunked loss's logsumexp and softmax in the autocast dtype: the loss off by bf16's rounding",
        "accumulation/chunked_loss.py",
        "softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)",
        "softmax_dtype = hidden.dtype",
        [CHUNKED_BF16_TEST],
    ),
    Bug(
        "chunked-loss-sum-in-bf16",
        "the chunked loss adds its chunks' sums in the autocast dtype: the logged loss rounded to bf16",
        "accumulation/chunked_loss.py",
        "loss_sum = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)",
        "loss_sum = torch.zeros((), dtype=compute_dtype, device=hidden.device)",
        [CHUNKED_BF16_TEST],
    ),
    Bug(
        "chunked-autocast-cuda-only",
        "the chunked loss asks whether CUDA's autocast is on: under CPU bf16 autocast its products stay fp32",
        "accumulation/chunked_loss.py",
        "if torch.is_autocast_enabled(device_type) and",
        "if torch.is_autocast_enabled() and",
        [CHUNKED_BF16_TEST],
    ),
    # Issue 35: a terminal that really hangs up (the piped SIGHUP tests cannot see these).
    Bug(
        "sighup-output-kept",
        "SIGHUP leaves stdout and stderr on the dead terminal: the 'stopped' line fails with EIO, no clean exit",
        "accumulation/run/signals.py",
        "        if signum == signal.SIGHUP:\n            detach_from_closed_terminal()\n",
        "",
        [HANG_UP_TEST],
    ),
    Bug(
        "sighup-isatty",
        "the hung-up terminal recognised with isatty, which fails on it: stdout stays on the dead terminal",
        "accumulation/run/signals.py",
        "if stat.S_ISCHR(os.fstat(descriptor).st_mode):",
        "if os.isatty(descriptor):",
        [HANG_UP_TEST],
    ),
    # Issue 35: pipelined state off the happy path (tests/test_pipeline_train.py).
    Bug(
        "pipeline-stage-left-in-eval",
        "pipelined validation leaves its stage in eval mode: a caller's next step trains without dropout",
        "accumulation/parallel/pipeline.py",
        "    pipeline.stage_module.train()\n    return loss_sum, tokens",
        "    return loss_sum, tokens",
        [
            "tests/test_pipeline_train.py::test_pipelined_validation_runs_in_eval_mode_and_leaves_every_stage_in_train_mode"
        ],
    ),
    Bug(
        "pipeline-validation-in-train-mode",
        "pipelined validation with dropout on: a noisy val_loss, and the next steps' dropout stream moved",
        "accumulation/parallel/pipeline.py",
        "    pipeline.stage_module.eval()\n",
        "",
        ["tests/test_pipeline_train.py::test_validation_between_pipelined_steps_changes_no_update"],
    ),
    Bug(
        "pipeline-saved-groups-swapped",
        "a pipelined checkpoint gives each optimizer group the other's settings: weight decay on the norms' gains",
        "accumulation/parallel/pipeline.py",
        'zip(pipeline.whole_order, state_dict["param_groups"], strict=True)',
        'zip(pipeline.whole_order, state_dict["param_groups"][::-1], strict=True)',
        [TWO_GROUPS_TEST],
    ),
    Bug(
        "pipeline-saved-state-in-stage-numbering",
        "pipelined checkpoints number each stage's optimizer state from 0: the stages' momenta land on each other",
        "accumulation/parallel/pipeline.py",
        "    return [index[name] for group in optimizer_order(optimizer, pipeline.names) for name in group]",
        "    return list(range(sum(len(group) for group in optimizer_order(optimizer, pipeline.names))))",
        [TWO_GROUPS_TEST],
    ),
    Bug(
        "pipeline-loaded-groups-swapped",
        "a resume on pipeline stages gives each optimizer group the other's settings",
        "accumulation/parallel/pipeline.py",
        'zip(optimizer_order(optimizer, pipeline.names), state_dict["param_groups"], strict=True)',
        'zip(optimizer_order(optimizer, pipeline.names), state_dict["param_groups"][::-1], strict=True)',
        [TWO_GROUPS_TEST],
    ),
    Bug(
        "pipeline-loaded-state-numbered-per-group",
        "a resume on pipeline stages numbers the optimizer state within each group: the second group's overwrites",
        "accumulation/parallel/pipeline.py",
        "                state[first + offset] = state_dict",
        "                state[offset] = state_dict",
        [TWO_GROUPS_TEST],
    ),
    # Issue 43: pipeline stages' sharded checkpoints (tests/test_pipeline_checkpoint.py).
    Bug(
        "pipeline-stage-steps-not-gathered",
        "a pipelined folder's state.pt keeps only stage 0's AdamW steps: the other stages' parameters lose theirs",
        "accumulation/run/sharded_checkpoint.py",
        '        rest["optimizer"]["state"] = dict(sorted(merged.items()))',
        "        pass",
        ["tests/test_pipeline_checkpoint.py::test_a_pipelined_run_writes_sharded_folders_and_no_single_file"],
    ),
    Bug(
        "pipeline-replicas-write-copies",
        "every replica's stages write their tensors: D copies of the state written, and the D x P mesh's disk time",
        "accumulation/parallel/pipeline.py",
        "    if pipeline.layout.replica == 0:\n        names, numbers",
        "    if True:\n        names, numbers",
        [
            "tests/test_pipeline_checkpoint.py::"
            "test_a_two_by_two_mesh_writes_folders_of_replica_0_and_resumes_bit_exactly"
        ],
    ),
    Bug(
        "layout-check-too-weak",
        "the layout check asks only for enough ranks: 4 ranks for 3 stages start, and one rank has no stage",
        "accumulation/parallel/mesh.py",
        "    if ranks % pipeline_stages != 0:",
        "    if ranks < pipeline_stages:",
        [
            "tests/test_pipeline_train.py::test_ranks_that_do_not_divide_into_the_stages_are_refused_by_the_layout_check_alone"
        ],
    ),
    # Issue 35: a refusal after the run lock is taken.
    Bug(
        "refused-resume-keeps-lock",
        "a resume refused after taking the lock leaves the run.lock it created in a folder that had none",
        "accumulation/run/entry.py",
        "            job.release(undo=True)  # a refused run",
        "            job.release(undo=False)  # a refused run",
        ["tests/test_run_dir.py::test_a_resume_refused_after_taking_the_lock_leaves_the_run_directory_as_it_was"],
    ),
    # Issue 35: the timing of a data error in a step built one step ahead.
    Bug(
        "prefetch-error-raised-early",
        "a data error in the next step's batch raised while building it: the current step is neither logged nor saved",
        "accumulation/run/batches.py",
        "        except DataError:\n            pass",
        "        except ArithmeticError:\n            pass",
        [
            "tests/test_step_order.py::"
            "test_a_data_error_in_the_step_built_ahead_surfaces_in_its_own_step_after_the_one_before_is_kept"
        ],
    ),
    # Issue 35: the fused update combined with the out-of-memory retry.
    Bug(
        "shrink-flag-read-only-with-ranks",
        "one process reads no out-of-memory flag: the step goes on without its failed micro-batches' gradients",
        "accumulation/shrink_on_oom.py",
        "        if flags.item() > 0:",
        "        if dist.is_initialized() and flags.item() > 0:",
        [FUSED_SHRINK_TEST],
    ),
    Bug(
        "fused-update-never-skipped",
        "the fused update's found_inf flag always 0: a non-finite step's nan update applied on the device",
        "accumulation/update_on_device.py",
        "optimizer.found_inf = torch.logical_not(torch.isfinite(grad_norm)).to(torch.float32)",
        "optimizer.found_inf = torch.zeros((), dtype=torch.float32)",
        [FUSED_SHRINK_TEST],
    ),
    # Issue 35: the run directory deleted mid-run.
    Bug(
        "deleted-run-metrics-claimed",
        "a run directory deleted mid-run: the error line says metrics.jsonl holds every step, though it is gone",
        "accumulation/run/sinks.py",
        "        if metrics_path.exists()\n",
        "        if True\n",
        ["tests/test_run_dir.py::test_a_run_directory_deleted_mid_run_is_not_said_to_hold_the_metrics"],
    ),
    # Issue 35: the checker on a D x P mesh runs two pipelined steps.
    Bug(
        "pipeline-schedule-without-no-sync",
        "the schedule step outside DDP's no_sync: the shape inference arms the reducer; a 2 x 2 mesh dies at step 2",
        "accumulation/parallel/pipeline.py",
        "        with pipeline.wrapped.no_sync() if isinstance(pipeline.wrapped, DistributedDataParallel) "
        "else nullcontext():",
        "        with nullcontext():",
        ["tests/test_checker_verdicts.py::test_the_checker_runs_the_pipelined_step_twice_and_compares_both"],
    ),
]
