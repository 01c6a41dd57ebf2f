"""JSONL examples (prompt/response and text lines): supervision of exactly the response, the end token,
truncation, the validation split, malformed lines; and the worked SFT example, configs/sft.toml."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from accumulation.batching import IGNORE_INDEX
from accumulation.config.config import load_config
from accumulation.data import sources as data
from accumulation.data.rows import DataError, RowSet, next_token_example
from accumulation.data.splits import key_hash
from accumulation.data.step_tools import build_micro_batches
from tests.test_rows import assert_rows_match_their_raw_examples, build, supervised_targets, window_of, write

REPO = Path(__file__).resolve().parent.parent
SFT_DATA = REPO / "data" / "sft_arithmetic.jsonl"


# ---------------------------------------------------------------------------------------------------
# JSONL examples
# ---------------------------------------------------------------------------------------------------


def jsonl(path: Path, *objects) -> Path:
    """A JSONL file with one line per object; a string is written as the line itself."""
    lines = [item if isinstance(item, str) else json.dumps(item) for item in objects]
    return write(path, ("\n".join(lines) + "\n").encode())


@dataclasses.dataclass
class Encoding:
    ids: list[int]


class WordTokenizer:
    """A stand-in for a Hugging Face Tokenizer, with the three methods the data layer calls: one id per
    space-separated word, and an end-of-text token. Lets the end token's place be tested without the
    optional tokenizers package (with it installed, tests/test_prepare_data.py checks a real BPE too)."""

    END = "<|endoftext|>"

    def __init__(self, words: list[str]):
        self.ids = {word: number for number, word in enumerate([self.END, *words])}

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list["Encoding"]:
        return [Encoding([self.ids[word] for word in text.split()]) for text in texts]

    def token_to_id(self, token: str):
        return self.ids.get(token)

    def get_vocab_size(self) -> int:
        return len(self.ids)


def test_the_end_token_ends_the_response_and_is_supervised(tmp_path):
    """A model must learn to stop: the end-of-text token follows the response, as a supervised target, in every
    row; it never follows the prompt (where no row would ever supervise it)."""
    from accumulation.data.jsonl import load_jsonl

    tokenizer = WordTokenizer(["what", "is", "two", "plus", "four", "three", "one"])
    lines = [{"prompt": "what is two plus two", "response": "four"}, {"prompt": "what is one", "response": "one"}]
    built = load_jsonl(str(jsonl(tmp_path / "sft.jsonl", *lines)), seq_len=16, val_fraction=0.0, tokenizer=tokenizer)
    end = tokenizer.token_to_id(WordTokenizer.END)
    _, labels = built.train.examples(torch.arange(built.train.num_rows))
    for row in range(built.train.num_rows):
        example = built.train.raw_example(row)
        targets = [example.targets[position] for position in sorted(example.targets)]
        prompt = example.inputs[: min(example.targets) + 1]  # the tokens before the first supervised target
        assert prompt and end not in prompt and targets[-1] == end
        supervised = labels[row][labels[row] != IGNORE_INDEX].tolist()
        assert supervised == targets  # the response and its end token, nothing of the prompt


def test_jsonl_rows_supervise_exactly_the_response(tmp_path):
    examples = [
        {"prompt": "Q: 2 + 2 =", "response": " 4\n"},
        {"text": "a whole document\n"},
        {"prompt": "", "response": "no prompt at all\n"},
        {"prompt": "Q: héllo =", "response": " wörld\n"},  # multi-byte UTF-8 in both
        {"prompt": "Q: long =", "response": " a response longer than the row\n"},  # truncated
    ]
    path = jsonl(tmp_path / "sft.jsonl", examples[0], "", examples[1], "   ", *examples[2:])  # blank lines skipped
    built = build(path, seq_len=20, val_fraction=0)
    rows = built.train
    assert built.val is None
    assert rows.num_rows == len(examples)
    for row, example in enumerate(examples):
        prompt = list(example.get("prompt", "").encode())
        response = list(example.get("response", example.get("text", "")).encode())
        assert rows.raw_example(row) == next_token_example(prompt, response, seq_len=20)
    assert_rows_match_their_raw_examples(rows, list(range(rows.num_rows)))

    # Written out for the first example: "Q: 2 + 2 =" is 10 bytes, so targets 1..9 are prompt.
    (batch,) = build_micro_batches(rows, torch.tensor([0]), 1, 1, world_size=1, rank=0, step=0)
    assert batch.inputs[0].tolist() == list(b"Q: 2 + 2 = 4\n") + [0] * 7
    assert batch.labels[0].tolist() == [IGNORE_INDEX] * 9 + list(b" 4\n") + [IGNORE_INDEX] * 8
    # A {"text"} line is supervised from its second byte on, like a document.
    assert supervised_targets(rows)[3 : 3 + 16] == b" whole document\n"
    assert rows.supervised_tokens().tolist() == [3, 16, 16, 8, 12]
    assert built.summary.truncated_documents == 1


def test_jsonl_truncates_long_examples_and_drops_those_left_without_a_target(tmp_path):
    path = jsonl(
        tmp_path / "sft.jsonl",
        {"prompt": "Q:", "response": " fits\n"},  # 8 bytes: fits in a row of 9
        {"prompt": "p", "response": "r" * 40},  # truncated to 9 bytes: 8 supervised targets remain
        {"prompt": "a prompt that fills the whole row", "response": " lost\n"},  # dropped: response cut off
        {"prompt": "no response", "response": ""},  # dropped: nothing supervised
        {"text": "x"},  # dropped: one token, no target
    )
    built = build(path, seq_len=8, val_fraction=0)
    summary = built.summary
    assert (summary.documents, summary.dropped_documents, summary.truncated_documents) == (5, 3, 1)
    assert summary.train_rows == built.train.num_rows == 2
    assert built.train.tokens[1].numpy().tobytes() == b"p" + b"r" * 8
    assert built.train.supervised_tokens().tolist() == [6, 8]
    assert "5 documents (3 without a target dropped, 1 truncated to seq_len)" in summary.describe()
    assert summary.prompt_fraction == pytest.approx(1 / (2 * 8))  # the target ":" (a prompt of 1 has none)
    assert summary.vocab_size == built.vocab_size == 256


def example_texts(rows: RowSet) -> list[bytes]:
    """The tokens of every row's RawExample, in row order."""
    return [bytes(window_of(rows.raw_example(row))) for row in range(rows.num_rows)]


