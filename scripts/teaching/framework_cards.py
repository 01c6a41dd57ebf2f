"""Executable framework cards: each framework's own accumulation path, measured against the float64 full batch.

    python scripts/teaching/framework_cards.py [--json]

Section 20 of docs/accumulation.md has one card per framework saying how it normalises under gradient
accumulation. This script measures the cards. Every framework trains the same tiny causal language model (built
here from a local config, in float64: nothing is downloaded) for one optimizer step of plain SGD over the same 8
rows, cut into A = 4 micro-batches of 2 rows whose supervised targets number 30, 3, 21 and 7, so that a mean of
micro-batch means shows. The update each framework applies is compared with the float64 full-batch reference:
-lr times the gradient of the token mean over all 8 rows, written from its definition (the sum of -log p(target)
over the supervised targets, divided by their count N).

Every normalisation these frameworks have weighs each row's loss sum S_r by some w_r: the update is
-lr · sum_r w_r ∇S_r. The reference has w_r = 1/N; each gallery row of scripts/teaching/pitfalls.py has weights
of its own (row 1: 1/(A n_k) for a row of micro-batch k, which holds n_k targets). Each card names the gallery
row it reproduces, and "matches" checks that the update equals that row's weights applied to the same rows.
The Trainer's cards on 2 ranks are in framework_cards_two_ranks.py.

Where a framework's loop needs what a test cannot give it (torchtune's recipe a checkpoint and a tokenizer;
torchtitan's trainer its own model, data loader and process mesh; TRL's GRPO trainer a generation loop), its own
loss and normalisation functions run inside the few lines of its loop that call them, written out here.
A framework that is not installed is skipped (pip install -r requirements-cards.txt). An error at rounding level
prints as a bound: < 1e-14 in float64; < 1e-6 where a loss passes through float32 (transformers', torchtune's and
torchtitan's cast the logits with .float(); TRL divides by a token count held as a float32 tensor).
"""

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import json
import logging
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.teaching.card_setup import (  # noqa: E402
    ACCUMULATION_STEPS,
    ADVANTAGES,
    IGNORE_INDEX,
    LR,
    MICRO_BATCH_SIZE,
    OTHER_STEP_TARGETS,
    ROW_TOKENS,
    constant_denominator,
    divided_twice,
    flat_parameters,
    gpt2,
    llama,
    mean_of_means,
    means_summed,
    micro_batches,
    over_mean_step,
    row_gradients,
    sequence_mean,
    shifted_targets,
    step_rows,
    sum_over_unshifted_count,
    targets_per_micro_batch,
    token_mean,
    unshifted_count,
)

# A framework's update matches a gallery row's weights to rounding: ~1e-16 relative in float64, ~1e-7 where the
# loss passes through float32. A different formula is off by more than 1e-2 on these rows.
MATCH_RTOL = 1e-6
ROUNDING_BOUNDS = (1e-14, 1e-6)  # how a rounding-level error prints: float64, float32 loss


# ---------------------------------------------------------------------------------------------------------
# Each framework's accumulation path. Each takes a fresh model and applies one update to it in place.
# ---------------------------------------------------------------------------------------------------------


def hf_trainer(accepts_count: bool | None = None, loss_type: str | None = None) -> Callable[[torch.nn.Module], None]:
    """transformers.Trainer: gradient_accumulation_steps = A, plain SGD, constant lr, no clipping, rows in order.
    accepts_count=False sets the model's accepts_loss_kwargs, as a model whose forward takes no count has it.
    loss_type names the model's loss for a head whose class name does not (GPT2LMHeadModel's is None): the
    Trainer counts num_items_in_batch after the label shift only where loss_type maps to ForCausalLMLoss."""

    def run(model: torch.nn.Module) -> None:
        import transformers

        if accepts_count is not None:
            model.accepts_loss_kwargs = accepts_count
        if loss_type is not None:
            model.loss_type = loss_type
        input_ids, labels = step_rows()
        rows = [{"input_ids": i, "labels": label} for i, label in zip(input_ids, labels, strict=True)]
        with tempfile.TemporaryDirectory() as output_dir:
            args = trainer_arguments(output_dir, ACCUMULATION_STEPS)
            transformers.Trainer(model=model, args=args, train_dataset=rows).train()

    return run


