"""GRPO with a Hugging Face policy and its tokenizer (configs/grpo_hf.toml, docs/rl.md "Hugging Face policies"): the
tiny Qwen2 of data/hf_tiny_qwen2 with that folder's BPE tokenizer, which scripts/rl/make_hf_tiny_qwen2.py writes.
The text round-trips through the tokenizer; the SFT rows supervise exactly the tokens the sampler would draw (prompt
and answer tokenised apart, though the tokenizer merges across their boundary); a stop string that is no single
token, or a tokenizer larger than the model, is refused in one line; the sampler draws what one full forward per
token draws at the same uniforms; the config trains through train.py on 1 and 2 ranks and resumes bit for bit; the
equivalence checker and scripts/rl/check_objectives.py PASS on its GRPO step off-policy. Skipped without
transformers and tokenizers (requirements-hf.txt, requirements-bpe.txt; .ci/run installs both)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="not installed (pip install -r requirements-hf.txt)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -r requirements-bpe.txt)")

import train  # noqa: E402
from accumulation.batching import IGNORE_INDEX  # noqa: E402
from accumulation.config.config import load_config  # noqa: E402
from accumulation.data.rows import BYTES  # noqa: E402
from accumulation.data.tokenizer import from_tokenizer_json  # noqa: E402
from accumulation.data.uniforms import step_uniforms  # noqa: E402
from accumulation.models.factory import build_model  # noqa: E402
from accumulation.rl.rollout import SAMPLING_STREAM, Sampling, sample, stop_tokens  # noqa: E402
from accumulation.rl.task import AnswerRows, addition_problems  # noqa: E402
from tests.test_check_equivalence_grpo import run_checker  # noqa: E402
from tests.test_rl_train import TOY_ROUNDS, assert_same_run, run_in_sessions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "data" / "hf_tiny_qwen2"
HF_CONFIG = str(ROOT / "configs" / "grpo_hf.toml")
sys.path.insert(0, str(ROOT / "scripts" / "rl"))
from make_hf_tiny_qwen2 import write_folder  # noqa: E402  (a script, not a package)

# tests/test_rl_train.py's toy run on the HF policy: 9 problems (a, b < 3), one held out; 8 SFT steps, then rounds
# of 4 prompts x 4 completions = 16 trajectories in 2 optimizer steps of 8 (GRPO steps 8-13: rounds 0, 1 and 2).
PROMPTS = ["Q: 1 + 2 =", "Q: 39 + 4 =", "Q: 12 + 30 =", "Q: 0 + 0 ="]


def arguments(out_dir, *overrides) -> list[str]:
    return ["--config", HF_CONFIG, f'run.out_dir="{out_dir}"', *TOY_ROUNDS, *overrides]


def tokenizer():
    return from_tokenizer_json(FOLDER / "tokenizer.json")


def test_the_model_folder_is_the_scripts_output(tmp_path):
    """config.json and tokenizer.json are what scripts/rl/make_hf_tiny_qwen2.py writes, byte for byte, and the
    model's vocabulary is the tokenizer's."""
    vocabulary = write_folder(tmp_path)
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name
    assert json.loads((FOLDER / "config.json").read_text())["vocab_size"] == vocabulary == tokenizer().vocab_size


def test_text_round_trips_and_the_sft_rows_supervise_the_answer_tokens_the_sampler_draws():
    """Every problem of the task: prompt and answer -> ids -> the same text. The tokenizer merges " =" and " " across
    the prompt's end and the answer's start (" = "), so the whole row tokenised at once is not what the sampler writes
    after the encoded prompt; the SFT row is the prompt's tokens then the answer's, and supervises the answer's."""
    text = tokenizer()
    pairs = addition_problems(40)
    for prompt, response in pairs:
        assert text.decode(text.encode(prompt)) == prompt and text.decode(text.encode(response)) == response
    prompt, response = pairs[-1]  # "Q: 39 + 39 =", " 78\n"
    assert len(text.encode(prompt)) == 7 and len(text.encode(response)) == 4  # configs/grpo_hf.toml's seq_len 13
    apart = text.encode(prompt) + text.encode(response)
    assert text.encode(prompt + response) != apart  # the merge the rows must not follow
    rows = AnswerRows(pairs, 13, text)
    for i, (prompt, response) in enumerate(pairs):
        prompt_ids, answer_ids = text.encode(prompt), text.encode(response)
        length = len(prompt_ids) + len(answer_ids)
        assert rows.inputs[i, : length - 1].tolist() == (prompt_ids + answer_ids)[:-1]
        supervised = rows.labels[i] != IGNORE_INDEX
        assert rows.labels[i, supervised].tolist() == answer_ids
        assert supervised.nonzero().flatten().tolist() == list(range(len(prompt_ids) - 1, length - 1))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # "=" is a token of the task's tokenizer, "x" is none (it encodes to nothing): a stop token never drawn
        (['data.stop="=x"'], "data.stop: 'x' is 0 tokens under data/hf_tiny_qwen2/tokenizer.json ([]), not one"),
        # "Q: 39 + 39 =" is 7 tokens, " 78\n" 4: 7 + data.max_new_tokens (6) positions
        (["data.seq_len=12", "data.max_operand=40"], "the problems' longest prompt (7 tokens) and data.max_new_tokens"),
        (['data.tokenizer="data/no_such_tokenizer.json"'], "data.tokenizer 'data/no_such_tokenizer.json': cannot load"),
    ],
)
def test_bad_text_settings_are_refused_in_one_line(tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.chdir(ROOT)
    assert stop_tokens("\n", tokenizer()) == (tokenizer().encode("\n")[0],)
    assert train.main(arguments(tmp_path, *overrides)) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "grpo-hf").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """The folder's config.json with 16 tokens against the tokenizer's 24: the HF fork's vocabulary check; the
    project's GPT with model.vocab_size=16: the model factory's."""
    monkeypatch.chdir(ROOT)
    small = tmp_path / "small"
    small.mkdir()
    config = json.loads((FOLDER / "config.json").read_text()) | {"vocab_size": 16}
    (small / "config.json").write_text(json.dumps(config))
    shutil.copy(FOLDER / "tokenizer.json", small / "tokenizer.json")
    folder = [f'model.path="{small}"', f'data.tokenizer="{small}/tokenizer.json"']
    assert train.main(arguments(tmp_path, *folder)) == 2
    error = capsys.readouterr().err
    assert "has vocab_size 16, fewer than the data's 24 tokens" in error and error.count("\n") == 1
    gpt = ["--config", "configs/grpo.toml", f'run.out_dir="{tmp_path}"', f'data.tokenizer="{FOLDER}/tokenizer.json"']
    assert train.main([*gpt, "model.vocab_size=16"]) == 2
    error = capsys.readouterr().err
    assert "model.vocab_size: expected 0 (from the data) or an integer >= 24" in error and error.count("\n") == 1
    assert not any(tmp_path.glob("grpo*"))


