"""A data.source that is a path (and the standard library read with a tokenizer): which source reads it, and the
checks of a text file or folder. Each source's module is imported only when data.source names it.

    token files (a nanoGPT folder, llm.c shards): accumulation/data/token_files.py, packed;
        with data.task = "masked": accumulation/data/masked_lm.py (a fresh mask every step)
    a *.jsonl file of {"prompt", "response"} or {"text"} lines: accumulation/data/jsonl.py, one example per row
    a text file or folder: read and checked here, then cut into rows as the embedded corpus is (text_corpus.py)
"""

from pathlib import Path

from accumulation.config.config import DataConfig
from accumulation.data import text_corpus
from accumulation.data.locate import expanded_paths, find_token_files
from accumulation.data.memory import memory_limit_bytes
from accumulation.data.rows import DataError
from accumulation.data.splits import Data
from accumulation.data.text_corpus import TextFile, TextSplit

# Memory the text path takes per byte of text, its peak while the rows are built (the bytes, their copies
# as documents and packed, and the row tables), rounded up from the figure docs/data.md gives. Text is read
# whole; token files are not.
TEXT_MEMORY_BYTES_PER_BYTE = 16


def load_files(data_config: DataConfig, model_vocab_size: int, seed: int) -> Data:
    """The built-in source that data.source names: token files, a .jsonl file, or text."""
    settings = expanded_paths(data_config)
    source, seq_len, val_fraction, layout = settings.source, settings.seq_len, settings.val_fraction, settings.layout
    found_token_files = None if source == "stdlib" else find_token_files(source)  # "stdlib" is never a folder
    # data.tokenizer encodes text and JSONL; token files are encoded already (it only decodes their sample),
    # but it is loaded here for them too, so that a bad path is reported before training, not after.
    tokenizer = None
    if settings.tokenizer != "bytes":
        from accumulation.data.tokenizer import load_tokenizer  # the optional Hugging Face tokenizers package

        tokenizer = load_tokenizer(settings.tokenizer)
    if found_token_files is not None:
        if layout == "documents":
            raise DataError(
                f'data.layout="documents": {source!r} holds {found_token_files[0]} token files, whose documents '
                f'are already concatenated; use data.layout="packed" (or "auto")'
            )
        from accumulation.data import token_files  # this source's code, imported only for it (as below)

        opened = token_files.open_token_files(found_token_files, source, with_validation=val_fraction > 0)
        if settings.task == "masked":
            from accumulation.data.masked_lm import load_masked_token_files

            return load_masked_token_files(opened, source, seq_len, val_fraction, model_vocab_size, seed)
        return token_files.load_token_files(opened, source, seq_len, val_fraction, model_vocab_size)
    if settings.task == "masked":
        raise DataError(
            f'data.task="masked": {source!r} is not a folder of token files; masking is implemented for token files '
            f"(make them with scripts/operations/prepare_data.py)"
        )
    if source.endswith(".jsonl"):
        if layout == "packed":
            raise DataError(
                f'data.layout="packed": {source!r} is a JSONL file of examples, one example per row so that each '
                f'keeps its own prompt mask; use data.layout="documents" (or "auto")'
            )
        from accumulation.data.jsonl import load_jsonl

        return load_jsonl(source, seq_len, val_fraction, tokenizer)
    if source == "stdlib":
        return text_corpus.load_stdlib(seq_len, val_fraction, layout == "packed", tokenizer)
    return load_text_path(source, seq_len, val_fraction, layout == "packed", tokenizer)


# ---------------------------------------------------------------------------------------------------
# A text file or folder
# ---------------------------------------------------------------------------------------------------


def not_text_advice(path: Path) -> str:
    """Why a single file is no text, and where to point data.source instead: its folder when the file is one
    of the token files a folder of them is read as (train.bin, an llm.c shard)."""
    if find_token_files(str(path.parent)) is not None:
        return (
            f" but a token file (it holds binary token ids); token files are read as their folder: "
            f"set data.source={str(path.parent)!r}"
        )
    return " (it contains a NUL byte or is not valid UTF-8); point data.source at a UTF-8 text file or a folder of them"