def trainer_arguments(output_dir: str, accumulation_steps: int, **settings):
    """The HF Trainer's settings of every card: one plain-SGD step of micro-batches of MICRO_BATCH_SIZE rows taken
    in order, A = `accumulation_steps`, unclipped (the reference is), nothing logged or saved, on the CPU."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH_SIZE,
        gradient_accumulation_steps=accumulation_steps,
        max_steps=1,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # 0 turns its clipping off
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        **settings,
    )


def model_mean(model, micro_batch, targets_in_step):
    return model(**micro_batch).loss


def model_sum_over_n(model, micro_batch, targets_in_step):
    return model(**micro_batch, num_items_in_batch=targets_in_step).loss


def model_sum_over_n_times_a(model, micro_batch, targets_in_step):
    """S_k · A / N: the framework's division by A then leaves S_k / N."""
    return model(**micro_batch, num_items_in_batch=targets_in_step).loss * ACCUMULATION_STEPS


def accelerate_accumulate(loss_of: Callable) -> Callable[[torch.nn.Module], None]:
    """with accelerator.accumulate(model): forward, accelerator.backward(loss), optimizer.step() (which the
    prepared optimizer skips until the A-th micro-batch)."""

    def run(model: torch.nn.Module) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        # Accelerate keeps its state in process-wide singletons: reset, each card starts as a new script would.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION_STEPS, cpu=True)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        targets_in_step = sum(targets_per_micro_batch())
        for micro_batch in micro_batches():
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, micro_batch, targets_in_step))
                optimizer.step()
                optimizer.zero_grad()

    return run


def lightning_accumulate(loss_of: Callable) -> Callable[[torch.nn.Module], None]:
    """pytorch_lightning.Trainer(accumulate_grad_batches=A): training_step returns the loss, Lightning divides
    it by A and steps the optimizer every A batches."""

    def run(model: torch.nn.Module) -> None:
        import pytorch_lightning as pl

        targets_in_step = sum(targets_per_micro_batch())

        class CardModule(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = model

            def training_step(self, micro_batch, index):
                return loss_of(self.model, micro_batch, targets_in_step)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=LR)

        loader = torch.utils.data.DataLoader(
            [dict(zip(("input_ids", "labels"), row, strict=True)) for row in zip(*step_rows(), strict=True)],
            batch_size=MICRO_BATCH_SIZE,
            shuffle=False,
        )
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=1,
                accumulate_grad_batches=ACCUMULATION_STEPS,
                precision="64-true",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
            trainer.fit(CardModule(), loader)

    return run


def torchtune_recipe(mask_position_0: bool) -> Callable[[torch.nn.Module], None]:
    """The accumulation lines of torchtune's full_finetune recipes with its chunked loss and scale_grads: each
    micro-batch's mean loss times its count of supervised labels, counted before the recipe shifts them, then
    the gradients times world_size / (the step's count) after the A-th backward (world_size 1 here).
    mask_position_0 masks every row's first label, as torchtune's Llama 3 chat tokenizer masks its BOS."""

    def run(model: torch.nn.Module) -> None:
        from torchtune import training
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        loss_fn = CEWithChunkedOutputLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        ignore_column = torch.full((MICRO_BATCH_SIZE, 1), loss_fn.ignore_index)
        tokens_in_step = 0
        for micro_batch in micro_batches():
            labels = micro_batch["labels"].clone()
            if mask_position_0:
                labels[:, 0] = loss_fn.ignore_index
            current_tokens = (labels != loss_fn.ignore_index).sum()
            tokens_in_step += current_tokens
            logits = model(input_ids=micro_batch["input_ids"]).logits
            labels = torch.hstack((labels[..., 1:], ignore_column))
            chunks = list(logits.chunk(loss_fn.num_output_chunks, dim=1))
            (loss_fn(chunks, labels) * current_tokens).backward()
        training.scale_grads(model, 1 / tokens_in_step)
        optimizer.step()

    return run