@torch.no_grad()
def sampled_from_the_definition(model, text, prompts, row_ids, seed, round_index, sampling):
    """Each row alone, one forward over its whole prefix per new token: π_T = softmax(logits / T) in float64, the
    token the first whose cumulative probability exceeds the row's uniform; ends at a stop token or the budget.
    (token ids, log π_T of each) per row."""
    uniforms = step_uniforms(seed, round_index, row_ids, sampling.max_new_tokens, SAMPLING_STREAM)
    drawn = []
    for row, prompt in enumerate(prompts):
        ids, log_probs = text.encode(prompt), []
        for k in range(sampling.max_new_tokens):
            logits = model(torch.tensor([ids]))[0, -1].double()
            log_pi = torch.log_softmax(logits / sampling.temperature, dim=-1)
            cumulative = log_pi.exp().cumsum(dim=-1)
            token = min(int((cumulative <= float(uniforms[row, k])).sum()), len(cumulative) - 1)
            ids.append(token)
            log_probs.append(float(log_pi[token]))
            if token in sampling.stop:
                break
        drawn.append((ids[len(text.encode(prompt)) :], log_probs))
    return drawn


def test_the_sampler_with_the_hf_model_draws_what_one_forward_per_token_draws():
    """The HF policy under its tokenizer, rows of different prompt lengths in one right-padded batch: the same tokens
    as the definition's sampler, the same completions, log-probabilities a rounding apart."""
    config = load_config(["--config", HF_CONFIG])
    text = tokenizer()
    model = build_model(config.model, text.vocab_size, seq_len=13, seed=3).eval()
    prompts = PROMPTS * 4
    rows = torch.arange(len(prompts))
    sampling = Sampling(6, temperature=0.8, stop=stop_tokens("\n", text))
    batched = sample(model, prompts, rows, 5, 2, sampling, 13, text)
    reference = sampled_from_the_definition(model, text, prompts, rows, 5, 2, sampling)
    stopped = 0
    for i, (ids, log_probs) in enumerate(reference):
        supervised = batched.labels[i] != IGNORE_INDEX
        assert batched.labels[i, supervised].tolist() == ids
        assert batched.completions[i] == text.decode(ids)
        # float32 forwards of a batch against one row (other sums' order): about 1e-7
        torch.testing.assert_close(
            batched.old_log_probs[i, supervised].double(),
            torch.tensor(log_probs, dtype=torch.float64),
            atol=1e-5,
            rtol=0,
        )
        stopped += ids[-1] in sampling.stop
    assert 0 < stopped < len(prompts)  # some rows end at the stop token, others at the budget


