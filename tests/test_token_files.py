"""Token files (nanoGPT's train.bin/val.bin, llm.c shards): rows, vocabulary, bad input, and the real entry
point on 1 and 2 ranks, with split equivalence against the float64 reference and exact resume."""

import json
import pickle
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from accumulation import checker as check_equivalence
from accumulation.config.config import load_config
from accumulation.data import sources as data
from accumulation.data import token_files
from accumulation.data.rows import DataError
from accumulation.data.sources import build_data, step_row_ids
from accumulation.data.splits import Data
from accumulation.data.step_tools import build_micro_batches
from accumulation.models.factory import build_model
from accumulation.run.sample import run_tokenizer
from testkit.disk import read_only_view
from testkit.reference import float64_reference_gradient
from tests.test_jsonl import jsonl
from tests.test_rows import assert_rows_match_their_raw_examples, window_of
from tests.test_train import (
    LAUNCHES,
    ONE_PLAIN_SGD_STEP,
    comparable,
    final_weights,
    read_metrics,
    tiny_settings,
    train_as,
    train_forked,
)

VOCAB = 64  # the vocabulary of the generated token files


def tokens_of(length: int, seed: int, vocab_size: int = VOCAB) -> np.ndarray:
    """Token ids with some structure to learn: runs of counting up, from random starts."""
    generator = np.random.default_rng(seed)
    starts = generator.integers(0, vocab_size, length // 8 + 1)
    return ((starts[:, None] + np.arange(8)) % vocab_size).reshape(-1)[:length]


def llmc_bytes(tokens: np.ndarray, version: int = 1, magic: int = 20240520, count: int | None = None) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    return header.tobytes() + tokens.astype("<u2" if version == 1 else "<u4").tobytes()


def write_meta(folder: Path, vocab_size: int) -> None:
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab_size, "tokenizer": "bytes"}))


def nanogpt_folder(folder: Path, train_tokens=3000, val_tokens=400, meta=True) -> Path:
    folder.mkdir(parents=True)
    (folder / "train.bin").write_bytes(tokens_of(train_tokens, 1).astype("<u2").tobytes())
    (folder / "val.bin").write_bytes(tokens_of(val_tokens, 2).astype("<u2").tobytes())
    if meta:
        write_meta(folder, VOCAB)
    return folder


def llmc_folder(folder: Path, shard_tokens=(1200, 900, 700), val_tokens=400, version=1, vocab=VOCAB) -> Path:
    folder.mkdir(parents=True)
    for index, length in enumerate(shard_tokens):
        (folder / f"corpus_train_{index:06d}.bin").write_bytes(
            llmc_bytes(tokens_of(length, 10 + index, vocab), version)
        )
    (folder / "corpus_val_000000.bin").write_bytes(llmc_bytes(tokens_of(val_tokens, 2, vocab), version))
    write_meta(folder, vocab)
    return folder


def build(source, *settings) -> Data:
    config = load_config([f"data.source={source}", "data.seq_len=16", *settings])
    return build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)


# ---------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------


def test_nanogpt_rows_are_overlapping_windows_of_train_bin_every_target_supervised(tmp_path):
    folder = nanogpt_folder(tmp_path / "shakespeare")
    built = build(folder)
    train_tokens = tokens_of(3000, 1)
    assert built.train.num_rows == (3000 - 1) // 16  # a file of T tokens has T - 1 targets: full rows only
    assert built.val.num_rows == (400 - 1) // 16
    inputs, labels = built.train.examples(torch.tensor([0, 5, 186]))
    for row, row_id in enumerate([0, 5, 186]):
        window = train_tokens[row_id * 16 : row_id * 16 + 17]
        assert inputs[row].tolist() == window[:-1].tolist() and labels[row].tolist() == window[1:].tolist()
    assert built.train.supervised_counts(torch.tensor([3, 4])).tolist() == [16, 16]
    assert_rows_match_their_raw_examples(built.train, [0, 1, 100, 186])
    summary = built.summary
    assert (summary.layout, summary.vocab_size, summary.vocab_from, summary.padding_fraction) == (
        "packed",
        VOCAB,
        "meta.json",
        0.0,
    )
    assert summary.tokens == 3400 and summary.files == 2 and "nanoGPT token files" in summary.describe()


