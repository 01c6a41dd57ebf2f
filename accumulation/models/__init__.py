"""The models train.py can build: the GPT (gpt.py), the GRU (gru.py), the encoder for the masked LM (encoder.py),
the factory that builds one from `model.*` settings (factory.py), and the forward and the loss as one module for
model.compile (forward_and_loss.py). They may import the maths at the top of the package (the loss sums) and
config/, never data/, parallel/ or run/: a model knows nothing of how its rows arrive or how many ranks there are."""