class AnyCausalModel(torch.nn.Module):
    """The same HF policy behind another class: the sampler then runs a forward over each whole prefix per token."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, tokens):
        return self.policy(tokens)


@pytest.mark.parametrize("folder", ["hf_tiny_qwen2", "hf_tiny_llama"])
def test_hugging_faces_key_value_cache_draws_what_a_forward_over_the_whole_prefix_draws(folder):
    """forks/hf_causal_lm.py's key_value_decoder (the prompts left-padded into Hugging Face's cache, their padding
    masked, positions counted per row) against FullForward (right-padded rows, a forward over each whole prefix per
    token): Qwen2 under its tokenizer and Llama on bytes, prompts of different lengths, at temperature and top-p, and
    greedy."""
    config = load_config(["--config", HF_CONFIG, f"model.path=data/{folder}"])
    text = tokenizer() if folder == "hf_tiny_qwen2" else BYTES
    model = build_model(config.model, text.vocab_size, seq_len=40, seed=3).eval()
    prompts = PROMPTS * 4
    rows = torch.arange(len(prompts))
    stop = stop_tokens("\n", text)
    for sampling in (Sampling(6, 0.8, 0.9, stop), Sampling(6, stop=stop, greedy=True)):
        cached = sample(model, prompts, rows, 5, 2, sampling, 40, text)
        full = sample(AnyCausalModel(model), prompts, rows, 5, 2, sampling, 40, text)
        assert torch.equal(cached.tokens, full.tokens) and torch.equal(cached.labels, full.labels)
        # float32 sums in another order (one position at a time against the whole prefix): about 5e-7 measured
        torch.testing.assert_close(cached.old_log_probs, full.old_log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_hf_config_trains_through_train_py_and_resumes_bit_for_bit(tmp_path, monkeypatch, capsys, ranks):
    """configs/grpo_hf.toml at a toy size: 8 SFT steps then 3 rounds; stopped in round 0 (step 9) and at round 2's
    start (step 12) and resumed, it ends with the uninterrupted run's weights and metrics."""
    monkeypatch.chdir(ROOT)
    lines = run_in_sessions(tmp_path, "whole", [14], ranks, arguments_of=arguments)
    run_in_sessions(tmp_path, "sessions", [9, 12, 14], ranks, arguments_of=arguments)
    assert_same_run(tmp_path, "sessions", "whole")
    assert [line["phase"] for line in lines] == ["sft"] * 8 + ["grpo"] * 6
    assert any(line["grad_norm"] > 0 for line in lines[8:])  # some group's rewards differ
    assert 0 < lines[-1]["completion_tokens"] <= 48 * 6
    held_out = [line["held_out_reward"] for line in lines if "held_out_reward" in line]
    assert len(held_out) == 3 and all(0.0 <= value <= 1.0 for value in held_out)


