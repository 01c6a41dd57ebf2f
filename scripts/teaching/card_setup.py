"""What every framework card shares (scripts/teaching/framework_cards.py, framework_cards_two_ranks.py): the 8
rows of one step and their micro-batches, the tiny models built from local configs, the float64 gradient of each
row's own loss sum, and the row weights of the reference token mean and of each gallery row's normalisation."""

from collections.abc import Callable

import torch

VOCAB_SIZE = 64
ROW_TOKENS = 16  # tokens per row; the model predicts tokens 1..15 from those before them
# Supervised targets per row. Rows 0 and 1 are fully supervised, with labels = input_ids (as Hugging Face's
# DataCollatorForLanguageModeling and torchtune's text-completion datasets make them, position 0 included);
# the others supervise only a suffix (an answer after a masked prompt). Micro-batches of 2 rows: 30, 3, 21, 7.
SUPERVISED_TARGETS = (15, 15, 2, 1, 12, 9, 4, 3)
MICRO_BATCH_SIZE = 2  # m
ACCUMULATION_STEPS = 4  # A; one process, so the step's 8 rows are m · A
LR = 1.0  # plain SGD: the update is -LR times the gradient the framework leaves in .grad
IGNORE_INDEX = -100
MODEL_SEED = 7
ADVANTAGES = (1.0, -0.5, 2.0, -1.5, 0.5, -2.0, 1.5, -1.0)  # GRPO's per-row advantages, fixed here
# TRL's card with steps_per_generation = 2A: the completion tokens of the generation batch's second step, against
# this step's 61. Unequal on purpose: TRL 1.16.0's "dapo" is exact only when the steps hold equal tokens.
OTHER_STEP_TARGETS = 39


# ---------------------------------------------------------------------------------------------------------
# The rows, the models and the reference.
# ---------------------------------------------------------------------------------------------------------


def step_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [8, 16] and labels in Hugging Face's convention: unshifted, -100 where nothing is learned."""
    input_ids = torch.randint(
        0, VOCAB_SIZE, (len(SUPERVISED_TARGETS), ROW_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for row, targets in enumerate(SUPERVISED_TARGETS):
        first = 0 if targets == ROW_TOKENS - 1 else ROW_TOKENS - targets
        labels[row, first:] = input_ids[row, first:]
    return input_ids, labels


def micro_batches() -> list[dict[str, torch.Tensor]]:
    input_ids, labels = step_rows()
    return [
        {"input_ids": input_ids[k : k + MICRO_BATCH_SIZE], "labels": labels[k : k + MICRO_BATCH_SIZE]}
        for k in range(0, len(input_ids), MICRO_BATCH_SIZE)
    ]


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of position t is the label of position t + 1: position 0's label is never predicted."""
    return labels[:, 1:]


def targets_per_micro_batch() -> list[int]:
    return [int((shifted_targets(mb["labels"]) != IGNORE_INDEX).sum()) for mb in micro_batches()]


def seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        return build().double()


def llama() -> torch.nn.Module:
    """A one-layer LlamaForCausalLM from a local config. Its loss_type, "ForCausalLM", comes from its class name."""
    import transformers

    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=32, tie_word_embeddings=False, **sizes
    )
    return seeded(lambda: transformers.LlamaForCausalLM(config))


def gpt2(head: str) -> Callable[[], torch.nn.Module]:
    """A one-layer GPT-2 with the named head, from a local config, dropout off (the Trainer trains in train mode)."""

    def build() -> torch.nn.Module:
        import transformers

        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=32, n_embd=16, n_layer=1, n_head=2, **no_dropout
        )
        return seeded(lambda: getattr(transformers, head)(config))

    return build


