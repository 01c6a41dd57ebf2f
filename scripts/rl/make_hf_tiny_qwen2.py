"""Write data/hf_tiny_qwen2/: the local folder of configs/grpo_hf.toml's Hugging Face policy, a tiny Qwen2
(config.json: 2 layers, hidden 64, built and initialised from run.seed by forks/hf_causal_lm.py) and its tokenizer
(tokenizer.json), a BPE trained with the `tokenizers` package on the task's text. Nothing is downloaded.

The tokenizer: every digit and the newline is a token of its own (a pre-tokenizer splits them out), so a number is
written digit by digit and "\\n", the stop token, is never merged into an answer; BPE merges the rest of the text
of every "Q: a + b = s" line (a, b < 40) into its frequent pieces ("Q: ", " + ", " =" and " = "). " = " spans the
prompt and its answer: the prompt "Q: 3 + 4 =" ends in the token " =" and its answer " 7\\n" starts with " ", so a
row tokenised whole differs from the prompt and the answer tokenised apart, which is what the sampler writes
(accumulation/rl/task.py tokenises them apart). "-" and "*" are in its alphabet too, for data/sft_arithmetic.jsonl.
The model's vocabulary is the tokenizer's, exactly.

    python scripts/rl/make_hf_tiny_qwen2.py          # rewrites both files byte for byte
"""

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from accumulation.rl.task import addition_problems

MAX_OPERAND = 40  # the task of configs/grpo_hf.toml
MAX_VOCABULARY = 64  # BPE stops earlier, when no pair is left to merge


def task_tokenizer(max_operand: int = MAX_OPERAND) -> Tokenizer:
    """A BPE over the characters of every 'Q: a + b = s' line (a, b < max_operand), digits and newlines unmerged."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d|\n"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # the tokens' text joined as it is, no space added between them
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCABULARY, min_frequency=2, initial_alphabet=list("0123456789\n -*"), show_progress=False
    )
    lines = [prompt + response for prompt, response in addition_problems(max_operand)]
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def model_config(vocab_size: int) -> dict:
    """A Qwen2 of 2 layers, hidden 64, 4 heads sharing 2 key-value heads, 64 positions."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
        "max_window_layers": 2,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def write_folder(folder: Path) -> int:
    """tokenizer.json and config.json in `folder`; the vocabulary's size."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = task_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"), pretty=True)
    config = model_config(tokenizer.get_vocab_size())
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return tokenizer.get_vocab_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/hf_tiny_qwen2")
    args = parser.parse_args()
    vocabulary = write_folder(Path(args.out))
    print(f"{args.out}: tokenizer.json ({vocabulary} tokens) and config.json (qwen2)")


if __name__ == "__main__":
    main()