def torchtitan_train_step(model: torch.nn.Module) -> None:
    """The accumulation lines of torchtitan's Trainer.train_step with its CrossEntropyLoss: count the step's
    valid (already shifted) labels first, then each micro-batch's loss sum over that count, one backward each."""
    from torchtitan.components.loss import IGNORE_INDEX as TITAN_IGNORE_INDEX
    from torchtitan.components.loss import CrossEntropyLoss

    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # torchtitan's data loader yields input = tokens[:-1], labels = tokens[1:]
    shifted = [(mb["input_ids"][:, :-1], shifted_targets(mb["labels"])) for mb in micro_batches()]
    global_valid_tokens = sum((labels != TITAN_IGNORE_INDEX).sum() for _, labels in shifted)
    for inputs, labels in shifted:
        loss, _ = loss_fn(model(input_ids=inputs).logits, labels, global_valid_tokens)
        loss.backward()
    optimizer.step()


def trl_grpo(loss_type: str, generation_steps: int = 1) -> Callable[[torch.nn.Module], None]:
    """TRL's GRPOTrainer._compute_loss on each micro-batch (prompt: the first token; completion: the rest,
    masked where a row has no target), one backward each, one SGD step: the Trainer's training_step does not
    divide GRPO's loss by A (GRPOTrainer.loss_is_scaled_for_ga). Its generation loop needs a sampler and reward
    functions, so a stand-in carries the attributes _compute_loss reads, set from a GRPOConfig as __init__ does.
    generation_steps = 2 sets steps_per_generation = 2A: the generation batch then feeds this step and a second
    one of OTHER_STEP_TARGETS completion tokens, whose count enters num_items_in_batch (its rows are not run:
    only the first step's update is measured, and only the second step's count reaches it)."""

    def run(model: torch.nn.Module) -> None:
        from trl import GRPOConfig, GRPOTrainer

        with tempfile.TemporaryDirectory() as output_dir:
            args = GRPOConfig(
                output_dir=output_dir,
                loss_type=loss_type,
                gradient_accumulation_steps=ACCUMULATION_STEPS,
                per_device_train_batch_size=MICRO_BATCH_SIZE,
                max_completion_length=ROW_TOKENS - 1,
                steps_per_generation=generation_steps * ACCUMULATION_STEPS,
                use_cpu=True,
                report_to="none",
            )
        trainer = grpo_stand_in(args, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        input_ids, labels = step_rows()
        completion_tokens = int((shifted_targets(labels) != IGNORE_INDEX).sum())
        if generation_steps == 2:
            completion_tokens += OTHER_STEP_TARGETS
        for start in range(0, len(input_ids), MICRO_BATCH_SIZE):
            rows = slice(start, start + MICRO_BATCH_SIZE)
            inputs = {
                "prompt_ids": input_ids[rows, :1],
                "prompt_mask": torch.ones_like(input_ids[rows, :1]),
                "completion_ids": input_ids[rows, 1:],
                "completion_mask": (shifted_targets(labels[rows]) != IGNORE_INDEX).long(),
                "advantages": torch.tensor(ADVANTAGES[rows], dtype=torch.float64),
                "num_items_in_batch": torch.tensor(completion_tokens),  # the generation batch's, as TRL counts it
            }
            GRPOTrainer._compute_loss(trainer, model, inputs).backward()
        optimizer.step()

    return run


def grpo_stand_in(args, model: torch.nn.Module) -> SimpleNamespace:
    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **unused):
        log_probs = model(input_ids=input_ids).logits[:, -logits_to_keep - 1 : -1].log_softmax(-1)
        logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        return logps, -(log_probs.exp() * log_probs).sum(-1).detach(), None

    one_process = SimpleNamespace(
        num_processes=1, sync_gradients=False, gather=lambda t: t.reshape(-1), reduce=lambda t, reduction: t
    )
    return SimpleNamespace(
        args=args,
        model=model,
        loss_type=args.loss_type,
        beta=args.beta,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level,
        off_policy_mask_threshold=args.off_policy_mask_threshold,
        top_entropy_quantile=args.top_entropy_quantile,
        max_completion_length=args.max_completion_length,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        use_vllm=False,
        aux_loss_enabled=False,
        current_gradient_accumulation_steps=ACCUMULATION_STEPS,
        accelerator=one_process,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
    )


