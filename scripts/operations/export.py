"""A trained run as a Hugging Face folder: python scripts/operations/export.py RUN_DIR OUT_DIR [--adapter]

    RUN_DIR   a run directory (<run.out_dir>/<run.name>, e.g. runs/default): its newest readable checkpoint
    OUT_DIR   a new (or empty) folder; it receives model.safetensors and config.json (save_pretrained), and the
              run's tokenizer file where it has one: tokenizer.json (with a tokenizer_config.json naming
              PreTrainedTokenizerFast, so AutoTokenizer loads it; for a model type whose own tokenizer class
              transformers builds instead, Qwen2's, the summary line says so and what to load) or nanoGPT's
              meta.pkl; a byte-level run has none (token id = UTF-8 byte)

The built-in GPT becomes a GPT2LMHeadModel: its architecture is GPT-2's (pre-norm blocks, learned absolute
positions, biases on every linear layer but the head, LayerNorm eps 1e-5) with two differences that the config
states: the activation is the exact (erf) GELU, `activation_function = "gelu"`, not GPT-2's tanh approximation,
and the output head is a matrix of its own, `tie_word_embeddings = False`. Its weights map one to one (GPT2_NAMES),
the linear layers' transposed (GPT-2's Conv1D stores [in, out]). A fork that wraps a Hugging Face model in `.hf`
(forks/hf_causal_lm.py) is saved as its own class; a LoRA fork (forks/hf_lora.py, PEFT) with its adapters
merged into the weights (each adapted W becomes W + (lora_alpha / r) B A), or with --adapter as PEFT's adapter
folder (adapter_config.json, adapter_model.safetensors) beside its frozen base in OUT_DIR/base/, which
PeftModel.from_pretrained puts back together. Then

    AutoModelForCausalLM.from_pretrained(OUT_DIR)

gives the logits train.py's model gives (tests/test_export.py). Everything is written to a temporary folder beside
OUT_DIR and renamed into place at the end: a failure leaves nothing. Bad input (not a run directory, no checkpoint,
a damaged one, a model with no Hugging Face class, an OUT_DIR that holds files) is one line on stderr, exit 2.
Needs transformers (pip install -r requirements-hf.txt).
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from accumulation.models.gpt import GPT
from accumulation.run.trained import TrainedRunError, load_trained_run

# Our GPT's parameter names (per block, then the rest) -> GPT2LMHeadModel's, and whether the tensor is transposed.
GPT2_BLOCK_NAMES = {
    "attn_norm.weight": ("ln_1.weight", False),
    "attn_norm.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),  # [3d, d] -> [d, 3d]; q, k, v in the same order
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "mlp_norm.weight": ("ln_2.weight", False),
    "mlp_norm.bias": ("ln_2.bias", False),
    "mlp.0.weight": ("mlp.c_fc.weight", True),
    "mlp.0.bias": ("mlp.c_fc.bias", False),
    "mlp.2.weight": ("mlp.c_proj.weight", True),
    "mlp.2.bias": ("mlp.c_proj.bias", False),
}
GPT2_NAMES = {
    "token_embedding.weight": ("transformer.wte.weight", False),
    "position_embedding.weight": ("transformer.wpe.weight", False),
    "final_norm.weight": ("transformer.ln_f.weight", False),
    "final_norm.bias": ("transformer.ln_f.bias", False),
    "lm_head.weight": ("lm_head.weight", False),
}


class ExportError(ValueError):
    """Bad input: one line."""


def gpt2_state_dict(state: dict, n_layer: int) -> dict[str, torch.Tensor]:
    names = dict(GPT2_NAMES)
    for index in range(n_layer):
        for ours, (theirs, transposed) in GPT2_BLOCK_NAMES.items():
            names[f"blocks.{index}.{ours}"] = (f"transformer.h.{index}.{theirs}", transposed)
    return {
        theirs: state[ours].t().contiguous() if transposed else state[ours]
        for ours, (theirs, transposed) in names.items()
    }


def as_gpt2(model: GPT, dropout: float):
    """A GPT2LMHeadModel holding the GPT's weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = model.config
    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.seq_len,
        n_embd=config.d_model,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=4 * config.d_model,
        activation_function="gelu",  # nn.GELU(): the exact erf form
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=False,  # lm_head is a matrix of its own
        bos_token_id=None,  # GPT-2's 50256 is no token of this vocabulary
        eos_token_id=None,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(gpt2_state_dict(model.state_dict(), config.n_layer))  # strict: every name mapped
    return hf_model


