"""Rollouts (accumulation/rl/rollout.py): the reward is computed from the prompt, and sampling is a pure function
of (seed, round, row), so a resumed run or another rank layout draws the same completions."""

import importlib.util
from pathlib import Path

import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.rl.rollout import Sampling, round_prompts, sample
from accumulation.rl.task import answer, read_prompts, reward

PROMPTS = ["Q: 12 + 30 =", "Q: 7 * 6 =", "Q: 50 - 8 =", "Q: 365 * 5 ="]


def policy() -> torch.nn.Module:
    return GPT(GPTConfig(seq_len=32, n_layer=1, n_head=2, d_model=32, vocab_size=256), seed=5)


def test_the_reward_is_the_true_result_of_the_prompt_after_any_working():
    assert answer("Q: 885251 - 99505 =") == 785746
    assert reward("Q: 479 * 58 =", " 479 * 50 + 479 * 8 = 23950 + 3832 = 27782\n") == 1.0
    assert reward("Q: 479 * 58 =", " 27781\n") == 0.0
    assert reward("Q: 2 * 0 =", " zero\n") == 0.0


def test_the_task_file_reads():
    prompts = read_prompts("data/sft_arithmetic.jsonl")
    assert len(prompts) == 2800 and all(p.startswith("Q: ") for p in prompts)


def test_a_round_asks_the_same_prompts_whoever_asks():
    assert round_prompts(1, 3, 8, 2800) == round_prompts(1, 3, 8, 2800)
    assert round_prompts(1, 3, 8, 2800) != round_prompts(1, 4, 8, 2800)


def test_sampling_is_a_function_of_seed_round_and_row_not_of_the_batch():
    model = policy()
    rows = torch.arange(len(PROMPTS))
    together = sample(model, PROMPTS, rows, seed=1, round_index=2, sampling=Sampling(8), seq_len=32)
    again = sample(model, PROMPTS, rows, seed=1, round_index=2, sampling=Sampling(8), seq_len=32)
    assert torch.equal(together.tokens, again.tokens)  # a restart with the same weights: bit for bit
    assert torch.equal(together.old_log_probs, again.old_log_probs)
    alone = sample(model, PROMPTS[2:3], rows[2:3], seed=1, round_index=2, sampling=Sampling(8), seq_len=32)
    assert torch.equal(alone.tokens[0], together.tokens[2])  # the same row drawn on another rank, in a smaller batch
    other_round = sample(model, PROMPTS, rows, seed=1, round_index=3, sampling=Sampling(8), seq_len=32)
    assert not torch.equal(other_round.tokens, together.tokens)


def test_labels_and_old_log_probs_cover_exactly_the_completion():
    model = policy()
    drawn = sample(model, PROMPTS, torch.arange(4), seed=1, round_index=0, sampling=Sampling(6), seq_len=32)
    for i, prompt in enumerate(PROMPTS):
        supervised = torch.nonzero(drawn.labels[i] != IGNORE_INDEX).flatten()
        first = len(prompt) - 1  # the last prompt byte predicts the first completion byte
        assert supervised.tolist() == list(range(first, first + len(supervised)))
        assert torch.equal(drawn.labels[i, supervised], drawn.tokens[i, supervised + 1])
        assert drawn.completions[i] == bytes(drawn.tokens[i, supervised + 1].tolist()).decode(errors="replace")
        assert (drawn.old_log_probs[i, supervised] < 0).all()
        # the recorded log-probability is the policy's for the drawn byte (float32 rounding apart)
        logits = model(drawn.tokens[i : i + 1])[0, supervised].double()
        recomputed = torch.log_softmax(logits, -1).gather(-1, drawn.labels[i, supervised, None])[:, 0]
        assert torch.allclose(recomputed.float(), drawn.old_log_probs[i, supervised], atol=1e-5)


class AnyCausalModel(torch.nn.Module):
    """The same GPT behind another class: the sampler then runs a forward over each whole prefix per token."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens):
        return self.gpt(tokens)


def test_the_key_value_cache_draws_what_a_forward_over_the_whole_prefix_draws():
    model = policy()
    rows = torch.arange(len(PROMPTS))
    for sampling in (Sampling(8), Sampling(8, temperature=0.7, top_p=0.9, stop=(ord("\n"), ord(" ")))):
        cached = sample(model, PROMPTS, rows, seed=1, round_index=2, sampling=sampling, seq_len=32)
        full = sample(AnyCausalModel(model), PROMPTS, rows, seed=1, round_index=2, sampling=sampling, seq_len=32)
        assert torch.equal(cached.tokens, full.tokens) and torch.equal(cached.labels, full.labels)
        # float32 sums in another order (one position at a time against the whole prefix): about 1e-7
        torch.testing.assert_close(cached.old_log_probs, full.old_log_probs, rtol=0, atol=1e-5)


def test_temperature_top_p_and_stop_tokens():
    model = policy()
    rows = torch.arange(len(PROMPTS))
    greedy = sample(model, PROMPTS, rows, 1, 0, Sampling(6, greedy=True), 32)
    nucleus = sample(model, PROMPTS, rows, 1, 0, Sampling(6, top_p=1e-9), 32)
    assert torch.equal(nucleus.tokens, greedy.tokens)  # a nucleus of one token is the most likely one
    hot = sample(model, PROMPTS, rows, 1, 0, Sampling(6, temperature=2.0), 32)
    for i in range(len(PROMPTS)):
        supervised = hot.labels[i] != IGNORE_INDEX
        logits = model(hot.tokens[i : i + 1])[0, supervised].double() / 2.0
        recomputed = torch.log_softmax(logits, -1).gather(-1, hot.labels[i, supervised, None])[:, 0]
        assert torch.allclose(recomputed.float(), hot.old_log_probs[i, supervised], atol=1e-5)  # log π_T recorded
    first_bytes = set(int(hot.labels[i][hot.labels[i] != IGNORE_INDEX][0]) for i in range(len(PROMPTS)))
    stopped = sample(model, PROMPTS, rows, 1, 0, Sampling(6, temperature=2.0, stop=tuple(first_bytes)), 32)
    assert ((stopped.labels != IGNORE_INDEX).sum(dim=1) == 1).all()  # each ends at its first token, a stop token


def test_the_sampler_benchmark_runs_and_prints_its_ratios(capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    spec = importlib.util.spec_from_file_location("bench_sampler", "scripts/rl/bench_sampler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    toy = ["data.max_operand=3", "data.held_out=1", "data.prompts_per_round=4", "data.group_size=4"]
    sizes = ["data.mini_batch_size=8", "batch.global_batch_size=8", "batch.micro_batch_size=4"]
    assert bench.main(["--config", "configs/grpo.toml", *toy, *sizes, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "the round's 2 optimizer steps (G 8, m 4)" in out and "sampling / optimizer steps: " in out
    # without a GRPO config there is no round to sample: one line and exit 2, not a traceback
    assert bench.main([]) == 2
    assert capsys.readouterr().err == (
        "error: data.source must be \"arithmetic-rollouts\" (GRPO), got 'stdlib'; e.g. --config configs/grpo.toml\n"
    )
