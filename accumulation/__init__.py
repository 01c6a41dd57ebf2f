"""accumulation: a plain PyTorch DDP training loop that gets gradient accumulation exactly right."""
