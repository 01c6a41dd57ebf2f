"""scripts/operations/prepare_data.py: text, folders and JSONL into token files that train.py reads back; bytes and a
locally trained byte-level BPE (the optional `tokenizers` package); bad input leaves nothing behind."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from accumulation.config.config import load_config
from accumulation.data import token_files
from accumulation.data.rows import DataError
from accumulation.data.sources import build_data
from accumulation.data.splits import validation_keys
from accumulation.data.tokenizer import load_tokenizer
from accumulation.run.sample import run_tokenizer
from scripts.operations import prepare_data
from testkit.disk import read_only_view, small_disk
from tests.test_jsonl import jsonl
from tests.test_rows import window_of

DOCUMENTS = {
    "a.txt": "The first document.\n" * 20,
    "b/c.txt": "Zweites Dokument, mit Umlauten: äöü.\n" * 30,
    "d.txt": "third\n" * 50,
    "e.txt": "a fourth one, a little longer than the others, " * 10,
}


def corpus(folder: Path) -> Path:
    for name, text in DOCUMENTS.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (folder / "image.bin").write_bytes(b"\x00\x01binary")  # skipped, like the text source does
    return folder


def split_of(name: str, val_fraction: float) -> str:
    return "val" if name in validation_keys([*DOCUMENTS, "image.bin"], val_fraction) else "train"


def test_bytes_in_both_formats_hold_the_documents_and_load_as_the_same_rows(tmp_path, capsys):
    source = corpus(tmp_path / "corpus")
    val_fraction = 0.5
    assert prepare_data.main([str(source), str(tmp_path / "out"), "--format", "both", "--val-fraction", "0.5"]) == 0
    assert "wrote" in capsys.readouterr().out
    expected = {"train": b"", "val": b""}
    for name in sorted(DOCUMENTS):  # sorted relative paths, the text source's order
        expected[split_of(name, val_fraction)] += DOCUMENTS[name].encode()
    assert expected["train"] and expected["val"]
    nanogpt = tmp_path / "out" / "nanogpt"
    assert (nanogpt / "train.bin").read_bytes() == np.frombuffer(expected["train"], np.uint8).astype("<u2").tobytes()
    assert (nanogpt / "val.bin").read_bytes() == np.frombuffer(expected["val"], np.uint8).astype("<u2").tobytes()
    meta = json.loads((nanogpt / "meta.json").read_text())
    assert (meta["vocab_size"], meta["tokenizer"], meta["skipped_files"]) == (256, "bytes", 1)
    assert meta["train_tokens"] == len(expected["train"])

    settings = ["data.seq_len=16"]
    nanogpt_config = load_config([f"data.source={nanogpt}", *settings])
    llmc_config = load_config([f"data.source={tmp_path / 'out' / 'llmc'}", *settings])
    from_nanogpt = build_data(
        nanogpt_config.data, model_vocab_size=nanogpt_config.model.vocab_size, seed=nanogpt_config.run.seed
    )
    from_llmc = build_data(llmc_config.data, model_vocab_size=llmc_config.model.vocab_size, seed=llmc_config.run.seed)
    assert from_nanogpt.train.num_rows == from_llmc.train.num_rows == (len(expected["train"]) - 1) // 16
    ids = torch.arange(from_nanogpt.train.num_rows)
    pairs = zip(from_nanogpt.train.examples(ids), from_llmc.train.examples(ids), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    first_row = window_of(from_llmc.train.raw_example(0))
    assert bytes(first_row) == expected["train"][:17]


def test_llmc_shards_roll_over_at_shard_tokens(tmp_path, capsys):
    source = tmp_path / "one.txt"
    source.write_text("line of text\n" * 100)  # 1300 bytes
    arguments = [str(source), str(tmp_path / "out"), "--shard-tokens", "500", "--val-fraction", "0.1"]
    assert prepare_data.main(arguments) == 0
    shards = sorted(path.name for path in (tmp_path / "out").glob("*.bin"))
    train_part, val_part = prepare_data.split_at_newline(source.read_bytes(), 0.1)
    assert shards == ["one_train_000000.bin", "one_train_000001.bin", "one_train_000002.bin", "one_val_000000.bin"]
    counts = [len(token_files.open_llmc_shard(tmp_path / "out" / name).tokens) for name in shards]
    assert counts == [500, 500, len(train_part) - 1000, len(val_part)]


def test_jsonl_documents_join_prompt_and_response(tmp_path, capsys):
    lines = [{"prompt": "Q: 1+1=", "response": " 2\n"}, {"text": "a whole document\n"}] * 3
    lines += [{"prompt": f"Q: {i}", "response": "!"} for i in range(40)]
    source = jsonl(tmp_path / "sft.jsonl", *lines)
    assert prepare_data.main([str(source), str(tmp_path / "out"), "--format", "nanogpt"]) == 0
    train_bytes = np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2").astype(np.uint8).tobytes()
    assert train_bytes.startswith(b"Q: 1+1= 2\na whole document\n")


BAD_RUNS = [
    (lambda tmp: [str(jsonl(tmp / "x.jsonl", {"question": "?"}))], "x.jsonl', line 1: has the keys"),
    (lambda tmp: [str(tmp / "missing.txt")], "missing.txt does not exist"),
    (lambda tmp: [str(jsonl(tmp / "one.jsonl", {"text": "a"})), "--val-fraction", "0.0001"], "no document fell into"),
    # a raw UnicodeDecodeError without file or line before; after line 1's progress line, on a line of its own
    (lambda tmp: [str(latin1_jsonl(tmp / "latin1.jsonl"))], "latin1.jsonl, line 2: not valid UTF-8 (byte 12 of"),
]


def latin1_jsonl(path: Path) -> Path:
    path.write_bytes(b'{"text": "fine"}\n' + '{"text": "déjà"}\n'.encode("latin-1"))
    return path


@pytest.mark.parametrize("make_arguments, message", BAD_RUNS)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, make_arguments, message):
    out_dir = tmp_path / "out"
    arguments = make_arguments(tmp_path)
    assert prepare_data.main([arguments[0], str(out_dir), *arguments[1:]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], lines
    assert not out_dir.exists()
    assert not list(tmp_path.glob(".out.partial-*"))  # the staging folder is gone too


def test_an_out_dir_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys):
    """A read-only mount (root passes permission bits, so a real one): one line naming the folder, no errno."""
    (tmp_path / "writable").mkdir()
    with read_only_view(tmp_path / "writable", tmp_path / "read-only") as read_only:
        assert prepare_data.main([str(corpus(tmp_path / "c")), str(read_only / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"error: cannot write {read_only}/.out.partial-"), error
    assert "(Read-only file system); choose an OUT_DIR in a folder you can write to" in error
    assert list((tmp_path / "writable").iterdir()) == []


def test_a_full_disk_is_one_line_exit_1_not_bad_input_and_nothing_kept(tmp_path, capsys):
    """A real 64 KiB tmpfs and 200 KB of text: the disk, not the input, is at fault, so exit 1 (2 means bad
    input), and the partial output is removed."""
    source = tmp_path / "big"
    source.mkdir()
    for index in range(20):
        (source / f"part{index:02d}.txt").write_text(f"document {index} " * 1_000)
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        assert prepare_data.main([str(source), str(disk / "out")]) == 1
        assert list(disk.iterdir()) == []
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("error: ") and "the disk is full (No space left on device)" in lines[-1], lines
    assert "nothing was kept" in lines[-1]


def test_the_staging_folders_of_killed_runs_are_removed_and_a_live_one_is_kept(tmp_path, capsys):
    """A run killed by SIGKILL leaves .<out>.partial-<pid>/; the next run for the same OUT_DIR removes it once
    its process is gone, and leaves alone one whose process still runs (another run at work)."""
    dead = tmp_path / f".out.partial-{dead_pid()}"
    live = tmp_path / f".out.partial-{os.getppid()}"
    for staging in (dead, live):
        (staging / "half").mkdir(parents=True)
    assert prepare_data.main([str(corpus(tmp_path / "c")), str(tmp_path / "out")]) == 0
    assert not dead.exists() and (live / "half").is_dir() and (tmp_path / "out" / "meta.json").is_file()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_an_out_dir_that_holds_files_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    source = corpus(tmp_path / "c")
    assert prepare_data.main([str(source), str(tmp_path / "out")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------------------------------
# Byte-level BPE (optional dependency)
# ---------------------------------------------------------------------------------------------------


def test_a_bpe_trained_here_encodes_the_corpus_and_decodes_it_back(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    source = corpus(tmp_path / "corpus")
    arguments = [str(source), str(tmp_path / "out"), "--tokenizer", "bpe", "--vocab-size", "300"]
    assert prepare_data.main([*arguments, "--val-fraction", "0.5"]) == 0
    out = tmp_path / "out"
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = load_tokenizer(str(out / "tokenizer.json"))
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= 300
    end = meta["end_of_text_token"]
    assert end == tokenizer.token_to_id("<|endoftext|>")
    train_ids = np.concatenate([token_files.open_llmc_shard(path).tokens for path in sorted(out.glob("*_train_*"))])
    assert train_ids[0] == end
    training_names = [name for name in sorted(DOCUMENTS) if split_of(name, 0.5) == "train"]
    decoded = tokenizer.decode(train_ids.tolist(), skip_special_tokens=False)
    assert decoded == "".join("<|endoftext|>" + DOCUMENTS[name] for name in training_names)
    # train.py decodes its sample with the tokenizer.json beside the shards.
    rebuilt, _ = run_tokenizer(load_config([f"data.source={out}"]))
    assert rebuilt.decode(train_ids[:20].tolist()) == decoded[: len(rebuilt.decode(train_ids[:20].tolist()))]


def test_data_tokenizer_encodes_jsonl_with_an_end_of_response_token(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    assert prepare_data.main([str(corpus(tmp_path / "c")), str(tmp_path / "bpe"), "--tokenizer", "bpe"]) == 0
    tokenizer_path = tmp_path / "bpe" / "tokenizer.json"
    tokenizer = load_tokenizer(str(tokenizer_path))
    end = tokenizer.token_to_id("<|endoftext|>")
    lines = [{"prompt": "The first", "response": " document."}, {"text": "third\nthird\n"}]
    source = jsonl(tmp_path / "sft.jsonl", *lines)
    settings = [f"data.source={source}", f"data.tokenizer={tokenizer_path}", "data.val_fraction=0", "data.seq_len=32"]
    config = load_config(settings)
    built = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    assert built.vocab_size == tokenizer.get_vocab_size() and built.summary.vocab_from == "data.tokenizer"
    example = built.train.raw_example(0)
    prompt = tokenizer.encode("The first", add_special_tokens=False).ids
    response = tokenizer.encode(" document.", add_special_tokens=False).ids + [end]
    assert example.inputs == prompt + response  # shorter than a row: its last token is read too, with no target
    assert list(example.targets.values()) == response  # the response and its end token, never the prompt
    inputs, labels = built.train.examples(torch.tensor([0]))
    supervised = labels[0][labels[0] != -100].tolist()
    assert supervised == response
    # Text with the tokenizer, packed: documents separated by the end token.
    config = load_config([f"data.source={tmp_path / 'c'}", f"data.tokenizer={tokenizer_path}", "data.layout=packed"])
    packed = build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
    assert packed.train.raw_example(0).inputs[0] == end
    assert packed.summary.padding_fraction == 0


def test_a_missing_tokenizer_file_is_a_data_error(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(DataError, match="cannot load it as a tokenizer.json"):
        config = load_config([f"data.tokenizer={tmp_path / 'nope.json'}"])
        build_data(config.data, model_vocab_size=config.model.vocab_size, seed=config.run.seed)