# ---------------------------------------------------------------------------------------------------------
# The cards: run, compare, print.
# ---------------------------------------------------------------------------------------------------------


PACKAGES = {  # the module imported to check a framework is there; its distribution's version is printed
    "HF Trainer": "transformers",
    "Accelerate": "accelerate",
    "Lightning": "pytorch_lightning",
    "torchtune": "torchtune",
    "torchtitan": "torchtitan",
    "TRL GRPO": "trl",
}


@dataclass(frozen=True)
class Card:
    framework: str
    setting: str
    gallery_row: str  # the gallery row whose weights it applies; "-": the token mean; "none": another objective
    build: Callable[[], torch.nn.Module]
    run: Callable[[torch.nn.Module], None]
    weights: Callable[[], torch.Tensor]
    # GRPO's row objective at the sampling policy (ratio 1) is advantage_r · S_r: -advantage times the sum of
    # log p over the row's completion tokens, here its supervised targets. Its reference is their token mean.
    policy_gradient: bool = False


GPT2_LM, GPT2_DOUBLE = gpt2("GPT2LMHeadModel"), gpt2("GPT2DoubleHeadsModel")
CARDS = [
    Card("HF Trainer", "GPT2LMHeadModel, defaults (loss_type None)", "11",
         GPT2_LM, hf_trainer(), sum_over_unshifted_count),
    Card("HF Trainer", 'GPT2LMHeadModel, loss_type = "ForCausalLM"', "-",
         GPT2_LM, hf_trainer(loss_type="ForCausalLM"), token_mean),
    Card("HF Trainer", "GPT2DoubleHeadsModel (drops num_items_in_batch)", "21",
         GPT2_DOUBLE, hf_trainer(), means_summed),
    Card("HF Trainer", "LlamaForCausalLM (loss_type ForCausalLM), defaults", "-",
         llama, hf_trainer(), token_mean),
    Card("HF Trainer", "LlamaForCausalLM, accepts_loss_kwargs = False", "1",
         llama, hf_trainer(accepts_count=False), mean_of_means),
    Card("Accelerate", "accumulate, model's mean loss", "1",
         llama, accelerate_accumulate(model_mean), mean_of_means),
    Card("Accelerate", "accumulate, loss with num_items_in_batch = N", "3",
         llama, accelerate_accumulate(model_sum_over_n), divided_twice),
    Card("Accelerate", "accumulate, loss S · A / N", "-",
         llama, accelerate_accumulate(model_sum_over_n_times_a), token_mean),
    Card("Lightning", "accumulate_grad_batches, model's mean loss", "1",
         llama, lightning_accumulate(model_mean), mean_of_means),
    Card("Lightning", "accumulate_grad_batches, loss S · A / N", "-",
         llama, lightning_accumulate(model_sum_over_n_times_a), token_mean),
    Card("torchtune", "recipe's lines rebuilt: labels = tokens (text completion)", "11",
         llama, torchtune_recipe(mask_position_0=False), unshifted_count),
    Card("torchtune", "recipe's lines rebuilt: first label masked (Llama 3 chat)", "-",
         llama, torchtune_recipe(mask_position_0=True), token_mean),
    Card("torchtitan", "train_step's lines rebuilt: global_valid_tokens", "-",
         llama, torchtitan_train_step, token_mean),
    Card("TRL GRPO", 'loss_type "dapo" (default)', "-",
         llama, trl_grpo("dapo"), token_mean, policy_gradient=True),
    Card("TRL GRPO", 'loss_type "dapo", steps_per_generation = 2A, steps of 61 and 39 tokens', "none",
         llama, trl_grpo("dapo", generation_steps=2), over_mean_step, policy_gradient=True),
    Card("TRL GRPO", 'loss_type "bnpo"', "1",
         llama, trl_grpo("bnpo"), mean_of_means, policy_gradient=True),
    Card("TRL GRPO", 'loss_type "grpo": a sequence mean', "none",
         llama, trl_grpo("grpo"), sequence_mean, policy_gradient=True),
    Card("TRL GRPO", 'loss_type "dr_grpo": sum / (rows · 15)', "none",
         llama, trl_grpo("dr_grpo"), constant_denominator, policy_gradient=True),
]  # fmt: skip


