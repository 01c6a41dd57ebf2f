"""The gradient noise scale B_simple, measured from the micro-batches that accumulation already runs.

McCandlish et al. (2018, *An Empirical Model of Large-Batch Training*) model the gradient of a batch of B
independent samples as the true gradient G plus noise of covariance Σ / B, where Σ is the covariance of one
sample's gradient. The expected squared norm of a batch gradient g_B is then

    E |g_B|² = |G|² + tr(Σ) / B,

and the simple noise scale B_simple = tr(Σ) / |G|² is the batch size at which the noise term equals the
signal: below it a larger batch saves updates almost one for one, above it the savings fade. Their appendix A
measures it from two batch sizes B_small < B_big; solving the two expectations for the two unknowns gives
unbiased estimates

    |G|² ≈ (B_big · |g_big|² − B_small · |g_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1 / B_small − 1 / B_big).

Accumulation holds both for free: micro-batch k of a step is a small batch (its own token mean, ∇S_k / N_k,
B_small = N_k supervised tokens) and the step's whole gradient a big one (∇(Σ_k S_k) / N, B_big = N). Each
(micro-batch, step) pair gives one unbiased estimate of each; single estimates are very noisy and the ratio of
two noisy numbers is biased, so the paper averages numerator and denominator over many steps first and takes
the ratio of the averages. The unit of B is the unit the loss is normalised by: supervised tokens here, each
treated as one sample (tokens of one row are correlated, so this is an effective count).

Not imported by train.py: scripts/teaching/noise_scale.py uses it, with accumulation.step.optimizer_step.
"""

import math

import torch


class NoiseScale:
    """Running averages of the unbiased |G|² and tr(Σ) estimates, and their ratio B_simple (in the loss's unit)."""

    def __init__(self):
        self.gradient_squared_sum = 0.0  # Σ over pairs of the |G|² estimates
        self.trace_sum = 0.0  # Σ over pairs of the tr(Σ) estimates, per unit of the batch (per token)
        self.pairs = 0  # (micro-batch, step) pairs that gave an estimate

    def add_step(
        self,
        micro_batch_squared_norms: list[float],
        micro_batch_tokens: list[int],
        step_squared_norm: float,
        step_tokens: int,
    ) -> float:
        """One step: |g_k|² of each micro-batch's own mean gradient with its N_k, and |g|² of the step's gradient
        with its N. Returns the running B_simple."""
        for small_squared_norm, small_tokens in zip(micro_batch_squared_norms, micro_batch_tokens, strict=True):
            # A micro-batch without a supervised token has no mean gradient; one holding all of the step's tokens
            # (A = 1) is the big batch itself, and two equal sizes determine nothing.
            if small_tokens == 0 or small_tokens >= step_tokens:
                continue
            self.gradient_squared_sum += (step_tokens * step_squared_norm - small_tokens * small_squared_norm) / (
                step_tokens - small_tokens
            )
            self.trace_sum += (small_squared_norm - step_squared_norm) / (1 / small_tokens - 1 / step_tokens)
            self.pairs += 1
        return self.b_simple

    @property
    def gradient_squared(self) -> float:
        """The estimate of |G|², the true gradient's squared norm."""
        return self.gradient_squared_sum / self.pairs if self.pairs else math.nan

    @property
    def trace(self) -> float:
        """The estimate of tr(Σ), the variance of one token's gradient summed over the parameters."""
        return self.trace_sum / self.pairs if self.pairs else math.nan

    @property
    def b_simple(self) -> float:
        """tr(Σ) / |G|² from the averages; infinite while the averaged |G|² is not yet above zero (the noise
        still swamps the signal: more steps needed), nan before any estimate."""
        if not self.pairs:
            return math.nan
        return self.trace / self.gradient_squared if self.gradient_squared > 0 else math.inf


class MicroBatchGradients:
    """The squared norms of each micro-batch's own gradient and of the step's, read off `.grad` while
    optimizer_step accumulates it (one process, fp32 without a GradScaler: the gradients as backward made them).

    A hook on each parameter runs after every backward has added into `.grad`. optimizer_step backpropagates
    S_k / N for micro-batch k (D = 1), so the hook's `.grad` minus the `.grad` it saw after the previous
    backward is ∇S_k / N, and N / N_k times that is the micro-batch's own mean gradient ∇S_k / N_k. After the
    last backward `.grad` is the step's gradient ∇(Σ_k S_k) / N, before clipping. The first backward of a step
    must find `.grad` cleared (None or zeros), as optimizer_step leaves it after each step.

    Cost: one copy of the gradients (each parameter's `.grad` after the previous backward), and per micro-batch
    and parameter one subtraction and one squared norm, kept on the device until finish_step reads them back.
    """

    def __init__(self, model: torch.nn.Module):
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Under DDP the last backward's .grad is the average over ranks, not this rank's sum.
            raise ValueError("MicroBatchGradients reads one process's gradients; run it without torchrun")
        self.previous_grads: dict[torch.Tensor, torch.Tensor] = {}  # the one copy of the gradients
        self.backwards: dict[torch.Tensor, int] = {}  # backwards seen this step, per parameter
        self.contribution_squared_norms: list[torch.Tensor] = []  # |∇S_k / N|², float64 on the device, per k
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.handles = [p.register_post_accumulate_grad_hook(self.after_backward) for p in parameters]

    def after_backward(self, parameter: torch.Tensor) -> None:
        # The hook's count of backwards is the micro-batch's index k: every parameter must receive a gradient in
        # every backward (true of the GPT; a parameter some micro-batch never reaches would shift its count).
        micro_batch = self.backwards.get(parameter, 0)
        self.backwards[parameter] = micro_batch + 1
        previous = self.previous_grads.get(parameter)
        contribution = parameter.grad if previous is None else parameter.grad - previous
        if micro_batch == len(self.contribution_squared_norms):
            self.contribution_squared_norms.append(torch.zeros((), dtype=torch.float64, device=parameter.device))
        self.contribution_squared_norms[micro_batch] += contribution.double().square().sum()
        if previous is None:
            self.previous_grads[parameter] = parameter.grad.detach().clone()
        else:
            previous.copy_(parameter.grad)

    def finish_step(self, micro_batch_tokens: list[int]) -> tuple[list[float], float]:
        """After optimizer_step, with the supervised tokens N_k of each of its micro-batches: |∇S_k / N_k|² for
        each micro-batch (0.0 where N_k = 0) and |∇(Σ_k S_k) / N|² of the step. Clears the state for the next."""
        if len(self.contribution_squared_norms) != len(micro_batch_tokens):
            raise ValueError(
                f"saw {len(self.contribution_squared_norms)} backwards this step, "
                f"but was given the tokens of {len(micro_batch_tokens)} micro-batches"
            )
        step_tokens = sum(micro_batch_tokens)
        step_squared = sum(grad.double().square().sum() for grad in self.previous_grads.values())
        # The step's one read-back: every micro-batch's squared norm and the step's, together.
        *contributions, step_squared_norm = torch.stack([*self.contribution_squared_norms, step_squared]).tolist()
        # |∇S_k / N_k|² = (N / N_k)² · |∇S_k / N|²
        micro_batch_squared_norms = [
            contribution * (step_tokens / tokens) ** 2 if tokens else 0.0
            for contribution, tokens in zip(contributions, micro_batch_tokens, strict=True)
        ]
        self.previous_grads.clear()
        self.backwards.clear()
        self.contribution_squared_norms = []
        return micro_batch_squared_norms, step_squared_norm

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()