def test_jsonl_validation_split_is_by_line_hash_and_stable_when_lines_are_added(tmp_path):
    examples = [{"prompt": f"Q{index} =", "response": f" answer {index}\n"} for index in range(60)]
    lines = [json.dumps(example) for example in examples]
    built = build(jsonl(tmp_path / "a.jsonl", *lines), seq_len=32, val_fraction=0.2)
    texts = [(example["prompt"] + example["response"]).encode() for example in examples]
    val_texts = [text for text, line in zip(texts, lines, strict=True) if key_hash(line) < 0.2]
    assert 0 < len(val_texts) < len(lines)
    assert example_texts(built.val) == val_texts
    assert example_texts(built.train) == [text for text in texts if text not in val_texts]

    # Forty lines more: every old line stays on its side of the split.
    more = lines + [json.dumps({"text": f"a new line {index}"}) for index in range(40)]
    grown = build(jsonl(tmp_path / "b.jsonl", *more), seq_len=32, val_fraction=0.2)
    assert [text for text in example_texts(grown.val) if text in texts] == val_texts

    # Two lines, a fraction too small for either: the line with the smallest hash is the validation set.
    pair = lines[:2]
    tiny_fraction = min(key_hash(line) for line in pair) / 2
    small = build(jsonl(tmp_path / "c.jsonl", *pair), seq_len=32, val_fraction=tiny_fraction)
    assert (small.train.num_rows, small.val.num_rows) == (1, 1)