def all_cards() -> list[Card]:
    from scripts.teaching.framework_cards_two_ranks import TWO_RANK_CARDS  # it imports this module's pieces

    return sorted(CARDS + TWO_RANK_CARDS, key=lambda card: list(PACKAGES).index(card.framework))  # stable


@dataclass
class Measurement:
    framework: str
    version: str
    setting: str
    gallery_row: str
    error: float | None  # relative update error vs the float64 full batch; None when the framework is missing
    matches: float | None  # relative difference from the gallery row's weights (the token mean's for "-")
    skipped: str = ""


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure(card: Card, gradients: dict) -> Measurement:
    package = PACKAGES[card.framework]
    try:
        version = importlib.metadata.version(package.replace("_", "-"))
        importlib.import_module(package)
    except ImportError as missing:
        why = f"{package} is not installed ({missing}; pip install -r requirements-cards.txt)"
        return Measurement(card.framework, "-", card.setting, card.gallery_row, None, None, why)
    if card.build not in gradients:
        gradients[card.build] = row_gradients(card.build)
    per_row_objective = torch.tensor(ADVANTAGES if card.policy_gradient else [1.0] * len(ADVANTAGES))
    model = card.build()
    before = flat_parameters(model)
    with contextlib.redirect_stdout(io.StringIO()):  # the HF Trainer prints its run's metrics
        card.run(model)
    update = flat_parameters(model) - before
    reference = -LR * (token_mean() * per_row_objective) @ gradients[card.build]
    expected = -LR * (card.weights() * per_row_objective) @ gradients[card.build]
    error, matches = relative(update, reference), relative(update, expected)
    return Measurement(card.framework, version, card.setting, card.gallery_row, error, matches)


def shown(error: float) -> str:
    for bound in ROUNDING_BOUNDS:
        if error < bound:
            return f"< {bound:.0e}".replace("e-0", "e-")
    return f"{error:.3g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print a list of measurements as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    gradients = {}
    measurements = [measure(card, gradients) for card in all_cards()]
    if args.json:
        print(json.dumps([asdict(m) for m in measurements], indent=1))
    else:
        print("| framework | version | setting | relative update error vs float64 full batch | gallery row |")
        print("|---|---|---|---|---|")
        for m in measurements:
            error = "skipped: " + m.skipped if m.error is None else shown(m.error)
            print(f"| {m.framework} | {m.version} | {m.setting} | {error} | {m.gallery_row} |")
    mismatched = [m for m in measurements if m.matches is not None and m.matches > MATCH_RTOL]
    for m in mismatched:
        print(f"{m.framework}, {m.setting}: {m.matches:.3g} from row {m.gallery_row}'s weights", file=sys.stderr)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
