"""Worked forks, each one file that registers its pieces and one config in configs/ (docs/forking.md):
image_classifier.py (float images with augmentation, a GroupNorm CNN), hf_causal_lm.py (a Hugging Face
causal language model), hf_lora.py (LoRA adapters on it through PEFT) and cispo.py (a GRPO-family loss for
configs/grpo.toml, named by data.policy_loss). A config names a fork's piece by import path, e.g.
`model.name = "forks.image_classifier:small-cnn"`."""
