"""Text from a trained run: python scripts/operations/sample.py RUN_DIR --prompt TEXT [options]

    RUN_DIR          a run directory (<run.out_dir>/<run.name>, e.g. runs/default): its newest readable checkpoint
                     is loaded on the host, the model its config names built, the tokenizer of its data rebuilt
                     (bytes; a tokenizer.json; nanoGPT's meta.pkl with itos and stoi)
    --prompt TEXT    the text to continue
    --tokens N       new tokens to sample (default 200)
    --temperature T  the logits divided by T before the softmax; 0 is greedy (default 1)
    --top-p P        nucleus sampling: only the most likely tokens whose mass reaches P (default 1: all)
    --seed S         the generator's seed (default: the run's run.seed); the same seed gives the same text

The prompt and its continuation go to stdout, what was loaded to stderr. The sampler is the end-of-run sample's
(accumulation/run/sample.py). Bad input (not a run directory, no checkpoint or a damaged one, a tokenizer that
cannot be rebuilt, a prompt it cannot encode) is one line on stderr and exit status 2.
"""

import argparse
import sys
from pathlib import Path

import torch

from accumulation.run.sample import sample_tokens, sampling_problem
from accumulation.run.trained import TrainedRunError, load_trained_run


def sampled_text(arguments: argparse.Namespace) -> str:
    run = load_trained_run(Path(arguments.run_dir))
    if run.tokenizer is None:
        raise TrainedRunError(f"cannot sample from {arguments.run_dir}: {run.why_no_tokenizer}")
    problem = sampling_problem(run.config, run.model)
    if problem:
        raise TrainedRunError(f"cannot sample from {arguments.run_dir}: {problem}")
    try:
        prompt = run.tokenizer.encode(arguments.prompt)
    except ValueError as error:
        raise TrainedRunError(f"--prompt: {error}") from None
    # A tokenizer.json without an unknown token (a BPE trained on a task's text) encodes a character it lacks as
    # nothing: the model would continue another prompt than the one given
    lost = sorted({character for character in arguments.prompt if not run.tokenizer.encode(character)})
    if lost:
        raise TrainedRunError(
            f"--prompt: {', '.join(map(repr, lost))} {'is' if len(lost) == 1 else 'are'} no token of the run's "
            f"tokenizer ({run.tokenizer.files[0] if run.tokenizer.files else 'bytes'}) and would be dropped; leave "
            f"{'it' if len(lost) == 1 else 'them'} out"
        )
    if not prompt:
        raise TrainedRunError("--prompt: the text encodes to no token; give at least one character")
    seed = run.config.run.seed if arguments.seed is None else arguments.seed
    print(
        f"{run.checkpoint} (step {run.steps}): {arguments.tokens} tokens at temperature {arguments.temperature:g}, "
        f"top-p {arguments.top_p:g}, seed {seed}",
        file=sys.stderr,
    )
    tokens = sample_tokens(
        run.model,
        prompt,
        arguments.tokens,
        context_tokens=run.config.data.seq_len,
        generator=torch.Generator().manual_seed(seed),
        temperature=arguments.temperature,
        top_p=arguments.top_p,
    )
    return run.tokenizer.decode(tokens)


def bounded(kind, low: float, high: float | None = None, low_included: bool = True):
    """An argparse type: `kind` within [low, high] (or (low, high] when low is excluded), else one line."""

    def parse(text: str):
        value = kind(text)
        if value < low or (value == low and not low_included) or (high is not None and value > high):
            interval = f"{'[' if low_included else '('}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text}")
        return value

    return parse


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory, e.g. runs/default")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokens", type=bounded(int, 0), default=200, help="new tokens to sample")
    parser.add_argument("--temperature", type=bounded(float, 0.0), default=1.0, help="0 is greedy")
    parser.add_argument("--top-p", type=bounded(float, 0.0, 1.0, low_included=False), default=1.0)
    parser.add_argument("--seed", type=bounded(int, 0), default=None, help="default: the run's run.seed")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    arguments = parse_arguments(argv)  # a bad option: argparse's usage and one error line, exit 2
    try:
        print(sampled_text(arguments))
    except TrainedRunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
