"""The sample a run prints at its end (run.sample_bytes > 0): the model's continuation of the first training
example's prompt, decoded."""

import torch

from accumulation.data.tokenizer import sample_decoder


def print_sample(config, model, prompt_source) -> None:
    """A sample from the model (bytes decoded as UTF-8, or decoded by the data's tokenizer), or why there is none."""
    if config.dist.strategy == "fsdp2":  # rank 0 alone cannot run a forward that all-gathers from every rank
        print("sample: skipped under dist.strategy=fsdp2; sample from the checkpoint (whole weights) on one process")
        return
    if config.dist.pipeline_stages > 1:  # rank 0 holds only the first stage's trained weights
        print("sample: skipped with pipeline stages; sample from the checkpoint (whole weights) on one process")
        return
    if not hasattr(model, "generate"):  # optional in the model contract (accumulation/models/factory.py)
        print(f"sample: skipped, the {config.model.name} model has no generate()")
        return
    decode, why_not = sample_decoder(config)  # bytes, or the tokenizer the data was made with
    if decode is None:
        print(f"sample: skipped, {why_not}")
        return
    # The prompt: the first training example's inputs up to its first target (an SFT example's prompt), at
    # least four tokens.
    example = prompt_source.raw_example(0, 0)
    if not isinstance(example.inputs, list):
        print("sample: skipped, the data's inputs are not token ids")
        return
    prompt_tokens = example.inputs[: max(min(example.targets, default=0) + 1, 4)]
    model.eval()
    prompt = torch.tensor(prompt_tokens, device=next(model.parameters()).device)
    sample = model.generate(prompt, config.run.sample_bytes, torch.Generator().manual_seed(config.run.seed))
    print("sample:\n" + decode(sample.tolist()))
