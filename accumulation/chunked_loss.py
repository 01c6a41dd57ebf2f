"""The output head and the token cross-entropy SUM, a chunk of positions at a time: the same S, less memory.

The plain loss builds the logits of every position of the micro-batch at once: [rows·seq_len, vocab] values,
kept for the backward with their fp32 copy and their gradient. With GPT-2's vocabulary (50,304) and m = 16
rows of 1024 tokens that is 0.8 G logits, 3.3 GB in fp32 alone: the largest tensors of the whole step.

Here the positions are cut into chunks of P. For one chunk with hidden states H [P, d], output weight W
[V, d] and targets y:

    logits  Z = H Wᵀ                                  [P, V]  (the compute dtype: bf16 under bf16 autocast)
    S_chunk = Σ_i (logsumexp(Z_i) - Z_{i, y_i})       over supervised positions i (y_i != -100), in fp32
    ∂S/∂Z   = softmax(Z) - onehot(y)                  row i zero where y_i = -100
    ∂S/∂H   = (∂S/∂Z) W                               [P, d]
    ∂S/∂W   = (∂S/∂Z)ᵀ H                              [V, d], summed over chunks in fp32

All of this happens in the forward, chunk after chunk, so only one chunk's logits are ever alive, and the
backward has nothing to recompute: S is a scalar, so its gradient is the saved ∂S/∂H and ∂S/∂W times the
scalar that reaches it (the step's D/N, times the GradScaler's scale). The FLOPs are those of the plain
loss: one product for the logits, two for the gradients; none is repeated. The price: ∂S/∂W (one fp32
copy of the output weight) and ∂S/∂H (one value per hidden state) are held from the forward to the backward.

The sum S is the one the plain loss returns, to fp32 rounding (the chunks add their sums in another order).
Matrix products run in the autocast dtype when autocast is on, as PyTorch runs the plain head's forward and
backward there; the softmax and the sums are fp32 (float64 stays float64), as autocast runs cross_entropy.
"""

import torch

from accumulation.batching import IGNORE_INDEX

# Positions per chunk are chosen so one chunk's fp32 logits take about this many bytes: 256 MiB keeps the chunk's
# working set (fp32 logits, their compute-dtype copy and gradient) near half a GiB at any vocabulary, while each
# matrix product still has thousands of rows (1,334 at V = 50,304), enough to keep a GPU's matrix units busy.
CHUNK_LOGIT_BYTES = 256 * 2**20


def positions_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


def compute_dtype_of(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the matrix products run in: autocast's when it is on for this device type, else the input's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def chunk_loss_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, with_gradients: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """S of one chunk and, when asked, ∂S/∂H [P, d] and ∂S/∂W [V, d] in the compute dtype (see the module's maths).

    `hidden` and `weight` are already in the compute dtype; nothing here depends on autocast."""
    softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(softmax_dtype)  # Z, one fp32 copy (the compute-dtype product is freed)
    supervised = labels != IGNORE_INDEX
    targets = labels.masked_fill(~supervised, 0)  # any valid index; those rows are masked out below
    log_normaliser = torch.logsumexp(logits, dim=1)  # logsumexp(Z_i)
    target_logits = logits.gather(1, targets[:, None])[:, 0]  # Z_{i, y_i}
    loss_sum = ((log_normaliser - target_logits) * supervised).sum()
    if not with_gradients:
        return loss_sum, None, None
    # softmax(Z) - onehot(y), in place over the logits (no second [P, V] fp32 tensor); unsupervised rows zeroed.
    grad_logits = logits.sub_(log_normaliser[:, None]).exp_()
    grad_logits.scatter_add_(1, targets[:, None], -torch.ones_like(log_normaliser[:, None]))
    grad_logits.mul_(supervised[:, None])
    grad_logits = grad_logits.to(hidden.dtype)
    return loss_sum, grad_logits @ weight, grad_logits.T @ hidden


class LinearCrossEntropySum(torch.autograd.Function):
    """S = Σ cross_entropy(hidden Wᵀ, labels) over supervised positions, its gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_positions, chunk_fn, with_gradients):
        compute_dtype = compute_dtype_of(hidden)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit below
            weight_compute = weight.to(compute_dtype)  # cast once, not once per chunk
            loss_sum = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
            # ctx.needs_input_grad says what requires a gradient even under torch.no_grad(); with_gradients
            # (from the caller, who sees the grad mode) says whether a backward can come at all.
            grad_hidden = torch.empty_like(hidden) if with_gradients and ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros_like(weight) if with_gradients and ctx.needs_input_grad[1] else None
            for start in range(0, hidden.shape[0], chunk_positions):
                chunk = slice(start, start + chunk_positions)
                chunk_sum, chunk_grad_hidden, chunk_grad_weight = chunk_fn(
                    hidden[chunk].to(compute_dtype), weight_compute, labels[chunk], with_gradients
                )
                loss_sum += chunk_sum
                if grad_hidden is not None:
                    grad_hidden[chunk] = chunk_grad_hidden
                if grad_weight is not None:
                    grad_weight += chunk_grad_weight
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss_sum):
        # S is a scalar: its gradients are the saved ones times the scalar that reaches S (D/N times the scale).
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss_sum.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_loss_sum.to(grad_weight.dtype),
            None,
            None,
            None,
            None,
        )


class ChunkedCrossEntropySum:
    """loss_sum_fn(hidden_states, labels) -> S for a model whose outputs are its final hidden states.

    `output_head` is the model's bias-free nn.Linear from hidden states to logits (the GPT's lm_head); its weight
    gets its gradient from this loss. `chunk_positions` defaults to positions_per_chunk(vocab). `compile`
    compiles the per-chunk work (model.compile): its softmax, mask and casts fuse into a few kernels."""

    def __init__(self, output_head: torch.nn.Linear, chunk_positions: int | None = None, compile: bool = False):
        if output_head.bias is not None:
            raise ValueError("the chunked loss takes an output head without bias")
        self.output_head = output_head
        self.chunk_positions = chunk_positions or positions_per_chunk(output_head.out_features)
        # dynamic=True: the last chunk of a micro-batch is shorter; one compiled kernel serves every length.
        self.chunk_fn = torch.compile(chunk_loss_and_gradients, dynamic=True) if compile else chunk_loss_and_gradients

    def __call__(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        labels = labels.reshape(-1).to(hidden.device)
        weight = self.output_head.weight
        # No gradients in validation (torch.no_grad) or for frozen inputs: then the chunks compute S alone.
        with_gradients = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return LinearCrossEntropySum.apply(hidden, weight, labels, self.chunk_positions, self.chunk_fn, with_gradients)


class FinalHiddenStates(torch.nn.Module):
    """The module the step runs with the chunked loss: `model.hidden_states(inputs)`, the output head left to the
    loss. It holds `model` (the same parameters), so DDP or torch.compile wrap it as they would the model;
    the model itself, its forward (logits) and its checkpoints are unchanged."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(inputs)
