"""A fork: a Hugging Face causal language model (any AutoModelForCausalLM: Llama, GPT-2, Qwen, ...).

    pip install -r requirements-hf.txt
    python train.py --config configs/hf_causal_lm.toml
    python -m pytest tests/conformance --fork-config configs/hf_causal_lm.toml

One file, no edit elsewhere: the model registers itself below with its own keys, and the config names it by
import path (`model.name = "forks.hf_causal_lm:hf-causal-lm"`). model.path is a local folder: one written by
`save_pretrained` (config.json and the weights) is loaded; one that holds only a config.json is built from it,
initialised from run.seed. Nothing is downloaded (local_files_only).

What adapting Hugging Face to the loop's contract takes (docs/forking.md, "The model contract"), and why:
- the loop's labels are already shifted (label j is token j + 1) and hold -100 where there is no target, and the
  step divides the SUM of the losses by the global N itself. So forward() returns the logits and never passes
  `labels=` to Hugging Face: its loss_function would shift the labels a second time, upcast, and return the
  MEAN over the micro-batch, which weights micro-batches equally (docs/forking.md, "Hugging Face models");
- the initial weights come from run.seed, the same on every rank, without leaving the global generator seeded:
  Hugging Face initialises from torch's global generator, so the build runs inside torch.random.fork_rng with
  that generator seeded, and hands it back as it was (train.py seeds dropout per rank after the build anyway);
- hidden_states() and output_head (the lm_head) give the chunked loss what it needs (model.loss = "chunked");
- fsdp_units() makes each decoder layer its own FSDP2 unit, and pipeline_split() cuts GPT-2, Llama and Qwen2
  decoders into stages (forks/hf_stages.py), each rebuilding the positions and the causal mask the decoder builds;
- generate() samples with the generator it is given, never the global one; key_value_decoder() gives the GRPO
  sampler Hugging Face's key-value cache, the prompts left-padded into it (accumulation/rl/rollout.py's rows are
  right-padded);
- the fingerprint hashes the folder's config.json and the sizes of its weight files: a resume refuses a folder
  changed in place, which the keys (model.path) cannot show.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from accumulation.config.config import ConfigError
from accumulation.config.config_keys import setting
from accumulation.config.registry import register_model

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # one of them, or an index and shards: *.safetensors


@dataclass(frozen=True)
class HFSettings:
    path: str = setting(
        "",
        "local folder of a Hugging Face causal LM: with weights (save_pretrained) they are loaded, with only a "
        "config.json the model is built from it and initialised from run.seed",
    )
    weights: str = setting(
        "auto",
        "auto: load the folder's weights when it has them; init: always initialise from run.seed",
        choices=("auto", "init"),
    )


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))


def check_folder(config) -> None:
    folder = Path(config.model.own.path)
    if not config.model.own.path or not (folder / "config.json").is_file():
        raise ValueError(
            f"model.path: expected a folder holding a Hugging Face config.json (save_pretrained writes one), got "
            f"{config.model.own.path!r}"
        )


class HFCausalLM(nn.Module):
    """The loop's model contract around a Hugging Face causal LM (`self.hf`)."""

    def __init__(self, hf_model: nn.Module, source: str):
        super().__init__()
        self.hf, self.source = hf_model, source

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [rows, seq_len, vocab]; no labels= (the loop's loss is a SUM over already-shifted labels)."""
        return self.hf(input_ids=tokens, use_cache=False).logits

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states [rows, seq_len, d], before the lm_head (for model.loss = "chunked"): the
        decoder's (get_decoder), not base_model's, which under PEFT is the adapted whole model, head included."""
        return self.hf.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state

    @property
    def output_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def fsdp_units(self) -> list[nn.Module]:
        """The modules dist.strategy = "fsdp2" shards one by one (docs/sharding.md): each decoder layer, as the
        GPT's blocks; the embeddings, the final norm and the head stay with the root. A decoder whose layers are
        not found (no `layers` or GPT-2's `h` list) is sharded whole."""
        decoder = self.hf.get_decoder()
        layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
        return list(layers) if isinstance(layers, nn.ModuleList) else []

    def pipeline_split(self, num_stages: int) -> list[nn.Module]:
        """The model cut into `num_stages` pipeline stages (dist.pipeline_stages): for GPT-2, Llama and Qwen2
        decoders, embeddings, runs of layers, final norm and head (forks/hf_stages.py)."""
        from forks.hf_stages import split_into_stages  # imported only for dist.pipeline_stages > 1

        return split_into_stages(self, num_stages)

    def describe(self) -> str:
        config = self.hf.config
        parameters = sum(parameter.numel() for parameter in self.parameters())
        return (
            f"hf-causal-lm: {config.model_type}, {parameters:,} parameters ({config.num_hidden_layers} layers, "
            f"hidden {config.hidden_size}, vocab {config.vocab_size}), {self.source}"
        )

    def key_value_decoder(self, rows: int, seq_len: int) -> "HFKeyValueCache":
        """The GRPO sampler's next-token logits with Hugging Face's key-value cache (accumulation/rl/rollout.py)."""
        return HFKeyValueCache(self)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, num_new_tokens: int, generator: torch.Generator) -> torch.Tensor:
        """`num_new_tokens` tokens sampled after `prompt` (1-D ids) with the given generator (Hugging Face's own
        generate() draws from the global one)."""
        tokens = prompt.view(1, -1)
        longest = self.hf.config.max_position_embeddings
        for _ in range(num_new_tokens):
            probabilities = torch.softmax(self(tokens[:, -longest:])[0, -1].float(), dim=-1)
            next_token = torch.multinomial(probabilities.cpu(), 1, generator=generator).to(tokens.device)
            tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
        return tokens[0]


class HFKeyValueCache:
    """Next-token logits for the GRPO sampler (accumulation/rl/rollout.py's `logits(tokens, ends, first)`) from Hugging
    Face's own key-value cache: the prompts once, then one position per row per token. The sampler's rows are
    right-padded (row i's next token goes to position ends[i]); Hugging Face's cache holds every row at the same
    length, so the prompts go in left-padded instead: row i shifted right by its padding, the padding masked out of
    every attention (attention_mask 0) and the positions counted from the row's first token (position_ids), which
    gives each token the logits a forward over its own row alone would. A row that has stopped feeds its last
    token again, at its own position; its logits are not read."""

    def __init__(self, model: HFCausalLM):
        self.hf, self.cache, self.mask = model.hf, None, None

    def logits(self, tokens: torch.Tensor, ends: torch.Tensor, first: bool) -> torch.Tensor:
        if first:
            width = int(ends.max())
            padding = width - ends  # left padding of each row
            columns = torch.arange(width, device=tokens.device)
            positions = (columns[None, :] - padding[:, None]).clamp(min=0)  # column j holds the row's token j − pad
            self.mask = (columns[None, :] >= padding[:, None]).long()
            inputs = tokens.gather(1, positions)
        else:
            positions = (ends - 1)[:, None]  # each row's newest token
            inputs = tokens.gather(1, positions)
            self.mask = torch.cat([self.mask, torch.ones_like(inputs)], dim=1)
        output = self.hf(
            input_ids=inputs,
            attention_mask=self.mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
        )
        self.cache = output.cache
        return output.logits[:, -1]


def build(model_config, vocab_size: int, *, seq_len: int, seed: int) -> HFCausalLM:
    try:  # imported here: the built-in models never need it
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:
        raise ConfigError(
            f"model.name: {model_config.name} needs Hugging Face transformers, which cannot be imported ({error}); "
            "install it: pip install -r requirements-hf.txt"
        ) from None

    folder = Path(model_config.own.path)
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if hf_config.vocab_size < vocab_size:
        raise ConfigError(
            f"model.path: {folder}/config.json has vocab_size {hf_config.vocab_size}, fewer than the data's "
            f"{vocab_size} tokens; use a tokenizer of that model (data.tokenizer) or a larger vocabulary"
        )
    if getattr(hf_config, "max_position_embeddings", seq_len) < seq_len:
        raise ConfigError(
            f"data.seq_len: {seq_len} is longer than the {hf_config.max_position_embeddings} positions of {folder}"
        )
    on_meta = torch.get_default_device().type == "meta"  # a shapes-only build: no weights to read
    load = model_config.own.weights == "auto" and bool(weight_files(folder)) and not on_meta
    with torch.random.fork_rng(devices=[]):  # the global generator is handed back as it was
        torch.manual_seed(seed)
        if load:
            hf_model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        else:
            hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return HFCausalLM(hf_model, f"weights from {folder}" if load else f"initialised from run.seed ({folder})")


def fingerprint(model_config) -> str:
    """sha256 of the folder's config.json and its weight files' names and sizes, 16 hex digits."""
    folder = Path(model_config.own.path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in weight_files(folder):
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return digest.hexdigest()[:16]


# Its size and its dropout come from the folder's config.json: it reads none of model.n_layer, n_head, d_model, dropout.
register_model(
    "hf-causal-lm",
    build,
    settings=HFSettings,
    fingerprint=fingerprint,
    check=check_folder,
    generic_keys=(),
    generic_keys_note="its size comes from config.json in model.path, and its dropout from that file's *_pdrop / "
    "*_dropout entries",
)
