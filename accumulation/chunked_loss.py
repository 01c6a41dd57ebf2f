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
import torch.distributed as dist

from accumulation.batching import IGNORE_INDEX, collective_device

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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    grad_weight: torch.Tensor | None,
    with_gradients: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S of one chunk and, when asked, ∂S/∂H [P, d] in the compute dtype; ∂S/∂W [V, d] is added into `grad_weight`
    (the fp32 accumulator over chunks) when one is given (see the module's maths).

    `hidden` and `weight` are already in the compute dtype; nothing here depends on autocast."""
    softmax_dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(softmax_dtype)  # Z; under torch.compile the cast fuses into its readers
    supervised = labels != IGNORE_INDEX
    targets = labels.masked_fill(~supervised, 0)  # any valid index; those rows are masked out below
    log_normaliser = torch.logsumexp(logits, dim=1)  # logsumexp(Z_i)
    target_logits = logits.gather(1, targets[:, None])[:, 0]  # Z_{i, y_i}
    loss_sum = ((log_normaliser - target_logits) * supervised).sum()
    if not with_gradients:
        return loss_sum, None
    # ∂S/∂Z = softmax(Z) - onehot(y), rows without a target zeroed, in place over the fp32 logits.
    probabilities = logits.sub_(log_normaliser[:, None]).exp_()
    if torch.compiler.is_compiling():
        # Compiled: one pointwise expression of Z, its row's logsumexp and its target, where(j == y_i, p_ij - 1,
        # p_ij) · supervised_i, which Inductor fuses into one kernel that reads the logits once and writes only the
        # compute-dtype gradient. (A scatter is not pointwise: Inductor wrote the fp32 probabilities whole, then
        # scattered into them, then cast them, three passes over [P, V] and an fp32 [P, V] buffer.)
        is_target = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
        grad_logits = probabilities.add_(is_target, alpha=-1)
    else:
        # Eager: each operation is a pass over [P, V]; the scatter of -1 touches the P targets only, where the
        # pointwise form would add two passes (the comparison, the subtraction). The same bits either way.
        grad_logits = probabilities.scatter_add_(1, targets[:, None], -torch.ones_like(log_normaliser[:, None]))
    grad_logits = grad_logits.mul_(supervised[:, None]).to(hidden.dtype)
    if grad_weight is not None:
        add_product_into(grad_weight, grad_logits.T, hidden)  # ∂S/∂W += (∂S/∂Z)ᵀ H
    return loss_sum, grad_logits @ weight


def add_product_into(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """accumulator += left @ right, with no product-sized temporary where PyTorch allows it.

    Same dtypes (fp32 or float64 compute): addmm_ adds the product into the accumulator in place. A bf16/fp16
    product into the fp32 accumulator: on CUDA, addmm's out_dtype variant multiplies in the compute dtype and
    accumulates straight into fp32 (cuBLAS's beta = 1); elsewhere that variant does not exist (PyTorch 2.13's
    CPU backend lacks it), so the product is formed in the compute dtype and then added."""
    if accumulator.dtype == left.dtype:
        accumulator.addmm_(left, right)
    elif accumulator.is_cuda:
        torch.addmm(accumulator, left, right, out_dtype=accumulator.dtype, out=accumulator)
    else:
        accumulator += left @ right


class LinearCrossEntropySum(torch.autograd.Function):
    """S = Σ cross_entropy(hidden Wᵀ, labels) over supervised positions, its gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_positions, with_gradients):
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
                chunk_sum, chunk_grad_hidden = chunk_loss_and_gradients(
                    hidden[chunk].to(compute_dtype), weight_compute, labels[chunk], grad_weight, with_gradients
                )
                loss_sum += chunk_sum
                if grad_hidden is not None:
                    grad_hidden[chunk] = chunk_grad_hidden
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
        )


class ChunkedCrossEntropySum:
    """loss_sum_fn(hidden_states, labels) -> S for a model whose outputs are its final hidden states.

    `output_head` is the model's bias-free nn.Linear from hidden states to logits (the GPT's lm_head); its weight
    gets its gradient from this loss. `chunk_positions` defaults to positions_per_chunk(vocab). Under
    model.compile it is compiled with the model, in one region (accumulation/models/forward_and_loss.py)."""

    def __init__(self, output_head: torch.nn.Linear, chunk_positions: int | None = None):
        if output_head.bias is not None:
            raise ValueError("the chunked loss takes an output head without bias")
        self.output_head = output_head
        self.chunk_positions = chunk_positions or positions_per_chunk(output_head.out_features)

    def __call__(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        labels = labels.reshape(-1).to(hidden.device)
        weight = self.output_head.weight
        # No gradients in validation (torch.no_grad) or for frozen inputs: then the chunks compute S alone.
        with_gradients = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        return LinearCrossEntropySum.apply(hidden, weight, labels, self.chunk_positions, with_gradients)


class FinalHiddenStates(torch.nn.Module):
    """The module the step runs with the chunked loss: `model.hidden_states(inputs)`, the output head left to the
    loss. It holds `model` (the same parameters), so DDP or torch.compile wrap it as they would the model;
    the model itself, its forward (logits) and its checkpoints are unchanged."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_states(inputs)


# model.loss = "auto"'s rule on CUDA (accumulation/models/factory.py, decided_model_config; on the CPU auto is plain).
# At its peak the plain loss holds about three fp32 copies of the logits [m·T, V]: the fp32 logits cross-entropy
# reads, the log-softmax it keeps for the backward, and their gradient (plus bf16 copies under autocast). The chunked
# loss holds one chunk's (CHUNK_LOGIT_BYTES).
PLAIN_LOSS_FP32_LOGIT_COPIES = 3
# When those copies would take more than this share of the memory free at start-up, auto chooses the chunked loss:
# the rest is left for the weights' gradients, the optimizer's moments and the activations of m rows. Below it the
# plain loss is kept (the chunks' smaller products cost time, scripts/benchmarks/bench_loss.py, and the plain loss
# is the one a reader knows).
PLAIN_LOSS_SHARE_OF_FREE_MEMORY = 0.25


def plain_loss_bytes(positions: int, vocab_size: int) -> int:
    """The plain loss's logit buffers at its peak, in bytes: 3 fp32 copies of [positions, vocab]."""
    return PLAIN_LOSS_FP32_LOGIT_COPIES * 4 * positions * vocab_size


def chunked_loss_pays(positions: int, vocab_size: int, free_bytes: int) -> bool:
    """Chunked when the plain loss's logit buffers at m·T = `positions` would take more than a quarter of
    `free_bytes`."""
    return plain_loss_bytes(positions, vocab_size) > PLAIN_LOSS_SHARE_OF_FREE_MEMORY * free_bytes


def chunked_loss_pays_on_cuda(positions: int, vocab_size: int, device: torch.device) -> bool:
    """chunked_loss_pays against the GPU's free memory now (torch.cuda.mem_get_info); under torch.distributed the
    least free memory of all ranks, so that every rank runs the same loss."""
    free = torch.tensor(torch.cuda.mem_get_info(device)[0], dtype=torch.int64)
    if dist.is_initialized():
        free = free.to(collective_device(device))
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return chunked_loss_pays(positions, vocab_size, int(free))
