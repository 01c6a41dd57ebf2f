"""The framework cards that need two processes: the Hugging Face Trainer on 2 gloo ranks, with its count of the
step's targets summed across the ranks (average_tokens_across_devices, its default) and without it.

The same 8 rows as framework_cards.py, in micro-batches of 2 rows, now at D = 2 and A = 2. Accelerate's data
loader (split_batches=False) hands rank r the micro-batches r, r + D, ...: rank 0 holds 30 + 21 = 51 targets,
rank 1 holds 3 + 7 = 10, so a rank that normalises by its own count weighs rank 1's rows five times too much.
Each rank trains its own copy of the same model from the same seed; rank 0 hands back its weights after the step.
"""

import contextlib
import io
import logging
import os
import socket
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from scripts.teaching import card_setup as setup
from scripts.teaching import framework_cards as cards

WORLD_SIZE = 2  # D
ACCUMULATION_STEPS = 2  # A = 8 rows / (m = 2 · D = 2)


def micro_batch_ranks() -> list[int]:
    """The rank each micro-batch of the step goes to: r, r + D, ... (Accelerate's BatchSamplerShard)."""
    return [k % WORLD_SIZE for k in range(len(setup.targets_per_micro_batch()))]


def own_rank_count() -> torch.Tensor:
    """Gallery row 2: each rank divides its sum by its own count, and DDP averages the D ranks' gradients."""
    targets, ranks = setup.targets_per_micro_batch(), micro_batch_ranks()
    rank_targets = [sum(n for n, r in zip(targets, ranks, strict=True) if r == rank) for rank in range(WORLD_SIZE)]
    return setup.per_row([1 / (WORLD_SIZE * rank_targets[r]) for r in ranks])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(rank: int, port: int, average_tokens: bool, weights_path: str) -> None:
    """One rank of torchrun's environment, set by hand: the Trainer (through Accelerate) joins a gloo group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
    )
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    import transformers

    model = setup.llama()
    input_ids, labels = setup.step_rows()
    rows = [{"input_ids": i, "labels": label} for i, label in zip(input_ids, labels, strict=True)]
    with tempfile.TemporaryDirectory() as output_dir, contextlib.redirect_stdout(io.StringIO()):
        args = cards.trainer_arguments(
            output_dir, ACCUMULATION_STEPS, average_tokens_across_devices=average_tokens, ddp_backend="gloo"
        )
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    if rank == 0:
        torch.save(model.state_dict(), weights_path)


def hf_trainer_two_ranks(average_tokens: bool) -> Callable[[torch.nn.Module], None]:
    def run(model: torch.nn.Module) -> None:
        with tempfile.TemporaryDirectory() as folder:
            weights_path = os.path.join(folder, "rank0.pt")
            mp.spawn(rank_main, args=(free_port(), average_tokens, weights_path), nprocs=WORLD_SIZE)
            model.load_state_dict(torch.load(weights_path))

    return run


TWO_RANK_CARDS = [
    cards.Card("HF Trainer", "LlamaForCausalLM, 2 ranks, average_tokens_across_devices (default)", "-",
               setup.llama, hf_trainer_two_ranks(average_tokens=True), setup.token_mean),
    cards.Card("HF Trainer", "LlamaForCausalLM, 2 ranks, average_tokens_across_devices = False", "2",
               setup.llama, hf_trainer_two_ranks(average_tokens=False), own_rank_count),
]  # fmt: skip
