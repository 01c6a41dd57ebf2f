"""The planted bugs in the tools that find bugs: the equivalence checker (accumulation/checker/) and train.py's
step-0 probe (accumulation/probe.py), each detector disabled or misdirected one at a time, and the test meant to see
it. scripts/checks/plant_bugs.py runs them with the training-side plants of plants.py."""

from scripts.checks.plants import CHECKER_VERDICTS_TEST, Bug

DETECTOR_BUGS = [
    # The checker's detectors one at a time.
    Bug(
        "checker-n-one-way",
        "the checker's N line fails only a loop N above the reference: a loop that drops targets passes",
        "accumulation/checker/run.py",
        "None if result.tokens == reference_tokens else",
        "None if result.tokens <= reference_tokens else",
        [
            f"{CHECKER_VERDICTS_TEST}::test_the_loop_s_n_is_compared_with_the_raw_examples_count_and_an_n_off_by_one_fails_that_line"
        ],
    ),
    Bug(
        "checker-n-from-the-promise",
        "the checker's reference N taken from supervised_counts, the very promise it checks: a wrong N passes",
        "accumulation/checker/run.py",
        "reference_tokens = count_supervised_tokens(labels)",
        "reference_tokens = int(batch.supervised_counts.sum())",
        [f"{CHECKER_VERDICTS_TEST}::test_a_count_bug_that_scales_every_update_fails_the_supervised_targets_line"],
    ),
    Bug(
        "checker-weights-per-rank-only",
        "the checker compares two builds on each rank but not the ranks' weights: a rank-dependent init passes",
        "accumulation/checker/promises.py",
        "return all(agree for agree, _ in everyone) and len({digest for _, digest in everyone}) == 1",
        "return all(agree for agree, _ in everyone)",
        [
            f"{CHECKER_VERDICTS_TEST}::test_a_model_whose_init_depends_on_the_rank_fails_the_initial_weights_line_on_every_rank"
        ],
    ),
    Bug(
        "checker-verdict-rank-0-only",
        "the checker's verdict not broadcast: on a FAIL rank 0 exits 1 and the other ranks 0",
        "accumulation/checker/run.py",
        "        dist.broadcast_object_list(verdict, src=0)\n",
        "",
        [f"{CHECKER_VERDICTS_TEST}::test_every_rank_exits_with_the_verdict"],
    ),
    # The step-0 probe's detectors, one at a time (tests/test_probe.py).
    Bug(
        "probe-mean-only-warned",
        "a mean loss only warned about at step 0, not refused: every update weighs the micro-batches alike",
        "accumulation/probe.py",
        "            if _relative_difference(whole, weighted) <= ADDITIVE_TOLERANCE:",
        "            if False:",
        ["tests/test_probe.py::test_a_mean_over_the_micro_batch_is_refused_not_warned"],
    ),
    Bug(
        "probe-target-split-ignored",
        "the probe's warning asks only the split of the rows: a loss coupling a row's targets passes silently",
        "accumulation/probe.py",
        "        if _relative_difference(whole, first + second) > ADDITIVE_TOLERANCE or (",
        "        if (",
        [
            "tests/test_probe.py::test_a_loss_that_couples_the_targets_of_a_row_is_seen_by_the_split_of_the_targets_alone"
        ],
    ),
    Bug(
        "probe-row-split-whole",
        "the probe's split of the rows takes all rows at once: a loss coupling the rows passes silently",
        "accumulation/probe.py",
        "for piece in (slice(0, half), slice(half, rows)):",
        "for piece in (slice(0, rows),):",
        ["tests/test_probe.py::test_a_loss_that_couples_rows_is_seen_by_the_split_of_the_rows_alone"],
    ),
    Bug(
        "probe-error-setting-ignored",
        'batch.on_inexact = "error" ignored: an inexact step only warns and trains on',
        "accumulation/probe.py",
        'if warnings and on_inexact == "error":',
        'if warnings and on_inexact == "raise":',
        [
            "tests/test_probe.py::test_a_loss_that_couples_the_targets_of_a_row_is_seen_by_the_split_of_the_targets_alone"
        ],
    ),
    Bug(
        "probe-batchnorm-in-built-mode",
        "the probe looks for BatchNorm in the mode the build left: a model from from_pretrained (eval) passes",
        "accumulation/probe.py",
        "    model.train()  # the mode every step runs it in (train.py's loop), whatever mode the build left it in\n",
        "",
        ["tests/test_probe.py::test_batch_norm_of_a_model_built_in_eval_mode_is_named_too"],
    ),
    Bug(
        "probe-forward-in-train-mode",
        "the probe's forward in train mode: it updates BatchNorm's running statistics and draws dropout",
        "accumulation/probe.py",
        "    model.eval()  # fixed outputs",
        "    pass  # fixed outputs",
        ["tests/test_probe.py::test_batch_norm_and_in_batch_negatives_are_named_in_warnings_or_errors"],
    ),
    Bug(
        "probe-forward-error-raw",
        "a forward that raises at step 0 comes out as a traceback, not one line naming the data and the model",
        "accumulation/probe.py",
        "        except Exception as error:\n            raise StepZeroFailed(\n"
        "                f\"step 0: the model's forward",
        "        except ArithmeticError as error:\n            raise StepZeroFailed(\n"
        "                f\"step 0: the model's forward",
        ["tests/test_probe.py::test_a_forward_or_a_loss_that_raises_is_named_and_the_model_left_in_train_mode"],
    ),
    Bug(
        "probe-loss-error-raw",
        "a loss that raises on the outputs at step 0 comes out as a traceback, not one line naming the shapes",
        "accumulation/probe.py",
        "        except Exception as error:\n            raise StepZeroFailed(\n"
        '                f"step 0: the loss raised',
        "        except ArithmeticError as error:\n            raise StepZeroFailed(\n"
        '                f"step 0: the loss raised',
        ["tests/test_probe.py::test_a_forward_or_a_loss_that_raises_is_named_and_the_model_left_in_train_mode"],
    ),
    Bug(
        "probe-mode-not-restored-on-error",
        "a forward that raises in the probe leaves the model in eval mode",
        "accumulation/probe.py",
        "    try:\n"
        "        outputs, whole = outputs_and_loss(forward_module, loss_sum_fn, batch.inputs, labels, extras)\n"
        "    finally:\n        model.train()",
        "    outputs, whole = outputs_and_loss(forward_module, loss_sum_fn, batch.inputs, labels, extras)\n"
        "    model.train()",
        ["tests/test_probe.py::test_a_forward_or_a_loss_that_raises_is_named_and_the_model_left_in_train_mode"],
    ),
    # The checker on a D x P mesh runs two pipelined steps.
    Bug(
        "checker-one-pipelined-step",
        "the checker runs one pipelined step: a loop that goes wrong from the second step on passes",
        "accumulation/checker/run.py",
        "PIPELINED_STEPS = 2",
        "PIPELINED_STEPS = 1",
        ["tests/test_checker_verdicts.py::test_the_checker_runs_the_pipelined_step_twice_and_compares_both"],
    ),
    # The checker given a model whose outputs do not fit the loss.
    Bug(
        "checker-unfit-outputs-traceback",
        "the checker runs the loop's step on outputs that do not fit the loss: a traceback and exit 1, not one line",
        "accumulation/checker/run.py",
        "        check_outputs_fit_the_loss(model, loss_sum_fn, batch.micro_batches[0], context.device)\n",
        "        pass\n",
        ["tests/test_checker_verdicts.py::test_the_checker_refuses_outputs_that_do_not_fit_the_loss_in_one_line"],
    ),
    # The positions labelled -100 and frozen parameters.
    Bug(
        "probe-ignored-targets-unchecked",
        "a loss that trains padding as token 0 (labels.clamp(min=0)) passes the step-0 probe: loss 44.7, not 5.4",
        "accumulation/probe.py",
        "    if moved and ignored_targets_line(*moved, ADDITIVE_TOLERANCE):",
        "    if False:",
        ["tests/test_probe.py::test_train_py_stops_a_loss_that_supervises_the_padding_naming_it"],
    ),
    Bug(
        "checker-ignored-targets-unchecked",
        "the checker PASSes a loss that trains padding as token 0: loop and reference call the same loss",
        "accumulation/checker/promises.py",
        "    return ignored_targets_line(away, beside, IGNORED_TOLERANCE)",
        "    return None",
        [
            "tests/test_checker_diagnoses.py::test_a_loss_that_supervises_the_padding_fails_naming_the_positions_labelled_100"
        ],
    ),
    Bug(
        "checker-frozen-parameters-compared",
        "the checker reads every parameter's gradient: a frozen one's is None, an AttributeError",
        "accumulation/checker/reference.py",
        "    return [p for p in model.parameters() if p.requires_grad]",
        "    return list(model.parameters())",
        ["tests/test_checker_diagnoses.py::test_a_frozen_embedding_is_left_out_of_the_comparison_and_said_so"],
    ),
]