def check_text_fits_in_memory(source: str, paths: list[Path]) -> None:
    """Refuse text that cannot fit: it is read whole, and reading it would end in a MemoryError traceback or
    the kernel's OOM killer. Token files are memory-mapped and never read whole."""
    text_bytes = sum(path.stat().st_size for path in paths)
    limit_bytes, limit = memory_limit_bytes()
    needed_bytes = TEXT_MEMORY_BYTES_PER_BYTE * text_bytes
    if needed_bytes > limit_bytes:
        raise DataError(
            f"data.source {source!r}: {text_bytes / 2**30:,.2f} GiB of text, read whole, needs about "
            f"{needed_bytes / 2**30:,.1f} GiB ({TEXT_MEMORY_BYTES_PER_BYTE} bytes per byte), more than the "
            f"{limit_bytes / 2**30:,.1f} GiB of {limit}; write it as token files once, which are memory-mapped "
            f"and never read whole: python scripts/operations/prepare_data.py INPUT OUT_DIR (it reads a folder or "
            f"a .jsonl file one document at a time; split one large file into several), then data.source=OUT_DIR"
        )


def folder_file_paths(root: Path) -> list[Path]:
    """Every regular file below `root`, recursively, sorted by relative path."""
    paths = [path for path in root.rglob("*") if path.is_file()]
    return sorted(paths, key=lambda path: path.relative_to(root).as_posix())


def read_text_path(source: str) -> tuple[Path, list[TextFile], int]:
    """The path's root, its text files in sorted order, and how many non-text files were skipped. In a folder,
    non-text files are skipped and counted; a single file that is not text is an error."""
    root = Path(source)
    if not root.exists():
        raise DataError(
            f"data.source {source!r} does not exist; set it to a text file or folder, a .jsonl file, a folder of "
            f'token files (scripts/operations/prepare_data.py writes them), or "stdlib"'
        )
    if root.is_file():
        check_text_fits_in_memory(source, [root])
        data = text_corpus.read_bytes(root, source)
        if not text_corpus.is_text(data):
            raise DataError(f"data.source {source!r} is not a text file{not_text_advice(root)}")
        return root, [TextFile(root.name, data)], 0
    if not root.is_dir():
        raise DataError(f"data.source {source!r} is neither a file nor a folder; point it at a text file or folder")
    paths = folder_file_paths(root)
    check_text_fits_in_memory(source, paths)
    return root, *text_corpus.read_text_files(root, paths, source)


def split_at_newline(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """Split one file into (train, validation): the tail after the newline nearest to (1 - val_fraction)·size.

    The newline stays with the training part. A newline that is the file's last byte is not a candidate
    (it would leave the tail empty); with no candidate the cut is at the byte position itself.
    """
    target = round((1 - val_fraction) * len(data))
    candidates = []
    before = data.rfind(b"\n", 0, target)
    if before != -1:
        candidates.append(before + 1)
    after = data.find(b"\n", target, len(data) - 1)
    if after != -1:
        candidates.append(after + 1)
    cut = min(candidates, key=lambda position: abs(position - target)) if candidates else target
    return data[:cut], data[cut:]


def load_text_path(source: str, seq_len: int, val_fraction: float, packed_layout: bool, tokenizer) -> Data:
    """Read a text file or folder and split it: by a hash of each file's path (text_corpus.split_by_file) when it
    has two or more files with a target, or a lone file at a newline (split_at_newline); then cut both into rows
    (text_corpus.text_data). Every file is one document."""
    root, files, skipped_files = read_text_path(source)
    # Files under 2 bytes hold no target and take no part in the split: one real file beside an empty one is
    # split as if it were alone.
    files_with_targets = [file for file in files if len(file.data) >= 2]
    if len(files_with_targets) == 1 and val_fraction > 0:
        [lone_file] = files_with_targets
        train_part, val_part = split_at_newline(lone_file.data, val_fraction)
        # the files without a target: documents that make_rows drops, counted in the summary
        others = [file.data for file in files if file is not lone_file]
        split = TextSplit(root, files, skipped_files, [train_part, *others], [val_part], val_files=1)
    else:
        split = text_corpus.split_by_file(root, files, skipped_files, val_fraction, is_python_source=False)
    return text_corpus.text_data(source, split, seq_len, val_fraction, packed_layout, tokenizer)