def cross_entropy_sums(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's loss sum S_r = sum over its supervised targets of -log p(target | the tokens before it)."""
    log_probs = model(input_ids=input_ids).logits[:, :-1].log_softmax(-1)
    targets = shifted_targets(labels)
    supervised = targets != IGNORE_INDEX
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * supervised).sum(-1)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def row_gradients(build: Callable[[], torch.nn.Module]) -> torch.Tensor:
    """[rows, parameters]: the float64 gradient of each row's own loss sum (rows do not attend to each other)."""
    model = build()
    input_ids, labels = step_rows()
    gradients = []
    for row in range(len(input_ids)):
        model.zero_grad(set_to_none=True)
        cross_entropy_sums(model, input_ids[row : row + 1], labels[row : row + 1]).sum().backward()
        gradients.append(
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])
        )
    return torch.stack(gradients)


# ---------------------------------------------------------------------------------------------------------
# Row weights: the reference, and what each gallery row does instead (micro-batch k holds n_k targets).
# ---------------------------------------------------------------------------------------------------------


def per_row(weight_of_micro_batch: list[float]) -> torch.Tensor:
    return torch.tensor(weight_of_micro_batch, dtype=torch.float64).repeat_interleave(MICRO_BATCH_SIZE)


def token_mean() -> torch.Tensor:
    """The reference: every supervised target of the step weighs 1/N."""
    return per_row([1 / sum(targets_per_micro_batch())] * ACCUMULATION_STEPS)


def mean_of_means() -> torch.Tensor:
    """Gallery row 1: each micro-batch's mean, divided by A."""
    return per_row([1 / (ACCUMULATION_STEPS * n) for n in targets_per_micro_batch()])


def means_summed() -> torch.Tensor:
    """Gallery row 21: each micro-batch's mean, not divided by A."""
    return per_row([1 / n for n in targets_per_micro_batch()])


def divided_twice() -> torch.Tensor:
    """Gallery row 3: the sum over N, divided by A again."""
    return per_row([1 / (ACCUMULATION_STEPS * sum(targets_per_micro_batch()))] * ACCUMULATION_STEPS)


def supervised_labels_per_micro_batch() -> list[int]:
    """Supervised labels before the shift: n_k plus the micro-batch's rows whose position-0 label is supervised."""
    return [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches()]


def sum_over_unshifted_count() -> torch.Tensor:
    """Gallery row 11, as the Trainer has it: each micro-batch's sum over the step's labels counted before the
    shift, N + B, where B counts the rows whose position-0 label (never a target) is supervised."""
    return per_row([1 / sum(supervised_labels_per_micro_batch())] * ACCUMULATION_STEPS)


def unshifted_count() -> torch.Tensor:
    """Gallery row 11, as torchtune's recipe has it: each micro-batch's mean times its count of supervised labels
    before the shift (n_k + b_k, b_k its rows whose position-0 label is supervised), over the sum of those counts."""
    counted = supervised_labels_per_micro_batch()
    return per_row([c / (n * sum(counted)) for c, n in zip(counted, targets_per_micro_batch(), strict=True)])


def sequence_mean() -> torch.Tensor:
    """GRPO's loss_type="grpo": each row's mean over its own tokens, averaged over rows (not a token mean)."""
    rows = len(SUPERVISED_TARGETS)
    return torch.tensor([1 / (rows * n) for n in SUPERVISED_TARGETS], dtype=torch.float64)


def constant_denominator() -> torch.Tensor:
    """GRPO's loss_type="dr_grpo": every row's sum over rows · max_completion_length, whatever N is."""
    return torch.full((len(SUPERVISED_TARGETS),), 1 / (len(SUPERVISED_TARGETS) * (ROW_TOKENS - 1)), dtype=torch.float64)


def over_mean_step() -> torch.Tensor:
    """TRL 1.16.0's "dapo" with steps_per_generation = 2A: num_items_in_batch counts the generation batch's T_gen
    completion tokens (both steps), and since PR #6024 each micro-batch's sum is divided by T_gen · A /
    steps_per_generation = T_gen / 2, the mean step's tokens: the step's update is its token mean times T_step /
    (T_gen / 2), exact only when the two steps hold equal tokens."""
    generation_tokens = sum(targets_per_micro_batch()) + OTHER_STEP_TARGETS
    return per_row([2 / generation_tokens] * ACCUMULATION_STEPS)
