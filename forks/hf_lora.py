"""A fork: LoRA on a Hugging Face causal language model through PEFT (frozen base weights, low-rank adapters train).

    pip install -r requirements-hf.txt
    python train.py --config configs/hf_lora.toml
    python scripts/checks/check_equivalence.py --config configs/hf_lora.toml

One file on top of forks/hf_causal_lm.py: the base model is built there (from model.path's config.json and
run.seed, or loaded from a save_pretrained folder), then PEFT freezes every one of its weights and adds a pair of
low-rank matrices A [r, d_in] and B [d_out, r] beside each targeted linear layer, whose output becomes
W x + (lora_alpha / r) · B A x. Only A and B have requires_grad: their gradients are the step's, the optimizer
moves them alone, and the frozen weights get no gradient at all (p.grad stays None), which the loop, the
checker and the checkpoints handle (docs/forking.md, "Frozen parameters and LoRA").

What LoRA through PEFT needs here, and why:
- the adapters' initial values come from run.seed like the base weights: PEFT draws A from torch's global
  generator (B starts at 0, so the first forward is the base model's), so the wrapping runs inside
  torch.random.fork_rng with that generator seeded, and hands it back as it was;
- lora_dropout is 0 unless asked: it is a Dropout module, which the checker switches off and train.py seeds per
  rank, like any other;
- the model keeps forks/hf_causal_lm.py's contract (logits from forward, no labels=, hidden_states and
  output_head for model.loss = "chunked"): HFCausalLM wraps the PEFT model as it wraps a plain one.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from accumulation.config.config import ConfigError
from accumulation.config.config_keys import setting
from accumulation.config.registry import register_model
from forks.hf_causal_lm import HFCausalLM, check_folder
from forks.hf_causal_lm import build as build_base
from forks.hf_causal_lm import fingerprint as base_fingerprint


@dataclass(frozen=True)
class LoRASettings:
    path: str = setting(
        "",
        "local folder of a Hugging Face causal LM, the frozen base: with weights (save_pretrained) they are "
        "loaded, with only a config.json the base is built from it and initialised from run.seed",
    )
    weights: str = setting(
        "auto",
        "auto: load the folder's weights when it has them; init: always initialise the base from run.seed",
        choices=("auto", "init"),
    )
    lora_rank: int = setting(8, "r, the rank of each adapter (A is r x d_in, B is d_out x r)", at_least=1)
    lora_alpha: float = setting(16.0, "the adapters' output is scaled by lora_alpha / lora_rank", above=0)
    lora_targets: str = setting(
        "q_proj,v_proj", "comma-separated names of the linear layers that get adapters (PEFT's target_modules)"
    )
    lora_dropout: float = setting(0.0, "dropout on each adapter's input (a Dropout module)", at_least=0, below=1)


def build(model_config, vocab_size: int, *, seq_len: int, seed: int) -> HFCausalLM:
    from peft import LoraConfig, get_peft_model  # imported here: only this fork needs PEFT
    from peft.tuners.lora import Linear as LoRALinear

    base = build_base(model_config, vocab_size, seq_len=seq_len, seed=seed)
    own = model_config.own
    lora = LoraConfig(
        r=own.lora_rank,
        lora_alpha=own.lora_alpha,
        target_modules=[name.strip() for name in own.lora_targets.split(",") if name.strip()],
        lora_dropout=own.lora_dropout,
        bias="none",
    )
    # Every nn.Linear gets PEFT's own LoRA layer straight away, before PEFT asks its quantisation back-ends
    # whether they own the layer: its torchao back-end raises ImportError when torchao < 0.16 is installed, as
    # requirements-cards.txt pins it for torchtune. The layer is the one PEFT's default would choose.
    lora._register_custom_module({torch.nn.Linear: LoRALinear})
    linear_names = {name.rsplit(".", 1)[-1] for name, module in base.hf.named_modules() if type(module) is nn.Linear}
    unknown = set(lora.target_modules) - linear_names
    if unknown or not lora.target_modules:
        raise ConfigError(
            f"model.lora_targets: {', '.join(sorted(unknown)) or 'none given'} not among the base model's linear "
            f"layers ({', '.join(sorted(linear_names))}); name some of them, comma-separated"
        )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed + 1)  # PEFT draws A from the global generator: another stream than the base's
        # PEFT 0.21 asks transformers 5.24 for a deprecated attribute; the warning says nothing about this model.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(base.hf, lora)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return HFCausalLM(peft_model, f"LoRA r {own.lora_rank} on {own.lora_targets} ({trainable:,} train), {base.source}")


# The base folder's fingerprint: the adapters' settings are own keys, compared on resume as they are.
register_model(
    "hf-lora",
    build,
    settings=LoRASettings,
    fingerprint=base_fingerprint,
    check=check_folder,
    generic_keys=(),
    generic_keys_note="its size comes from config.json in model.path, and its dropout from that file's *_pdrop / "
    "*_dropout entries and model.lora_dropout",
)
