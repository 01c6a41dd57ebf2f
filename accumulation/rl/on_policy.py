"""GRPO through train.py: a data source whose rows are the policy's own samples, and the policy loss.

    python train.py --config configs/grpo.toml
    torchrun --standalone --nproc_per_node=2 train.py --config configs/grpo.toml

`data.source = "arithmetic-rollouts"` and `model.objective = "clipped-surrogate"`, both registered here, run GRPO
on "Q: a + b =" through train.py's one loop and its one optimizer_step. With G = batch.global_batch_size (the
mini-batch of all ranks: mini · D trajectories per optimizer step), rollout = prompts_per_round × group_size and
S = rollout · ppo_epochs / G optimizer steps per round, train.py's step k is

    k < data.sft_steps      supervised fine-tuning on the training problems' reference answers (token mean)
    otherwise               j = k − sft_steps: step j mod S of GRPO round j // S

A round's first step samples the rollout from the policy as it is after the previous step's update (train.py
builds the next step's rows early, during a step, except where `sampled_at` says so), scores it, and computes
group-relative advantages. Each rank samples its share of the rollout; one all-gather, the round's exchange, gives
every rank the whole round, so each counts every step's row weights and normaliser N, in the unit of
data.loss_aggregation, on the host with no collective in the step. The round's trajectories are the source's
state: a checkpoint holds them (`state_dict`), so a run resumed in the middle of a round trains on the rollout the
uninterrupted run sampled, and every draw comes from step_uniforms(seed, round, row), so a resumed run samples what
the uninterrupted one did at every later round.

The rows: `num_rows` = G, so step k's row ids (train.py's data order) are a permutation of 0..G−1; a GRPO step's
row id i is trajectory p·G + i of its round (p: the step's place in its epoch over the rollout), an SFT step's
row id i a training problem drawn by step_uniforms(seed, k, i).
"""

import copy
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, collective_device
from accumulation.config.registry import register_data, register_loss
from accumulation.data.custom import CustomDataSummary, tensor_fingerprint
from accumulation.data.rows import BYTES, DataError, RawExample, RowHooks, RunTokenizer
from accumulation.data.splits import Data
from accumulation.data.uniforms import step_uniforms
from accumulation.rl.objectives import (
    NORMALISER_UNITS,
    PolicyLoss,
    PolicyObjective,
    aggregation,
    completion_lengths,
    group_relative_advantages,
    target_log_probs,
)
from accumulation.rl.rollout import round_prompts, sample
from accumulation.rl.settings import RolloutSettings, check_rollout_config
from accumulation.rl.task import AnswerRows, checked_reward, raw_row, read_task, reward_function, split_problems
from accumulation.step import token_cross_entropy_sum

SFT_STREAM = 13  # step_uniforms stream of the SFT steps' problem draws (rollout.py's streams are 11 and 12)


def clipped_surrogate_sum(
    outputs,
    labels,
    *,
    policy_loss: PolicyLoss | None = None,
    advantages=None,
    old_log_probs=None,
    row_weights=None,
    ref_log_probs=None,
    **extras,
) -> torch.Tensor:
    """model.objective = "clipped-surrogate": a GRPO step's rows carry advantages, old log-probabilities, row
    weights (and reference log-probabilities under a KL penalty), and get the objective Σ_i w_i Σ_t ℓ_it of
    `policy_loss`, the run's declared PolicyLoss, which Rollouts.loss_sum_fn hands in (objectives.PolicyLoss); an
    SFT step's rows and the validation rows carry none, and get the token cross-entropy sum."""
    if advantages is None:
        return token_cross_entropy_sum(outputs, labels)
    if policy_loss is None:
        raise ValueError(
            "clipped_surrogate_sum: rows with advantages need the run's policy_loss, which the rollouts hand the step "
            "(Rollouts.loss_sum_fn, called by build_training with hooks=row_hooks(rows))"
        )
    return policy_loss(
        outputs,
        labels,
        advantages=advantages,
        old_log_probs=old_log_probs,
        row_weights=row_weights,
        ref_log_probs=ref_log_probs,
        **extras,
    )


