"""Every key of every config section, declared once: its default, its unit, a help string and the values it
allows (docs/training.md, "Configuration")."""

from dataclasses import dataclass, field


# The own settings of the model (or data source) a config chooses, or None (accumulation/config/config.py).
def own_settings():
    return field(default=None, metadata={"own": True})


def setting(default, help, unit="", *, choices=None, at_least=None, above=None, at_most=None, below=None):
    """Declare one config key: its default, help text, unit ("" when it has none) and allowed values. A string
    key whose default is "" accepts "" (meaning none); every other string key needs a non-empty value."""
    return field(
        default=default,
        metadata={
            "help": help,
            "unit": unit,
            "choices": choices,
            "at_least": at_least,
            "above": above,
            "at_most": at_most,
            "below": below,
        },
    )


# Types are written as real classes (no `from __future__ import annotations`): the checks read them.
@dataclass(frozen=True)
class RunConfig:
    name: str = setting("default", "name of the run; the run directory is <out_dir>/<name>/")
    out_dir: str = setting("runs", "folder that holds one directory per run")
    seed: int = setting(
        1337, "one seed for initialisation, data order and everything random", at_least=0, at_most=2**32 - 1
    )
    max_steps: int = setting(
        600,
        "optimizer step attempts (accumulation groups) over the whole run, resumes included; "
        "0 builds everything, writes the initial checkpoint and exits",
        "steps",
        at_least=0,
    )
    log_every: int = setting(20, "print a progress line every this many steps", "steps", at_least=1)
    checkpoint_every: int = setting(
        200, "write a checkpoint every this many steps (and always at the end)", "steps", at_least=1
    )
    eval_every: int = setting(
        200, "validation loss every this many steps; 0 = only the final one (docs/training.md)", "steps", at_least=0
    )
    resume: str = setting(
        "auto",
        "auto: continue from <run_dir>/checkpoints/latest.pt if it exists; never: start afresh (docs/training.md)",
        choices=("auto", "never"),
    )
    keep_checkpoints: int = setting(
        3,
        "newest checkpoints kept (step_*.pt files and step_*.dcp folders, counted together); older ones are deleted",
        "checkpoints",
        at_least=1,
    )
    sharded_save: str = setting(
        "staged",
        "sharded checkpoints (fsdp2, pipeline stages): staged (in the background from a host copy of the rank's "
        "shards, 12/D bytes per parameter with AdamW), overlapped (from the live shards while the next forward and "
        "backward run, no copy; that step's update waits for the write), at_once (no copy; training waits) "
        "(docs/sharding.md)",
        choices=("staged", "overlapped", "at_once"),
    )
    sample_bytes: int = setting(
        200, "tokens sampled at the end after a training prompt; 0 = none (docs/training.md)", "tokens", at_least=0
    )


@dataclass(frozen=True)
class BatchConfig:
    global_batch_size: int = setting(
        32, "examples per step over all ranks: micro_batch_size x accumulation steps x ranks", "examples", at_least=1
    )
    micro_batch_size: int = setting(
        4, "examples per forward/backward on one rank; accumulation steps are derived", "examples", at_least=1
    )
    tail: str = setting(
        "drop", "an epoch's last, incomplete global batch: drop it, or a partial step", choices=("drop", "partial")
    )
    on_oom: str = setting(
        "fail",
        "when a step runs out of GPU memory: fail, or shrink micro_batch_size, A grown to match (docs/performance.md)",
        choices=("fail", "shrink"),
    )
    on_inexact: str = setting(
        "warn",
        "a model or loss that couples examples (BatchNorm), found at step 0 (docs/forking.md): warn, or error (exit 2)",
        choices=("warn", "error"),
    )


