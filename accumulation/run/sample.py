"""Text from a language model: the run's tokenizer rebuilt from its config (run_tokenizer), and the sampler
(sample_tokens: temperature, top-p, a generator of its own). The sample a run prints at its end
(run.sample_bytes > 0, print_sample) and scripts/operations/sample.py (a checkpoint, any prompt) both use them."""

import torch

from accumulation.data.rows import BYTES, RunTokenizer


def from_characters(meta: dict, path) -> RunTokenizer:
    """nanoGPT's character-level meta.pkl: `stoi` maps each character to its id, `itos` back."""
    stoi, itos = meta["stoi"], meta["itos"]

    def encode(text: str) -> list[int]:
        unknown = sorted(set(text) - set(stoi))
        if unknown:
            raise ValueError(f"the characters {''.join(unknown)!r} are not in {path.name}'s vocabulary (stoi)")
        return [stoi[character] for character in text]

    return RunTokenizer(encode, lambda ids: "".join(itos.get(i, "\ufffd") for i in ids), meta["vocab_size"], (path,))


def run_tokenizer(config) -> tuple[RunTokenizer | None, str]:
    """(the tokenizer, "") of the run's data, or (None, why not).

    Bytes for the embedded corpus, text, JSONL and registered sources; data.tokenizer when it names a
    tokenizer.json; for token files, the tokenizer.json beside them, else their meta.json ("tokenizer": "bytes")
    or nanoGPT's meta.pkl (`itos` and `stoi`, character-level)."""
    if config.data.source == "stdlib" and config.data.tokenizer == "bytes":  # the default: no path to look at
        return BYTES, ""
    from accumulation.data.locate import expanded_paths, find_token_files  # a path, or a tokenizer.json
    from accumulation.data.tokenizer import from_tokenizer_json

    settings = expanded_paths(config.data)
    if settings.tokenizer != "bytes":
        return from_tokenizer_json(settings.tokenizer), ""
    found = find_token_files(settings.source)
    if found is None:
        return BYTES, ""
    folder = found[1]
    if (folder / "tokenizer.json").is_file():
        return from_tokenizer_json(folder / "tokenizer.json"), ""
    from accumulation.data.token_files import read_meta  # token files only

    meta, path = read_meta(folder) or ({}, None)
    if meta.get("tokenizer") == "bytes":
        return BYTES, ""
    if isinstance(meta.get("stoi"), dict) and isinstance(meta.get("itos"), dict) and "vocab_size" in meta:
        return from_characters(meta, path), ""
    return None, f"no tokenizer.json beside the token files in {folder} to decode it with (or set data.tokenizer)"


def next_token_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The probabilities (float64) the next token is drawn from, given the last position's logits [vocab].

    temperature 0 is greedy: all the mass on the argmax (its first index on a tie). Otherwise softmax(logits / T),
    then top-p (nucleus): the tokens sorted by probability, the smallest prefix whose mass reaches top_p kept
    (a token is kept while the mass ranked above it is still below top_p), renormalised; top_p = 1 keeps all."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    probabilities = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1:
        return probabilities
    sorted_probabilities, order = probabilities.sort(descending=True)
    mass_above = sorted_probabilities.cumsum(0) - sorted_probabilities
    kept = torch.zeros_like(probabilities)
    kept[order[mass_above < top_p]] = sorted_probabilities[mass_above < top_p]
    return kept / kept.sum()


@torch.no_grad()
def sample_tokens(
    model: torch.nn.Module,
    prompt: list[int],
    num_new_tokens: int,
    *,
    context_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[int]:
    """The prompt and `num_new_tokens` tokens after it, each drawn from next_token_distribution of the model's
    logits at the last position, given at most the last `context_tokens` tokens (the run's data.seq_len). The
    draws come from `generator` (on the host) alone: the same seed gives the same tokens."""
    model.eval()
    tokens = torch.tensor([prompt], device=next(model.parameters()).device)
    for _ in range(num_new_tokens):
        logits = model(tokens[:, -context_tokens:])[0, -1]
        probabilities = next_token_distribution(logits.cpu(), temperature, top_p)
        next_token = torch.multinomial(probabilities, 1, generator=generator).to(tokens.device)
        tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
    return tokens[0].tolist()


def sampling_problem(config, model: torch.nn.Module) -> str | None:
    """Why this run's model cannot be sampled as a causal language model, or None."""
    if config.data.task != "next-token":
        return f"data.task={config.data.task}: the model does not predict the next token"
    try:
        with torch.no_grad():
            outputs = model.eval()(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device))
    except Exception:  # a model of images, say: whatever it raises, token ids are not its input
        outputs = None
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 3:
        return f"the {config.model.name} model's outputs are not next-token logits [rows, positions, vocabulary]"
    return None


def print_sample(config, model, prompt_source) -> None:
    """The end-of-run sample: the first training example's prompt continued by run.sample_bytes tokens at
    temperature 1 (seeded by run.seed), decoded with the run's tokenizer; or why there is none."""
    if config.dist.strategy == "fsdp2":  # rank 0 alone cannot run a forward that all-gathers from every rank
        print("sample: skipped under dist.strategy=fsdp2; sample from the checkpoint: scripts/operations/sample.py")
        return
    if config.dist.pipeline_stages > 1:  # rank 0 holds only the first stage's trained weights
        print("sample: skipped with pipeline stages; sample from the checkpoint: scripts/operations/sample.py")
        return
    tokenizer, why_not = run_tokenizer(config)  # bytes, or the tokenizer the data was made with
    # The prompt: the first training example's inputs up to its first target (an SFT example's prompt), at
    # least four tokens.
    example = prompt_source.raw_example(0, 0)
    if tokenizer is not None and not isinstance(example.inputs, list):
        why_not = "the data's inputs are not token ids"
    why_not = why_not or sampling_problem(config, model)
    if why_not:
        print(f"sample: skipped, {why_not}")
        return
    prompt = example.inputs[: max(min(example.targets, default=0) + 1, 4)]
    generator = torch.Generator().manual_seed(config.run.seed)
    tokens = sample_tokens(
        model, prompt, config.run.sample_bytes, context_tokens=config.data.seq_len, generator=generator
    )
    print("sample:\n" + tokenizer.decode(tokens))
