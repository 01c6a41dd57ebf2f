"""The sample a run prints at its end (run.sample_bytes > 0): the model's continuation of the first training
example's prompt, decoded."""

import functools

import torch


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


def decode_bytes(ids: list[int]) -> str:
    """Byte tokens as UTF-8 text. A model whose vocabulary was padded past 256 (model.vocab_size) can sample an
    id that is no byte: it shows as U+FFFD, like any byte sequence that is not UTF-8."""
    replacement = "\ufffd".encode()
    return b"".join(bytes([i]) if i < 256 else replacement for i in ids).decode("utf-8", errors="replace")


def tokenizer_decoder(tokenizer):
    """A Hugging Face tokenizer's decode, special tokens kept (the sample shows what the model produced)."""
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


def sample_decoder(config) -> tuple[object, str]:
    """(decode, "") where decode turns token ids into text for the end-of-run sample, or (None, why not).

    Bytes for the embedded corpus; data.tokenizer when it names a tokenizer.json; for token files, the
    tokenizer.json beside them, or bytes when their meta.json says "tokenizer": "bytes"; for text and JSONL, bytes.
    """
    if config.data.source == "stdlib" and config.data.tokenizer == "bytes":  # the default: no path to look at
        return decode_bytes, ""
    from accumulation.data.locate import expanded_paths, find_token_files  # a path, or a tokenizer.json
    from accumulation.data.tokenizer import load_tokenizer

    settings = expanded_paths(config.data)
    if settings.tokenizer != "bytes":
        return tokenizer_decoder(load_tokenizer(settings.tokenizer)), ""
    found = find_token_files(settings.source)
    if found is None:
        return decode_bytes, ""
    folder = found[1]
    if (folder / "tokenizer.json").is_file():
        return tokenizer_decoder(load_tokenizer(str(folder / "tokenizer.json"))), ""
    from accumulation.data.token_files import read_meta  # token files only

    meta = read_meta(folder)
    if meta is not None and meta[0].get("tokenizer") == "bytes":
        return decode_bytes, ""
    return None, f"no tokenizer.json beside the token files in {folder} to decode it with (or set data.tokenizer)"