@dataclass
class Round:
    """One round's rollout, all ranks' trajectories, on every rank (host tensors [rollout, ...])."""

    index: int
    inputs: torch.Tensor  # int64 [rollout, seq_len]: prompt, completion, zeros
    labels: torch.Tensor  # int64: the completion's tokens, IGNORE_INDEX elsewhere
    old_log_probs: torch.Tensor  # float32: log π_old of each label at sampling time
    rewards: torch.Tensor  # float64 [rollout]
    advantages: torch.Tensor  # float64 [rollout]
    ref_log_probs: torch.Tensor | None = None  # float32: log π_ref of each label, under a KL penalty


class Rollouts(RowHooks):
    """The training rows of a GRPO run (the module docstring): SFT steps' answers, then each round's rollout. Rows
    sampled from the policy: it declares all six of the optional RowHooks (accumulation/data/rows.py)."""

    log_group = "rl"  # RowHooks.log_group: its step_fields in TensorBoard and the other sinks as rl/mean_reward, ...

    def __init__(
        self,
        settings: RolloutSettings,
        pairs,
        held_out,
        seq_len: int,
        seed: int,
        global_batch_size: int,
        tokenizer: RunTokenizer = BYTES,
    ):
        self.settings, self.seed, self.global_batch = settings, seed, global_batch_size
        self.prompts = [prompt for prompt, _ in pairs]
        self.reward = reward_function(settings.reward)
        self.held_out = held_out
        self.tokenizer = tokenizer  # text to token ids and back: prompts, completions, SFT answers, stop tokens
        self.drawing, self.greedy = settings.sampling(tokenizer), settings.sampling(tokenizer, greedy=True)
        self.answers = AnswerRows(pairs, seq_len, tokenizer)
        self.rollout = settings.prompts_per_round * settings.group_size
        self.steps_per_round = self.rollout * settings.ppo_epochs // global_batch_size
        self.policy, self.context, self.round = None, None, None
        self.reference = None  # the frozen reference policy of a KL penalty: the policy as round 0 samples
        self.completion_tokens = 0  # sampled in every round so far
        self.declared = settings.objective()
        self.loss = self.declared.loss_class(self.declared)  # this run's GRPO loss, handed to the step (loss_sum_fn)

    @property
    def num_rows(self) -> int:
        return self.global_batch

    @property
    def seq_len(self) -> int:
        return self.answers.seq_len

    # -------------------------------------------------------------- which round and step, and the rows
    def place(self, step: int) -> tuple[int, int] | None:
        """(round, step within the round) of a GRPO step; None for an SFT step."""
        if step < self.settings.sft_steps:
            return None
        return divmod(step - self.settings.sft_steps, self.steps_per_round)

    def sampled_at(self, step: int) -> bool:
        """Whether step `step` samples a round: its rows wait for the update of the step before."""
        place = self.place(step)
        return place is not None and place[1] == 0

    def trajectories(self, row_ids: torch.Tensor, step: int) -> tuple[Round, torch.Tensor]:
        """The round of GRPO step `step` and the trajectories its row ids stand for."""
        round_index, in_round = self.place(step)
        first = in_round % (self.rollout // self.global_batch) * self.global_batch
        return self.round_of(round_index), first + row_ids

    def sft_problems(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        draws = step_uniforms(self.seed, step, row_ids, 1, SFT_STREAM)[:, 0]
        return torch.from_numpy((draws * self.answers.num_rows).astype("int64"))

    def examples(self, row_ids: torch.Tensor, step: int):
        if self.place(step) is None:
            return self.answers.examples(self.sft_problems(row_ids, step), step)
        rollout, rows = self.trajectories(row_ids, step)
        extras = {name: value[rows] for name, value in self.read_by_the_loss(rollout).items()}
        extras["row_weights"] = self.step_aggregation(step).row_weights[rows % self.global_batch]
        return rollout.inputs[rows], rollout.labels[rows], extras

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        if self.place(step) is None:
            return self.answers.supervised_counts(self.sft_problems(row_ids, step), step)
        rollout, rows = self.trajectories(row_ids, step)
        return completion_lengths(rollout.labels[rows])

    def raw_example(self, row_id: int, step: int) -> RawExample:
        if self.place(step) is None:
            return self.answers.raw_example(int(self.sft_problems(torch.tensor([row_id]), step)[0]), step)
        rollout, rows = self.trajectories(torch.tensor([row_id]), step)
        trajectory = int(rows[0])
        example = raw_row(rollout.inputs[trajectory], rollout.labels[trajectory])
        # What the clipped surrogate reads of this trajectory, and the prompt its objective groups it by.
        example.extras = {
            name: float(value[trajectory]) if value.dim() == 1 else value[trajectory]
            for name, value in self.read_by_the_loss(rollout).items()
        }
        example.extras["group"] = trajectory // self.settings.group_size
        return example

    def read_by_the_loss(self, rollout: Round) -> dict[str, torch.Tensor]:
        """The round's per-row fields the loss declares it reads (PolicyLoss.reads), [rollout, ...] each: what
        examples() hands the loop's loss and raw_example() states for the checker, from this one declaration."""
        fields = {name: getattr(rollout, name) for name in self.loss.reads}
        return {name: value for name, value in fields.items() if value is not None}

    def objective(self, step: int) -> PolicyObjective | None:
        """The objective GRPO step `step` declares (its aggregation, C, clip, ratio level, KL and entropy terms),
        which the equivalence checker computes from its definition over the raw examples; None for an SFT step
        (the mean over targets)."""
        if self.place(step) is None:
            return None
        return self.declared

    def step_aggregation(self, step: int):
        """The row weights (over the step's G trajectories, in order) and N of a GRPO step: a function of the
        step's global rows only, which every rank holds."""
        rollout, rows = self.trajectories(torch.arange(self.global_batch), step)
        group_ids = rows // self.settings.group_size
        lengths = completion_lengths(rollout.labels[rows])
        return aggregation(self.declared.aggregation, lengths, group_ids, self.declared.constant)

    def normaliser(self, row_ids: torch.Tensor, step: int) -> tuple[float, str]:
        """N of step `step` (whose rows are `row_ids`, all ranks') and its unit: the supervised targets of an SFT
        step; the objective's normaliser of a GRPO step (sequences, groups, targets or a constant)."""
        if self.place(step) is None:
            return float(self.supervised_counts(row_ids, step).sum()), "targets"
        step_aggregation = self.step_aggregation(step)
        return step_aggregation.normaliser, step_aggregation.unit

    def loss_sum_fn(self, configured):
        """The step's loss: model.objective's (clipped_surrogate_sum) told this run's declared PolicyLoss, which
        keeps each micro-batch's sums for the step's log line (step_fields)."""
        return functools.partial(configured, policy_loss=self.loss)

    # -------------------------------------------------------------- sampling a round
    def bind_policy(self, model: torch.nn.Module, context, resume: dict | None) -> None:
        """train.py (or the checker), once the model is built: the policy the rounds sample from, the ranks, and a
        resume's round."""
        self.policy, self.context = model, context
        state = (resume or {}).get("data", {}).get("rollouts")
        if state and "reference" in state:
            self.reference = self.frozen_copy(model)
            self.reference.load_state_dict(state["reference"])
        if state and "round" in state:
            self.completion_tokens = state["completion_tokens"]
            self.round = self.scored(
                state["round"], state["inputs"], state["labels"], state["old_log_probs"], state.get("ref_log_probs")
            )
        place = self.place(resume["counters"]["steps"]) if resume is not None else None
        if place is not None and self.declared.kl_coef and self.reference is None and place != (0, 0):
            raise DataError(
                f"the checkpoint at step {resume['counters']['steps']} holds no reference policy for "
                f"data.kl_coef={self.declared.kl_coef:g}, which its weights cannot rebuild; resume from another "
                "checkpoint or start afresh"
            )
        if place is not None and place[1] > 0 and (self.round is None or self.round.index != place[0]):
            raise DataError(
                f"the checkpoint at step {resume['counters']['steps']} is in the middle of GRPO round {place[0]} but "
                f"holds no rollout of it, which its weights cannot sample again; resume from another checkpoint"
            )
        if context.is_main:
            print(
                f"grpo: rollout {self.rollout} = {self.settings.prompts_per_round} prompts x group "
                f"{self.settings.group_size} per round; mini-batch {self.global_batch} trajectories per optimizer step "
                f"(all ranks); {self.steps_per_round} optimizer steps per round after {self.settings.sft_steps} SFT "
                f"steps; objective {self.declared.describe()}, N in {NORMALISER_UNITS[self.declared.aggregation]}"
            )

    def round_of(self, round_index: int) -> Round:
        if self.round is not None and self.round.index == round_index:
            return self.round
        if self.policy is None:
            raise DataError("the GRPO rollouts are sampled from the model being trained: bind_policy() first")
        if self.declared.kl_coef and self.reference is None:  # round 0: the policy GRPO starts from, kept frozen
            self.reference = self.frozen_copy(self.policy)
            self.reference.load_state_dict(self.policy.state_dict())
        self.round = self.sample_round(round_index)
        self.completion_tokens += int(completion_lengths(self.round.labels).sum())
        return self.round

    def sample_round(self, round_index: int) -> Round:
        """Round `round_index`'s rollout from the policy as it is now: this rank's share, then the exchange."""
        settings, replicas = self.settings, self.context.replicas
        per_rank = self.rollout // replicas
        mine = torch.arange(self.context.replica * per_rank, (self.context.replica + 1) * per_rank)
        asked = round_prompts(self.seed, round_index, settings.prompts_per_round, len(self.prompts))
        prompts = [self.prompts[asked[int(j) // settings.group_size]] for j in mine]
        was_training = self.policy.training
        self.policy.eval()
        pieces = []
        for first in range(0, per_rank, settings.sample_batch_size):  # data.sample_batch_size rows per forward
            chunk = slice(first, first + settings.sample_batch_size)
            pieces.append(
                sample(
                    self.policy,
                    prompts[chunk],
                    mine[chunk],
                    self.seed,
                    round_index,
                    self.drawing,
                    self.seq_len,
                    self.tokenizer,
                )
            )
        self.policy.train(was_training)
        inputs, labels, old_log_probs = (
            all_gathered(torch.cat([getattr(piece, name) for piece in pieces]), replicas, self.context.device)
            for name in ("tokens", "labels", "old_log_probs")
        )
        ref_log_probs = None
        if self.reference is not None:  # log π_ref of the round's tokens: this rank's share, then the exchange
            mine_tokens, mine_labels = (
                torch.cat([getattr(piece, name) for piece in pieces]) for name in ("tokens", "labels")
            )
            ref_log_probs = all_gathered(
                self.reference_log_probs(mine_tokens, mine_labels), replicas, self.context.device
            )
        return self.scored(round_index, inputs, labels, old_log_probs, ref_log_probs)

    @staticmethod
    def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        """A copy of `model` that never trains: the KL penalty's reference policy."""
        reference = copy.deepcopy(model).eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference

    @torch.no_grad()
    def reference_log_probs(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """log π_ref(label), at the run's temperature, at every position of these rows (0 off the completion),
        float32, in forwards of data.sample_batch_size rows."""
        device = next(self.reference.parameters()).device
        pieces = []
        for first in range(0, tokens.shape[0], self.settings.sample_batch_size):
            chunk = slice(first, first + self.settings.sample_batch_size)
            logits = self.reference(tokens[chunk].to(device))
            pieces.append(target_log_probs(logits / self.declared.temperature, labels[chunk].to(device)).float().cpu())
        return torch.cat(pieces)

    def scored(self, round_index: int, inputs, labels, old_log_probs, ref_log_probs=None) -> Round:
        """The round with its rewards (computed from each completion, on every rank) and advantages."""
        asked = round_prompts(self.seed, round_index, self.settings.prompts_per_round, len(self.prompts))
        group_ids = torch.arange(self.rollout) // self.settings.group_size
        rewards = torch.tensor(
            [
                checked_reward(self.reward, self.prompts[asked[int(g)]], completion_text(row, self.tokenizer))
                for g, row in zip(group_ids, labels, strict=True)
            ],
            dtype=torch.float64,
        )
        advantages = group_relative_advantages(rewards, group_ids, self.settings.scale_advantages)
        return Round(round_index, inputs, labels, old_log_probs, rewards, advantages, ref_log_probs)

    # -------------------------------------------------------------- the checkpoint's part, and the logs
    def state_dict(self) -> dict:
        """What a resume cannot redraw: the round in progress, sampled from weights the checkpoint no longer
        holds, and the completion tokens sampled so far. The rewards and advantages follow from them."""
        state = {} if self.reference is None else {"reference": self.reference.state_dict()}
        if self.round is None:
            return state
        state |= {
            "round": self.round.index,
            "inputs": self.round.inputs,
            "labels": self.round.labels,
            "old_log_probs": self.round.old_log_probs,
            "completion_tokens": self.completion_tokens,
        }
        if self.round.ref_log_probs is not None:
            state["ref_log_probs"] = self.round.ref_log_probs
        return state

    def step_fields(self, step: int, eval_every: int) -> dict:
        """The metrics of the step just taken (`step` steps done), in RL's units, for its metrics.jsonl line; rank 0
        also prints a line at each round's end. The clip and KL sums travel in one all-reduce of 3 numbers."""
        fields = {"phase": "sft" if self.place(step - 1) is None else "grpo"}
        if fields["phase"] == "grpo":
            round_index, in_round = self.place(step - 1)
            *sums, tokens = all_reduced(self.loss.take_sums(), self.context.device).tolist()
            tokens = max(tokens, 1.0)
            normaliser = self.step_aggregation(step - 1)
            fields |= {
                "rounds": round_index + 1,
                "step_in_round": in_round + 1,
                "optimizer_steps_per_round": self.steps_per_round,
                "trajectories": (round_index + 1) * self.rollout,
                "completion_tokens": self.completion_tokens,
                "mean_reward": float(self.round.rewards.mean()),
                "normaliser": normaliser.normaliser,
                "normaliser_unit": normaliser.unit,
            }
            # the loss's declared per-token means (clip_fraction, approx_kl, entropy, kl_ref, and a fork's own)
            fields |= {name: total / tokens for name, total in zip(self.loss.logged, sums, strict=True)}
        if eval_every > 0 and step % eval_every == 0 and self.context.is_main:
            fields["held_out_reward"] = self.held_out_reward()
        round_ends = fields.get("step_in_round") == self.steps_per_round
        if self.context.is_main and (round_ends or "held_out_reward" in fields):
            print(round_line(step, fields), flush=True)
        return fields

    @torch.no_grad()
    def held_out_reward(self) -> float:
        """Mean reward of greedy completions of the held-out prompts: GRPO's validation."""
        was_training = self.policy.training
        self.policy.eval()
        prompts = [prompt for prompt, _ in self.held_out]
        rows = torch.arange(len(prompts))
        drawn = sample(self.policy, prompts, rows, 0, 0, self.greedy, self.seq_len, self.tokenizer)
        self.policy.train(was_training)
        rewards = [checked_reward(self.reward, p, c) for p, c in zip(prompts, drawn.completions, strict=True)]
        return sum(rewards) / len(prompts)


def round_line(step: int, fields: dict) -> str:
    """The progress line of a round's end (or of a held-out evaluation), in RL's units."""
    held_out = f" | held-out greedy reward {fields['held_out_reward']:.3f}" if "held_out_reward" in fields else ""
    if fields["phase"] == "sft":
        return f"step {step}: sft{held_out}"
    return (
        f"step {step}: round {fields['rounds']} | mean reward {fields['mean_reward']:.3f}{held_out} | "
        f"clip {fields['clip_fraction']:.3f} | kl {fields['approx_kl']:.2e} | entropy {fields['entropy']:.3f} | "
        f"{fields['optimizer_steps_per_round']} optimizer steps per round, {fields['trajectories']:,} trajectories, "
        f"{fields['completion_tokens']:,} completion tokens"
    )


def completion_text(labels: torch.Tensor, tokenizer: RunTokenizer = BYTES) -> str:
    """The completion a row of labels supervises, decoded with the run's tokenizer."""
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())


def all_gathered(tensor: torch.Tensor, replicas: int, device: torch.device) -> torch.Tensor:
    """Every rank's tensor [rows, ...], concatenated in rank order, on the host (the round's exchange)."""
    if replicas == 1:
        return tensor
    local = tensor.to(collective_device(device))
    gathered = [torch.empty_like(local) for _ in range(replicas)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered).cpu()


def all_reduced(sums: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = sums.to(collective_device(device))
        dist.all_reduce(sums)
    return sums.cpu()


# ------------------------------------------------------------------ the registered pieces
def rollout_tokenizer(data_config) -> RunTokenizer:
    """The run's tokenizer: bytes, or the tokenizer.json data.tokenizer names (a Hugging Face model's own, in its
    folder: data.tokenizer = "<model.path>/tokenizer.json"), which needs the optional `tokenizers` package."""
    if data_config.tokenizer == "bytes":
        return BYTES
    from accumulation.data.locate import expanded_paths  # a path: its leading ~ read as every reader reads it
    from accumulation.data.tokenizer import from_tokenizer_json  # the optional tokenizers package

    return from_tokenizer_json(expanded_paths(data_config).tokenizer)


def build_rollouts(data_config, *, model_vocab_size: int, seed: int) -> Data:
    settings = data_config.own
    tokenizer = rollout_tokenizer(data_config)
    if settings.prompts:
        training, held_out = read_task(settings.prompts, settings.held_out)
    else:
        training, held_out = split_problems(settings.max_operand, settings.held_out)
    unit = "tokens" if tokenizer.files else "bytes"
    owner = f"{settings.prompts}'s" if settings.prompts else "the problems'"
    longest = max(len(tokenizer.encode(prompt)) for prompt, _ in training + held_out)
    # an answer row holds prompt and response, less the last token (which no position predicts from inside the row)
    longest_answer = max(
        len(tokenizer.encode(prompt)) + len(tokenizer.encode(response)) - 1 for prompt, response in training + held_out
    )
    needed = max(longest + settings.max_new_tokens, longest_answer)
    if needed > data_config.seq_len:
        raise DataError(
            f"data.seq_len={data_config.seq_len} cannot hold {owner} longest prompt "
            f"({longest} {unit}) and data.max_new_tokens={settings.max_new_tokens}, or its longest prompt and "
            f"response ({longest_answer + 1} {unit}); set data.seq_len={needed}"
        )
    train = Rollouts(settings, training, held_out, data_config.seq_len, seed, settings.mini_batch_size, tokenizer)
    val = AnswerRows(held_out, data_config.seq_len, tokenizer)
    answer_lengths = train.answers.supervised_counts(torch.arange(train.answers.num_rows), 0).double()
    summary = CustomDataSummary(
        source=data_config.source,
        train_rows=len(training),
        val_rows=len(held_out),
        fingerprint=tensor_fingerprint(train.answers.inputs, train.answers.labels, val.inputs, str(settings)),
        min_supervised_tokens=int(answer_lengths.min()),
        median_supervised_tokens=float(answer_lengths.median()),
        max_supervised_tokens=int(answer_lengths.max()),
        targets="completion tokens",
        root=data_config.source,
        seq_len=data_config.seq_len,
        vocab_size=tokenizer.vocab_size,
        format=f"{settings.prompts or f'Q: a + b = below {settings.max_operand}'}, SFT answers then GRPO rollouts",
        val_rows_read=len(held_out),
    )
    return Data(train=train, val=val, summary=summary, vocab_size=tokenizer.vocab_size)


register_data("arithmetic-rollouts", build_rollouts, settings=RolloutSettings, check=check_rollout_config)
register_loss("clipped-surrogate", clipped_surrogate_sum)