BAD_LINES = {
    "bad JSON": ('{"prompt": "Q", "response": }', r"line 3: not valid JSON \(Expecting value at column 29\)"),
    "not an object": ('["Q", "A"]', r"line 3: an array, not an object"),
    "a bare string": ('"just text"', r"line 3: a string, not an object"),
    "missing response": ('{"prompt": "Q"}', r'line 3: has the keys \["prompt"\]'),
    "misspelt key": ('{"promt": "Q", "response": "A"}', r'line 3: has the keys \["promt", "response"\]'),
    "both kinds": ('{"text": "T", "prompt": "Q", "response": "A"}', r'line 3: has both "text" and "prompt"'),
    "number prompt": ('{"prompt": 12, "response": "A"}', r"line 3: 'prompt' is a number, not a string"),
    "null response": ('{"prompt": "Q", "response": null}', r"line 3: 'response' is null, not a string"),
    "list text": ('{"text": ["T"]}', r"line 3: 'text' is an array, not a string"),
    "lone surrogate": ('{"text": "\\ud800"}', r"line 3: 'text' holds a lone surrogate escape"),
    "100,000 arrays deep": ("[" * 100_000 + "]" * 100_000, r"line 3: nested too deeply to parse"),
}


@pytest.mark.parametrize("bad_line, message", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_malformed_jsonl_line_is_an_error_naming_the_file_and_line(tmp_path, bad_line, message):
    path = jsonl(tmp_path / "sft.jsonl", {"prompt": "Q", "response": "A"}, "", bad_line, {"text": "fine"})
    with pytest.raises(DataError, match=rf"data.source '{path}', {message}") as raised:
        build(path, seq_len=8, val_fraction=0)
    assert "\n" not in str(raised.value)


def test_jsonl_files_that_cannot_be_used_are_errors(tmp_path):
    not_utf8 = write(tmp_path / "latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"'{not_utf8}', line 2: not valid UTF-8"):
        build(not_utf8, seq_len=8, val_fraction=0)
    with pytest.raises(DataError, match=r"nowhere.jsonl' does not exist or is not a file"):
        build(tmp_path / "nowhere.jsonl", seq_len=8, val_fraction=0)
    for name, content in [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("short.jsonl", b'{"text": "x"}\n')]:
        with pytest.raises(DataError, match=r"has no example with a supervised target"):
            build(write(tmp_path / name, content), seq_len=8, val_fraction=0)
    lone = jsonl(tmp_path / "lone.jsonl", {"prompt": "Q", "response": "A long enough answer"})
    with pytest.raises(DataError, match=r"validation split .* has no text to predict"):
        build(lone, seq_len=8, val_fraction=0.01)


# ---------------------------------------------------------------------------------------------------
# The worked SFT example: configs/sft.toml on data/sft_arithmetic.jsonl
# ---------------------------------------------------------------------------------------------------


def test_the_sft_data_file_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("make_sft_data", REPO / "scripts" / "operations" / "make_sft_data.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.OUTPUT == SFT_DATA
    assert SFT_DATA.read_text(encoding="utf-8") == generator.contents()
    assert SFT_DATA.stat().st_size < 200_000


def test_configs_sft_toml_builds_its_data_without_truncation(monkeypatch):
    monkeypatch.chdir(REPO)  # data.source is relative to where train.py is started
    config = load_config(["--config", "configs/sft.toml"])
    assert config.data.source == "data/sft_arithmetic.jsonl"
    built = data.build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    summary = built.summary
    assert built.vocab_size == 256
    assert (summary.documents, summary.dropped_documents, summary.truncated_documents) == (2800, 0, 0)
    assert summary.train_rows + summary.val_rows == 2800 and summary.val_rows > 0
    assert data.steps_per_epoch(built.train.num_rows, config.batch.global_batch_size, config.batch.tail) > 50
    # Supervised tokens per row differ a lot, which is when token weighting matters.
    supervised = built.train.supervised_tokens()
    assert (int(supervised.min()), int(supervised.max())) == (3, 85)
    assert summary.prompt_fraction > 0.1
    rows = list(range(0, built.train.num_rows, 97))
    assert_rows_match_their_raw_examples(built.train, rows)
    assert all(bytes(window_of(built.train.raw_example(row))).endswith(b"\n") for row in rows)