# tests/test_check_equivalence_grpo.py's sizes: a step of 32 rows in micro-batches of 8; GRPO from step 8, a round of
# 4 prompts x 8 completions. With run.seed 28 the untrained HF policy's round 0 has groups with a rewarded completion.
CHECKED = ["--config", HF_CONFIG, "run.seed=28", "data.max_operand=3", "data.held_out=1", "data.sft_steps=8"]
CHECKED += ["data.prompts_per_round=4", "data.mini_batch_size=32", "batch.global_batch_size=32"]
CHECKED += ["batch.micro_batch_size=8", "run.max_steps=14"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_equivalence_checker_passes_on_a_grpo_step_of_the_hf_policy_off_policy(capsys, monkeypatch, ranks):
    """The GRPO step sampled by a policy off the checked weights (the importance ratio differs from 1 and the clip
    binds on some tokens), on one process and on 2 gloo ranks; and on one process the step-0 check (SFT)."""
    monkeypatch.chdir(ROOT)
    if ranks == 1:
        status, sft_out = run_checker(CHECKED, ranks, capsys)
        assert status == 0 and "PASS" in sft_out, sft_out
    status, out = run_checker([*CHECKED, "--step", "8"], ranks, capsys)
    assert status == 0 and "PASS" in out and "model: HFCausalLM" in out, out
    binding = [line for line in out.splitlines() if line.startswith("importance ratio:")]
    assert binding and "the clip binds on" in binding[0] and " 0 of " not in binding[0]


def test_the_objective_check_passes_on_the_hf_policy_and_a_max_for_min_surrogate_fails(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("check_objectives", ROOT / "scripts" / "rl" / "check_objectives.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    small = [*CHECKED, 'run.out_dir="/nonexistent"']  # no checkpoint: the initial weights
    assert script.main(small) == 0
    assert script.main([*small, "--inject-bug", "max-for-min"]) == 1
    out = capsys.readouterr().out
    assert "PASS seq-mean-token-mean" in out and "the loss, not accumulation" in out


def test_the_export_of_an_hf_run_names_a_tokenizer_loader_that_encodes_as_the_run(tmp_path, capsys, monkeypatch):
    """export.py's folder of a Qwen2 run: AutoTokenizer builds Qwen2Tokenizer, which puts Qwen2's pre-tokenizer in
    front of tokenizer.json's vocabulary ("Q: 3" becomes "Q", ":", "3"); the summary line must name the loader
    that gives the run's ids, and that loader must give them."""
    monkeypatch.chdir(ROOT)
    from scripts.operations import export

    assert train.main(arguments(tmp_path, "run.max_steps=1", "run.eval_every=0")) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export.main([str(tmp_path / "grpo-hf"), str(out)]) == 0
    summary = capsys.readouterr().out
    if "load PreTrainedTokenizerFast(tokenizer_file=OUT_DIR/tokenizer.json)" in summary:
        loaded = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    else:
        loaded = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for prompt in PROMPTS:
        assert loaded(prompt, add_special_tokens=False)["input_ids"] == tokenizer().encode(prompt), summary


def test_sample_py_refuses_a_prompt_whose_characters_the_tokenizer_lacks(tmp_path, capsys, monkeypatch):
    """The tiny BPE has no unknown token: "Q: 3x + 4 =" encodes as "Q: 3 + 4 =" with the x dropped, so sample.py
    would continue a prompt the user never gave; it is refused in one line naming the character, exit 2."""
    monkeypatch.chdir(ROOT)
    from scripts.operations import sample

    assert tokenizer().encode("Q: 3x + 4 =") == tokenizer().encode("Q: 3 + 4 =")  # what the refusal guards against
    assert train.main(arguments(tmp_path, "run.max_steps=1", "run.eval_every=0")) == 0
    capsys.readouterr()
    for prompt in ("Q: 3x + 4 =", "xyz"):
        assert sample.main([str(tmp_path / "grpo-hf"), "--prompt", prompt, "--tokens", "2"]) == 2
        error = capsys.readouterr().err
        assert error.startswith("error: --prompt: 'x'") and "no token" in error and error.count("\n") == 1, error
    assert sample.main([str(tmp_path / "grpo-hf"), "--prompt", "Q: 3 + 4 =", "--tokens", "2"]) == 0
