"""A run's trained model rebuilt from its run directory, on the host: the newest readable checkpoint's config and
weights, and the tokenizer of its data where it can be rebuilt (scripts/operations/sample.py and export.py). Any
problem is one TrainedRunError line naming the file and what to do."""

import functools
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from accumulation.config.config import Config, ConfigError, config_from_dict
from accumulation.data.rows import DataError, RunTokenizer
from accumulation.models.factory import build_model, build_model_on_meta
from accumulation.run.checkpoint import CheckpointError
from accumulation.run.restore import newest_checkpoint
from accumulation.run.sample import run_tokenizer


class TrainedRunError(ValueError):
    """A run directory whose model cannot be rebuilt: not a run, no checkpoint, a damaged one, a config that no
    longer loads (a fork's module gone), weights that do not fit."""


class TrainedRun(NamedTuple):
    model: torch.nn.Module  # float32, on the host, in eval mode
    config: Config  # as the checkpoint stored it
    checkpoint: Path
    steps: int  # the steps the checkpoint covers
    tokenizer: RunTokenizer | None
    why_no_tokenizer: str  # when tokenizer is None


def vocab_size_of(config: Config, state: dict) -> int:
    """The vocabulary size the checkpoint's model was built with, read from its weights: the model built on the meta
    device (shapes only) with 1 and with 2 tokens shows which dimension of which tensor is the vocabulary. A model
    whose size comes from elsewhere (a Hugging Face config.json) has none: 1 is passed, and its build ignores it."""
    one, two = (build_model_on_meta(config.model, size, config.data.seq_len).state_dict() for size in (1, 2))
    for key, tensor in one.items():
        if key in state and tensor.shape != two[key].shape:
            dimension = next(i for i, (a, b) in enumerate(zip(tensor.shape, two[key].shape, strict=True)) if a != b)
            return state[key].shape[dimension]
    return 1


def load_trained_run(run_dir: Path) -> TrainedRun:
    checkpoints = run_dir / "checkpoints"
    if not run_dir.is_dir() or not checkpoints.is_dir():
        raise TrainedRunError(
            f"{run_dir} is not a run directory (no checkpoints/ folder in it); pass <run.out_dir>/<run.name>, "
            f"e.g. runs/default"
        )
    warn = functools.partial(print, file=sys.stderr)  # a damaged latest.pt passed over for an older checkpoint
    try:
        found = newest_checkpoint(checkpoints, warn)
        if found is None:
            raise TrainedRunError(f"{checkpoints} holds no checkpoint yet; train first (python train.py run.name=...)")
        path, payload = found
        if path.is_dir():  # fsdp2's shards gathered in this one process: export and sampling need the whole model
            from accumulation.run.sharded_checkpoint import whole_state

            payload = whole_state(path)
    except CheckpointError as error:
        raise TrainedRunError(str(error)) from None
    try:
        config = config_from_dict(payload["config"])
        tokenizer, why_not = run_tokenizer(config)
    except (ConfigError, DataError) as error:
        raise TrainedRunError(f"checkpoint {path}: its config cannot be rebuilt here: {error}") from None
    try:
        model = build_model(
            config.model, vocab_size_of(config, payload["model"]), seq_len=config.data.seq_len, seed=config.run.seed
        )
        model.load_state_dict(payload["model"])
    except (ConfigError, RuntimeError) as error:
        first_line = str(error).strip().splitlines()[0]
        problem = f"its weights do not fit the model its config builds: {first_line}"
        raise TrainedRunError(f"checkpoint {path}: {problem}") from None
    return TrainedRun(model.float().eval(), config, path, payload["counters"]["steps"], tokenizer, why_not)
