"""The run's counters: what train.py logs in metrics.jsonl and stores in every checkpoint."""

from dataclasses import dataclass

from accumulation.step import StepResult


@dataclass
class Counters:
    """Cumulative over the whole run, resumes included. Each name says its unit."""

    micro_batches: int = 0  # forward+backward passes on one rank
    steps: int = 0  # optimizer step attempts (accumulation groups)
    updates: int = 0  # optimizer updates actually applied
    skipped: int = 0  # steps whose update was not applied
    examples: int = 0  # real examples consumed, all ranks (padding rows excluded)
    tokens: int = 0  # supervised tokens, all ranks (padding and ignored positions excluded)

    def add(self, result: StepResult) -> None:
        self.micro_batches += result.micro_batches
        self.steps += 1
        self.updates += int(result.applied)
        self.skipped += int(not result.applied)
        self.examples += result.examples
        self.tokens += result.tokens