@dataclass(frozen=True)
class DataConfig:
    source: str = setting(
        "stdlib",
        '"stdlib" (the embedded corpus), a registered source or "module:name", or a path: text, JSONL or token files '
        "(docs/data.md)",
    )
    seq_len: int = setting(128, "tokens per row (context length)", "tokens", at_least=1)
    val_fraction: float = setting(
        0.01, "share of text or JSONL held out for validation; 0 = no validation", "fraction", at_least=0, below=1
    )
    layout: str = setting(
        "auto",
        "documents: one per row, padded; packed: concatenated into full rows; auto: packed for token files only",
        choices=("auto", "documents", "packed"),
    )
    tokenizer: str = setting(
        "bytes", 'how text becomes tokens: "bytes" (UTF-8, vocabulary 256) or a tokenizer.json path (docs/data.md)'
    )
    task: str = setting(
        "next-token",
        "next-token: each position predicts the next token; masked: token files only, 15% of positions masked afresh "
        "every step and only those supervised (docs/data.md)",
        choices=("next-token", "masked"),
    )
    val_rows: int = setting(
        1024, "validation rows read at most, evenly spaced over the split; 0 = every row", "rows", at_least=0
    )
    own: object = own_settings()  # the keys of a registered data source (accumulation/config/registry.py)


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting(
        "gpt", 'the architecture: "gpt", "gru", "encoder", or a fork\'s "module:name" (docs/forking.md)'
    )
    # At most 1024: the start-up checks build the model on the meta device, in time proportional to its modules.
    n_layer: int = setting(4, "transformer blocks (gpt) or GRU layers (gru)", "layers", at_least=1, at_most=1024)
    n_head: int = setting(4, "attention heads per block; must divide d_model (gpt only)", "heads", at_least=1)
    d_model: int = setting(128, "the model's width: residual stream (gpt), hidden state (gru)", "features", at_least=1)
    vocab_size: int = setting(
        0, "0 = from the data (bytes: 256); else the vocabulary size, at least the data's", "tokens", at_least=0
    )
    dropout: float = setting(0.0, "dropout probability during training", "probability", at_least=0, below=1)
    compile: str | bool = setting(
        "auto",
        "torch.compile the model and the loss (DDP only); auto = on for CUDA, off on the CPU and with "
        "dist.strategy=fsdp2",
        choices=("auto", True, False),
    )
    loss: str = setting(
        "auto",
        "the token cross-entropy SUM, the same either way: plain = all logits at once; chunked = the output head a "
        "chunk of positions at a time (gpt; dist.strategy=ddp); auto = chunked on CUDA when the logits would take "
        "over a quarter of the free memory (docs/performance.md)",
        choices=("auto", "chunked", "plain"),
    )
    objective: str = setting(
        "", 'the loss: "" = the model\'s own, or a registered loss\'s name or "module:name" (docs/forking.md)'
    )
    own: object = own_settings()  # the chosen model's own keys (accumulation/config/registry.py)


@dataclass(frozen=True)
class OptimConfig:
    name: str = setting("adamw", "the optimizer", choices=("adamw", "sgd"))
    lr: float = setting(3e-3, "peak learning rate, reached at the end of warm-up", above=0)
    weight_decay: float = setting(0.1, "decoupled weight decay (AdamW) or L2 penalty (SGD)", at_least=0)
    momentum: float = setting(0.9, "SGD momentum, and AdamW beta1", at_least=0, below=1)
    beta2: float = setting(0.95, "AdamW beta2 (ignored by SGD)", above=0, below=1)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = no clipping", "L2 norm", at_least=0)
    on_nonfinite: str = setting(
        "skip", "when a step's gradients hold inf or nan: skip its update, or stop the run", choices=("skip", "stop")
    )
    max_consecutive_skips: int = setting(20, "stop the run after this many skipped steps in a row", "steps", at_least=1)


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = setting(
        "cosine", "learning-rate shape after warm-up: cosine decay or constant", choices=("cosine", "constant")
    )
    warmup_updates: int = setting(30, "linear warm-up to optim.lr over this many updates", "updates", at_least=0)
    decay_updates: int = setting(
        0, "the cosine horizon; 0 = run.max_steps, which a resume may raise (docs/training.md)", "updates", at_least=0
    )
    min_lr_ratio: float = setting(0.1, "the cosine floor", "fraction of optim.lr", at_least=0, at_most=1)


@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = setting(
        "fp32", "autocast dtype of the forward; parameters and gradients stay fp32", choices=("fp32", "bf16", "fp16")
    )
    grad_scaler: str | bool = setting(
        "auto", "scale the loss against fp16 underflow; auto = on for fp16 only", choices=("auto", True, False)
    )
    tf32: bool = setting(
        True,
        "CUDA only: fp32 matrix products and convolutions on TF32 tensor cores (10-bit mantissa inputs); the checker "
        "turns it off",
    )


@dataclass(frozen=True)
class DistConfig:
    timeout_s: int = setting(300, "how long a collective may wait for the other ranks", "seconds", at_least=1)
    strategy: str = setting(
        "ddp",
        "ddp: each rank holds the whole model, gradients and optimizer state; fsdp2: all three sharded; the same "
        "step either way (docs/sharding.md)",
        choices=("ddp", "fsdp2"),
    )
    pipeline_stages: int = setting(
        1,
        "P: pipeline stages the model is cut into, one per rank; D = world size / P replicas (docs/pipeline.md)",
        "stages",
        at_least=1,
    )
    pipeline_schedule: str = setting(
        "1f1b",
        "with dist.pipeline_stages > 1: 1f1b (one forward, one backward; needs A >= P) or gpipe (docs/pipeline.md)",
        choices=("1f1b", "gpipe"),
    )


@dataclass(frozen=True)
class LogConfig:
    sinks: str = setting(
        "tensorboard,jsonl",
        'where each step\'s record goes, comma-separated: "tensorboard", "jsonl" (metrics.jsonl), "wandb", "mlflow" '
        '(pip install -r requirements-loggers.txt), or a fork\'s registered sink, "module:name" (docs/training.md)',
    )
    peak_tflops: float = setting(
        0.0,
        "one device's peak for MFU at the run's precision; 0 = the data sheet's dense peak of a known GPU, else no MFU",
        "TFLOPS",
        at_least=0,
    )