@pytest.mark.parametrize("version", [1, 2])
def test_llmc_shards_give_the_rows_of_each_shard_and_none_across_shards(tmp_path, version):
    vocab = VOCAB if version == 1 else 70_000  # version 2 holds uint32 ids, beyond uint16
    built = build(llmc_folder(tmp_path / "shards", version=version, vocab=vocab))
    rows_per_shard = [(length - 1) // 16 for length in (1200, 900, 700)]
    assert built.train.num_rows == sum(rows_per_shard)
    row_id = 0
    for index, length in enumerate((1200, 900, 700)):
        shard = tokens_of(length, 10 + index, vocab)
        for row_in_shard in (0, rows_per_shard[index] - 1):
            assert window_of(built.train.raw_example(row_id + row_in_shard)) == shard[row_in_shard * 16 :][:17].tolist()
        row_id += rows_per_shard[index]
    assert built.vocab_size == vocab
    # A glob names the same shards; a text file whose name looks like a glob is still text.
    assert build(str(tmp_path / "shards" / "corpus_*.bin")).summary.fingerprint == built.summary.fingerprint
    (tmp_path / "notes [draft].txt").write_text("some text\n" * 10)
    assert build(str(tmp_path / "notes [draft].txt"), "data.val_fraction=0").summary.format == "text"
    with pytest.raises(DataError, match="the glob matches no file"):
        build(str(tmp_path / "shards" / "other_*.bin"))


def test_a_packed_text_layout_joins_documents_into_full_rows(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    documents = [b"first document\n", b"a second, longer document of text\n", b"x", b"third\n"]
    for index, document in enumerate(documents):
        (folder / f"{index}.txt").write_bytes(document)
    built = build(folder, "data.layout=packed", "data.val_fraction=0")
    joined = b"".join(documents)  # bytes have no separator token: joined as they are
    assert built.train.num_rows == (len(joined) - 1) // 16
    assert built.summary.padding_fraction == 0 and built.summary.layout == "packed"
    inputs, labels = built.train.examples(torch.arange(built.train.num_rows))
    assert bytes(labels.reshape(-1).tolist()) == joined[1 : 1 + 16 * built.train.num_rows]
    assert_rows_match_their_raw_examples(built.train, list(range(built.train.num_rows)))


# ---------------------------------------------------------------------------------------------------
# The vocabulary
# ---------------------------------------------------------------------------------------------------


def test_the_vocabulary_comes_from_meta_json_meta_pkl_or_model_vocab_size(tmp_path):
    folder = nanogpt_folder(tmp_path / "n", meta=False)
    with pytest.raises(DataError, match=r"say nothing of their vocabulary; set model\.vocab_size"):
        build(folder)
    assert build(folder, "model.vocab_size=100").vocab_size == 100
    # nanoGPT's own meta.pkl: plain containers, read without running any code.
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": {0: "a"}, "stoi": {"a": 0}}))
    built = build(folder)
    assert (built.vocab_size, built.summary.vocab_from) == (65, "meta.pkl")
    # A pickle that reaches for any class (here an OrderedDict; a hostile one would name os.system) is refused.
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "stoi": OrderedDict(a=0)}))
    with pytest.raises(DataError, match="refused to load collections.OrderedDict"):
        build(folder)


