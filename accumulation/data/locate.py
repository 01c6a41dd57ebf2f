"""Whether data.source names token files (a nanoGPT folder, llm.c shards), found by their names alone: what
accumulation/data/path_sources.py reads to choose a source, before any source's module is imported. And the paths of
data.source and data.tokenizer as every reader takes them (expanded_paths).
"""

import dataclasses
import glob
import os
from pathlib import Path

from accumulation.data.rows import DataError


def expanded_paths(settings):
    """config.data (a DataConfig) with data.source and data.tokenizer's leading `~` read as the home directory, as
    in a shell and as run.out_dir: a TOML file's "~/data" is no folder named "~"."""
    tokenizer = settings.tokenizer if settings.tokenizer == "bytes" else os.path.expanduser(settings.tokenizer)
    return dataclasses.replace(settings, source=os.path.expanduser(settings.source), tokenizer=tokenizer)


def is_llmc_shard_name(name: str) -> bool:
    return name.endswith(".bin") and ("_train_" in name or "_val_" in name)


def find_token_files(source: str) -> tuple[str, Path, list[Path], list[Path]] | None:
    """(format, folder, training paths, validation paths) when `source` names token files, else None.

    A folder with train.bin is nanoGPT's; a folder with *_train_*.bin / *_val_*.bin shards, or a glob
    (a path with * ? or [) of such shards, is llm.c's. Anything else is left to the text sources.
    """
    path = Path(source)
    if path.is_dir() and (path / "train.bin").is_file():
        return "nanoGPT", path, [path / "train.bin"], [path / "val.bin"] if (path / "val.bin").exists() else []
    if path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.is_file() and is_llmc_shard_name(p.name))
        if not shards:
            return None
        folder = path
    elif not path.exists() and any(character in source for character in "*?["):  # an existing file is text
        shards = sorted(Path(p) for p in glob.glob(source) if Path(p).is_file())
        if not shards:
            raise DataError(f"data.source {source!r}: the glob matches no file; point it at llm.c shards (*.bin)")
        not_shards = [p for p in shards if not is_llmc_shard_name(p.name)]
        if not_shards:
            raise DataError(
                f"{not_shards[0]}: not an llm.c shard name (*_train_*.bin or *_val_*.bin); narrow data.source's glob"
            )
        folder = shards[0].parent
    else:
        return None
    train = [p for p in shards if "_train_" in p.name]
    val = [p for p in shards if "_val_" in p.name and "_train_" not in p.name]
    return "llm.c", folder, train, val