def save_model(run, folder: Path, adapter: bool) -> str:
    """The run's model saved into `folder` by transformers' (or PEFT's) save_pretrained; what it was saved as. An
    ExportError before anything is written when the model has no Hugging Face class (or no adapters, --adapter)."""
    from transformers import PreTrainedModel

    wrapped = run.model if isinstance(run.model, GPT) else getattr(run.model, "hf", None)
    is_lora = hasattr(wrapped, "merge_and_unload")  # a PEFT model (forks/hf_lora.py)
    if adapter and not is_lora:
        raise ExportError(f"--adapter: model.name={run.config.model.name} has no LoRA adapters; leave --adapter out")
    if isinstance(wrapped, GPT):
        wrapped = as_gpt2(run.model, run.config.model.dropout)
    elif is_lora and adapter:
        wrapped.save_pretrained(folder)  # adapter_config.json and adapter_model.safetensors: A and B only
        base = wrapped.unload()  # the frozen base, the adapters taken out unmerged
        base.save_pretrained(folder / "base")  # a base built from run.seed exists only in the checkpoint
        return f"a LoRA adapter, its frozen {type(base).__name__} base in base/"
    elif is_lora:
        wrapped = wrapped.merge_and_unload()  # each adapted W becomes W + (lora_alpha / r) B A
    elif not isinstance(wrapped, PreTrainedModel):
        raise ExportError(
            f"model.name={run.config.model.name} has no Hugging Face class to export to: export.py writes the "
            f"built-in gpt (as GPT2LMHeadModel) and forks that keep a transformers model in `.hf` "
            f"(forks/hf_causal_lm.py; forks/hf_lora.py's adapters merged, or with --adapter apart)"
        )
    wrapped.save_pretrained(folder)
    return type(wrapped).__name__ + (", the LoRA adapters merged into its weights" if is_lora else "")


def write_tokenizer(tokenizer, folder: Path) -> str:
    """The run's tokenizer files into `folder`; what was written, for the summary line."""
    if tokenizer is None or not tokenizer.files:
        return "no tokenizer file (bytes: token id = UTF-8 byte)" if tokenizer is not None else "no tokenizer"
    source = Path(tokenizer.files[0])
    if source.suffix == ".json":
        shutil.copyfile(source, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        return f"tokenizer.json from {source}" + auto_tokenizer_caveat(tokenizer, folder)
    shutil.copyfile(source, folder / source.name)
    return f"{source.name} from {source.parent}"


def auto_tokenizer_caveat(tokenizer, folder: Path) -> str:
    """ "" when AutoTokenizer.from_pretrained(folder) encodes as the run did; else what to load instead. For some
    model types (Qwen2 in transformers 5.24) AutoTokenizer builds that type's own tokenizer class, which keeps only
    tokenizer.json's vocabulary and merges and puts its own pre-tokenizer in front, whatever tokenizer_config.json
    names: the probe, every token of the vocabulary in one text, shows it."""
    from transformers import AutoTokenizer

    probe = tokenizer.decode(list(range(tokenizer.vocab_size)))
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if loaded(probe, add_special_tokens=False)["input_ids"] == tokenizer.encode(probe):
        return ""
    return (
        f"; AutoTokenizer.from_pretrained(OUT_DIR) gives {type(loaded).__name__}, which encodes otherwise than the "
        f"run (its own pre-tokenizer): load PreTrainedTokenizerFast(tokenizer_file=OUT_DIR/tokenizer.json) instead"
    )


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"OUT_DIR {out_dir} exists and is not an empty folder; give a new folder")
    if not out_dir.parent.is_dir():
        raise ExportError(f"OUT_DIR {out_dir}: its parent folder {out_dir.parent} does not exist")


def export(run_dir: Path, out_dir: Path, adapter: bool = False) -> str:
    """Write the Hugging Face folder; returns the summary line."""
    check_out_dir(out_dir)
    try:
        import transformers  # checked here, before the checkpoint is read
    except ImportError:
        raise ExportError("export.py needs transformers: pip install -r requirements-hf.txt") from None
    transformers.utils.logging.disable_progress_bar()  # stderr keeps to errors
    run = load_trained_run(run_dir)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    try:
        kind = save_model(run, staging, adapter)
        tokenizer = write_tokenizer(run.tokenizer, staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty (check_out_dir): the rename takes its place
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return f"exported {run.checkpoint} (step {run.steps}) to {out_dir} as {kind}; {tokenizer}"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    paths = [argument for argument in argv if argument != "--adapter"]
    if len(paths) != 2 or any(argument.startswith("-") for argument in paths):
        print(
            f"error: expected RUN_DIR OUT_DIR [--adapter], got {' '.join(argv) or 'nothing'}; --help says more",
            file=sys.stderr,
        )
        return 2
    try:
        print(export(Path(paths[0]), Path(paths[1]), adapter="--adapter" in argv))
    except (ExportError, TrainedRunError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