def test_a_token_id_outside_the_vocabulary_is_an_error_naming_the_file(tmp_path):
    folder = nanogpt_folder(tmp_path / "n")
    tokens = tokens_of(3000, 1)
    tokens[5] = VOCAB  # inside the first sampled block: found at start-up
    (folder / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    message = rf"train.bin: token 5 has id {VOCAB}, not below the vocabulary size {VOCAB} from meta.json"
    with pytest.raises(DataError, match=message):
        build(folder)
    # Outside the sampled blocks (a file longer than they reach): found when the row is read, before any forward.
    long_tokens = tokens_of(100_000, 1)
    long_tokens[50_001] = 1000
    (folder / "train.bin").write_bytes(long_tokens.astype("<u2").tobytes())
    built = build(folder)
    with pytest.raises(DataError, match=r"train.bin: token 50,001 has id 1000"):
        built.train.examples(torch.tensor([0, 50_001 // 16]))


def test_the_vocabulary_error_names_the_setting_that_governs_and_its_advice_works(tmp_path):
    """With meta.json beside the files, its vocab_size is what the ids are checked against: the advice to set
    model.vocab_size (given before) changed nothing. Without meta.json, model.vocab_size governs."""
    folder = nanogpt_folder(tmp_path / "n")  # meta.json: 64
    tokens = tokens_of(3000, 1)
    tokens[5] = 70
    (folder / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    with pytest.raises(DataError, match="meta.json governs this check, not model.vocab_size") as refused:
        build(folder, "model.vocab_size=100")
    assert str(folder / "meta.json") in str(refused.value)
    write_meta(folder, 71)  # what the message says to do
    assert build(folder, "model.vocab_size=100").vocab_size == 71
    (folder / "meta.json").unlink()
    with pytest.raises(DataError, match=r"set model\.vocab_size to the tokenizer's vocabulary size \(more than 70\)"):
        build(folder, "model.vocab_size=64")
    assert build(folder, "model.vocab_size=71").vocab_size == 71


@pytest.mark.parametrize("token_format", ["nanoGPT", "llm.c"])
def test_ids_of_a_gpt2_sized_vocabulary_read_back_unsigned(tmp_path, token_format):
    """Both formats store uint16 for a GPT-2-sized vocabulary (50,257): about a third of the ids are 32,768
    or more, which a signed 16-bit read turns negative (and the embedding then fails with a traceback)."""
    vocab = 50_257
    tokens = tokens_of(3000, 1, vocab)
    assert (tokens >= 2**15).sum() > 500
    folder = tmp_path / "gpt2"
    folder.mkdir()
    if token_format == "nanoGPT":
        (folder / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    else:
        (folder / "corpus_train_000000.bin").write_bytes(llmc_bytes(tokens))
    write_meta(folder, vocab)
    built = build(folder, "data.val_fraction=0")
    inputs, labels = built.train.examples(torch.arange(built.train.num_rows))
    rows = built.train.num_rows
    assert torch.equal(inputs, torch.from_numpy(tokens[: rows * 16].reshape(rows, 16).astype(np.int64)))
    assert torch.equal(labels[:, -1], torch.from_numpy(tokens[16 : rows * 16 + 1 : 16].astype(np.int64)))


def test_token_files_on_a_read_only_mount_are_read(tmp_path):
    """The user's token files are only ever read: on a read-only mount (a shared dataset volume) opening them
    for writing fails with EROFS, for root too, where a writable memory map died with a 23-line traceback."""
    folder = nanogpt_folder(tmp_path / "n")
    with read_only_view(folder, tmp_path / "read-only") as read_only:
        built = build(read_only)
        inputs, _ = built.train.examples(torch.tensor([3]))
        assert inputs[0].tolist() == tokens_of(3000, 1)[48:64].tolist()


def edit_between_the_sampled_blocks(train_bin: Path) -> None:
    """Tokens 10,000-29,999 of a 100,000-token train.bin rewritten in place, the length unchanged: between the
    fingerprint's sampled blocks (at 0, 31,968, 63,936 and 95,904, 4,096 tokens each)."""
    with open(train_bin, "r+b") as file:
        file.seek(2 * 10_000)
        file.write(tokens_of(20_000, 99).astype("<u2").tobytes())


def test_a_resume_over_a_token_file_edited_in_place_is_refused_and_a_plain_copy_resumes(tmp_path, capsys):
    """Data small enough to hash whole (the default up to 1 GiB): the whole file's hash decides. An edit the
    sampled blocks miss is refused naming the file and the hash; the old tokens written back (what a copy
    without -p leaves: other modification time, same bytes) resume, with no command to run. The refusal never
    suggests touching the file's time: that advice once let a run resume over edited data."""
    folder = nanogpt_folder(tmp_path / "n", train_tokens=100_000)
    train_bin = folder / "train.bin"
    original = train_bin.read_bytes()
    arguments = tiny_token_run(tmp_path, folder, **{"run.max_steps": 2, "run.sample_bytes": 0})
    assert train.main(arguments) == 0
    fingerprint = build(folder).summary.fingerprint
    edit_between_the_sampled_blocks(train_bin)
    assert build(folder).summary.fingerprint == fingerprint  # the sampled blocks alone miss this edit
    capsys.readouterr()
    assert train.main(arguments + ["run.max_steps=3"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"error: {train_bin} was edited since checkpoint" in error, error
    assert "the whole file's hash" in error and "another run.name" in error and "touch" not in error

    train_bin.write_bytes(original)  # the same tokens again; a new modification time, as after a plain cp
    assert train.main(arguments + ["run.max_steps=3"]) == 0
    assert "resuming from" in capsys.readouterr().out


def test_a_resume_over_large_token_data_with_a_new_modification_time_is_refused(tmp_path, capsys, monkeypatch):
    """Data too large to hash whole at every start (here: the limit lowered to 0 bytes) has only its size,
    sampled blocks and modification time. An edit between the sampled blocks changes the time alone; it is
    refused with what is known (the time changed, the tokens between the blocks cannot be checked), and so is
    the same file with its old bytes written back: the program cannot tell the two apart, so it never resumes
    on the user's word, and never suggests setting the time back (touch), which would resume over the edit."""
    monkeypatch.setattr(token_files, "WHOLE_FILE_HASH_MAX_BYTES", 0)
    folder = nanogpt_folder(tmp_path / "n", train_tokens=100_000)
    train_bin = folder / "train.bin"
    original = train_bin.read_bytes()
    arguments = tiny_token_run(tmp_path, folder, **{"run.max_steps": 2, "run.sample_bytes": 0})
    assert train.main(arguments) == 0
    edit_between_the_sampled_blocks(train_bin)
    capsys.readouterr()
    for _ in ("edited", "written back"):
        assert train.main(arguments + ["run.max_steps=3"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"error: {train_bin} was written since checkpoint" in error, error
        assert "modified (ns)" in error and "cannot be checked" in error and "another run.name" in error
        assert "touch" not in error and "cp -p" in error
        train_bin.write_bytes(original)


def test_the_same_token_files_by_another_path_spelling_or_moved_resume(tmp_path, capsys):
    """data.source is compared by what it holds (fingerprint and file stamps), not by how it is spelled: the
    folder given as dir/./n, then moved (mv keeps modification times) and given by its new path, resumes
    with the bits of the uninterrupted run. Other data under the old name is still refused."""
    folder = nanogpt_folder(tmp_path / "n")
    settings = {"run.max_steps": 2, "run.sample_bytes": 0, "schedule.decay_updates": 4}
    arguments = tiny_token_run(tmp_path, folder, **settings)
    assert train.main(arguments) == 0
    capsys.readouterr()
    respelled = f"{tmp_path}/./n"
    assert train.main(arguments + [f"data.source={respelled}", "run.max_steps=3"]) == 0, capsys.readouterr().err
    moved = tmp_path / "moved"
    folder.rename(moved)
    assert train.main(arguments + [f"data.source={moved}", "run.max_steps=4"]) == 0, capsys.readouterr().err
    assert "resuming from" in capsys.readouterr().out

    reference = tmp_path / "reference"
    assert train.main(tiny_token_run(reference, moved, **{**settings, "run.max_steps": 4})) == 0
    run_dir, reference_dir = tmp_path / "runs" / "default", reference / "runs" / "default"
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(reference_dir))
    weights, reference_weights = final_weights(run_dir), final_weights(reference_dir)
    assert all(torch.equal(weights[name], reference_weights[name]) for name in reference_weights)

    other = nanogpt_folder(tmp_path / "other", train_tokens=3002)
    capsys.readouterr()
    assert train.main(arguments + [f"data.source={other}", "run.max_steps=5"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"training data (data.source '{moved}' -> '{other}', fingerprint" in error


def test_a_bad_token_id_found_mid_run_is_one_line_and_exit_2(tmp_path, capsys):
    """A token id that the sampled blocks at start-up miss is found when its row is first read, before the
    forward that would index the embedding with it: one line naming the file, exit 2, as for bad input."""
    folder = nanogpt_folder(tmp_path / "n")
    tokens = tokens_of(100_000, 1)
    # Between the four sampled blocks (at 0, 31,968, 63,936 and 95,904, 4,096 tokens each): most rows are bad,
    # so the first step reads one.
    tokens[4_100:31_900] = VOCAB
    tokens[36_100:63_900] = VOCAB
    (folder / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    assert train.main(tiny_token_run(tmp_path, folder)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "train.bin: token" in lines[0] and f"has id {VOCAB}" in lines[0], lines


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


def shard_folder_with(tmp_path: Path, shard: bytes) -> Path:
    folder = llmc_folder(tmp_path / "shards")
    (folder / "corpus_train_000001.bin").write_bytes(shard)
    return folder


BAD_SHARDS = [
    (llmc_bytes(tokens_of(100, 0), magic=12345), "corpus_train_000001.bin: header magic 12345, expected 20240520"),
    (llmc_bytes(tokens_of(100, 0), version=3), "corpus_train_000001.bin: header version 3, expected 1"),
    (llmc_bytes(tokens_of(100, 0))[:-10], "corpus_train_000001.bin: truncated: the header announces 100 tokens"),
    (llmc_bytes(tokens_of(100, 0), count=50), "corpus_train_000001.bin: longer than its header says"),
    (b"\x00" * 100, "corpus_train_000001.bin: 100 bytes, shorter than the 1024-byte header"),
]


@pytest.mark.parametrize("shard, message", BAD_SHARDS)
def test_a_bad_llmc_shard_is_named_with_what_is_wrong(tmp_path, shard, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        build(shard_folder_with(tmp_path, shard))


def test_bad_nanogpt_files_and_empty_splits_are_errors(tmp_path):
    folder = nanogpt_folder(tmp_path / "n")
    (folder / "val.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"val.bin: 3 bytes, an odd count, but a nanoGPT file is uint16"):
        build(folder)
    (folder / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"val.bin: empty"):
        build(folder)
    assert build(folder, "data.val_fraction=0").val is None  # as the message advises: val.bin is left alone
    (folder / "val.bin").unlink()
    with pytest.raises(DataError, match=r"validation split \(val.bin\) is missing.*data.val_fraction=0"):
        build(folder)
    assert build(folder, "data.val_fraction=0").val is None
    with pytest.raises(DataError, match=r"training split \(train.bin\) has fewer than seq_len \+ 1 = 4097"):
        build(folder, "data.val_fraction=0", "data.seq_len=4096")


def test_a_layout_the_source_cannot_do_is_an_error(tmp_path):
    with pytest.raises(DataError, match=r'data.layout="documents": .* holds nanoGPT token files'):
        build(nanogpt_folder(tmp_path / "n"), "data.layout=documents")
    examples = jsonl(tmp_path / "sft.jsonl", {"prompt": "a", "response": "b"})
    with pytest.raises(DataError, match=r'data.layout="packed": .* is a JSONL file of examples'):
        build(examples, "data.layout=packed")


def bad_sources(tmp_path: Path) -> list[tuple[list[str], str]]:
    odd = nanogpt_folder(tmp_path / "odd")
    (odd / "train.bin").write_bytes(b"\x00" * 1001)
    out_of_range = nanogpt_folder(tmp_path / "range", meta=False)
    return [
        ([f"data.source={shard_folder_with(tmp_path, BAD_SHARDS[0][0])}"], "header magic 12345"),
        ([f"data.source={odd}"], "an odd count"),
        ([f"data.source={out_of_range}", "model.vocab_size=10"], "not below the vocabulary size 10"),
        ([f"data.source={out_of_range}"], "model.vocab_size"),
        ([f"data.source={jsonl(tmp_path / 'bad.jsonl', {'question': 'a'})}"], "bad.jsonl', line 1: has the keys"),
        ([f"data.source={odd.parent / 'range'}", "data.layout=documents", "model.vocab_size=64"], "data.layout"),
    ]


def test_bad_token_files_through_the_entry_point_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    for arguments, named in bad_sources(tmp_path):
        out_dir = tmp_path / "runs"
        status = train.main([*arguments, f"run.out_dir={out_dir}"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2, arguments
        assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], (arguments, lines)
        assert not out_dir.exists()


# ---------------------------------------------------------------------------------------------------
# Fingerprint and validation subset
# ---------------------------------------------------------------------------------------------------


def test_the_fingerprint_reads_headers_sizes_and_sampled_blocks_only(tmp_path):
    folder = nanogpt_folder(tmp_path / "a", train_tokens=60_000)
    fingerprint = build(folder).summary.fingerprint
    folder.rename(tmp_path / "b")  # where the files live is not what they are
    assert build(tmp_path / "b").summary.fingerprint == fingerprint
    assert build(tmp_path / "b", "data.seq_len=8").summary.fingerprint != fingerprint
    tokens = tokens_of(60_000, 1)
    tokens[0] = (tokens[0] + 1) % VOCAB  # in the first sampled block
    (tmp_path / "b" / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    assert build(tmp_path / "b").summary.fingerprint != fingerprint
    # The price of not reading every token: a change between the sampled blocks is not seen.
    tokens = tokens_of(60_000, 1)
    tokens[10_000] = (tokens[10_000] + 1) % VOCAB
    (tmp_path / "b" / "train.bin").write_bytes(tokens.astype("<u2").tobytes())
    assert build(tmp_path / "b").summary.fingerprint == fingerprint


def test_validation_reads_a_fixed_evenly_spaced_subset_the_same_for_every_m_and_d(tmp_path):
    built = build(nanogpt_folder(tmp_path / "n", val_tokens=1601), "data.val_rows=7")  # 100 validation rows
    assert built.summary.val_rows == 100 and built.val.num_rows == built.summary.val_rows_read == 7
    assert "100 validation rows (validation reads 7 of them)" in built.summary.describe()
    expected = [row_id * 100 // 7 for row_id in range(7)]  # floor(i * 100 / 7): spread over the whole split
    assert [built.val.raw_example(i, 0) for i in range(7)] == [
        built.val.rows.raw_example(row_id, 0) for row_id in expected
    ]
    for micro_batch_size, world_size in [(7, 1), (2, 2), (1, 4)]:
        seen = []
        for rank in range(world_size):
            for batch in data.eval_micro_batches(built.val, micro_batch_size, world_size, rank):
                seen += [tuple(row) for row in batch.inputs[: batch.num_examples].tolist()]
        assert sorted(seen) == sorted(tuple(built.val.raw_example(i, 0).inputs) for i in range(7))


# ---------------------------------------------------------------------------------------------------
# The real entry point
# ---------------------------------------------------------------------------------------------------


def tiny_token_run(tmp_path: Path, source: Path, **overrides) -> list[str]:
    """test_train's tiny settings on token files: 3 steps, each logged, validation at the last."""
    return tiny_settings(tmp_path, source, **{"run.max_steps": 3, "run.log_every": 1, "run.eval_every": 3, **overrides})


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("token_format", ["nanoGPT", "llm.c"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_token_files_train_through_the_entry_point(tmp_path, capsys, launch, token_format, ranks):
    make = nanogpt_folder if token_format == "nanoGPT" else llmc_folder
    status, stdout, stderr = train_as(launch, tiny_token_run(tmp_path, make(tmp_path / "tokens")), ranks, capsys)
    assert status == 0, stderr
    metrics = read_metrics(tmp_path / "runs" / "default")
    assert [line["steps"] for line in metrics] == [1, 2, 3]
    assert [line["tokens"] for line in metrics] == [8 * 16 * steps for steps in (1, 2, 3)]  # no padding, no prompt
    assert "val_loss" in metrics[2]
    assert f"{token_format} token files" in stdout and "layout packed" in stdout
    assert "sample:" in stdout  # meta.json says the tokens are bytes, so the sample decodes


ONE_PLAIN_SGD_STEP_WITHOUT_VALIDATION = {**ONE_PLAIN_SGD_STEP, "data.val_fraction": 0}


def uneven_sft(path: Path) -> Path:
    """Prompt/response lines whose responses run from 1 to 13 bytes (and some past seq_len): micro-batches
    and ranks get very different supervised-token counts."""
    lines = [
        {"prompt": f"q{index}:" + "?" * (index % 5), "response": "r" * (1 + index * 5 % 13)} for index in range(40)
    ]
    return jsonl(path, *lines)


@pytest.mark.slow
@pytest.mark.parametrize("source_kind", ["packed token files", "uneven JSONL"])
def test_one_step_equals_the_float64_reference_for_every_split(tmp_path, source_kind):
    """(m, A, D) = (8,1,1), (4,1,2), (1,4,2): the same update, and it is the float64 full-batch one."""
    source = nanogpt_folder(tmp_path / "n") if source_kind == "packed token files" else uneven_sft(tmp_path / "s.jsonl")
    weights = {}
    for micro, ranks in [(8, 1), (4, 2), (1, 2)]:
        name = f"m{micro}_D{ranks}"
        arguments = tiny_token_run(
            tmp_path,
            source,
            **ONE_PLAIN_SGD_STEP_WITHOUT_VALIDATION,
            **{"batch.micro_batch_size": micro, "run.name": name},
        )
        if ranks == 1:
            assert train.main(arguments) == 0  # in this process: no interpreter start
        else:
            status, _, stderr = train_forked(arguments, ranks)  # ranks forked from the forkserver: no torchrun
            assert status == 0, stderr
        weights[name] = final_weights(tmp_path / "runs" / name)

    # The reference: the initial weights, minus lr (1.0) times the float64 gradient of the mean loss over
    # every supervised target of step 0's 8 rows as one batch.
    config = load_config(tiny_token_run(tmp_path, source, **ONE_PLAIN_SGD_STEP_WITHOUT_VALIDATION))
    loaded = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    initial = torch.load(tmp_path / "runs" / "m8_D1" / "checkpoints" / "step_000000.pt", weights_only=True)["model"]
    model = build_model(config.model, loaded.vocab_size, seq_len=config.data.seq_len, seed=config.run.seed)
    model.load_state_dict(initial)
    row_ids = step_row_ids(loaded.train.num_rows, 8, config.run.seed, 0, "drop")
    gradient = float64_reference_gradient(model, build_micro_batches(loaded.train, row_ids, 8, 8, 1, 0, step=0))
    expected = {
        name: initial[name].double() - g for (name, _), g in zip(model.named_parameters(), gradient, strict=True)
    }
    for name, state in weights.items():
        for key, value in expected.items():
            update = value - initial[key].double()
            # fp32 against float64: a tiny model's fp32 gradient carries relative rounding errors of about
            # 1e-6 (sums of a few hundred terms of 2**-24 each), and the stored fp32 weight half an ulp
            # (2**-24 of its size); 2e-5 of the largest update entry plus one ulp of the largest weight covers
            # both with margin (measured: at most 0.6 of it), while a wrong weighting of the uneven JSONL rows
            # (the mean of micro-batch means at m = 1) moves every tensor by 1.4e-3 to 0.38 of its largest entry.
            tolerance = 2e-5 * update.abs().max().item() + 2**-23 * value.abs().max().item()
            assert (state[key].double() - value).abs().max().item() <= tolerance, (name, key)


def test_resume_on_token_files_is_bit_exact(tmp_path, capsys):
    """4 steps straight equal 2 steps, a restart and 2 more (train.main in this process: the entry point
    without an interpreter start per run)."""
    source = llmc_folder(tmp_path / "shards")
    common = {"run.max_steps": 4, "run.checkpoint_every": 2, "schedule.decay_updates": 4, "run.sample_bytes": 0}
    assert train.main(tiny_token_run(tmp_path, source, **common, **{"run.name": "straight"})) == 0
    assert train.main(tiny_token_run(tmp_path, source, **{**common, "run.max_steps": 2, "run.name": "resumed"})) == 0
    assert train.main(tiny_token_run(tmp_path, source, **common, **{"run.name": "resumed"})) == 0
    assert "resuming from" in capsys.readouterr().out
    a, b = tmp_path / "runs" / "straight", tmp_path / "runs" / "resumed"
    weights_a, weights_b = final_weights(a), final_weights(b)
    assert all(torch.equal(weights_a[key], weights_b[key]) for key in weights_a)
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))


def test_the_equivalence_checker_passes_on_packed_token_files(tmp_path, capsys):
    source = nanogpt_folder(tmp_path / "n")
    arguments = [
        f"data.source={source}",
        "data.seq_len=16",
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
    ]
    status = check_equivalence.main(arguments)
    output = capsys.readouterr().out
    assert status == 0 and "PASS" in output, output


def test_the_sample_is_decoded_with_what_the_tokens_are(tmp_path):
    folder = nanogpt_folder(tmp_path / "n")
    tokenizer, _ = run_tokenizer(load_config([f"data.source={folder}"]))
    assert tokenizer.decode([104, 105]) == "hi"  # meta.json: "tokenizer": "bytes"
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 50304}))
    tokenizer, why_not = run_tokenizer(load_config([f"data.source={folder}"]))
    assert tokenizer is None and "no tokenizer.json beside the token files" in why_not
