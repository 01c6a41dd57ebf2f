"""CISPO (MiniMax-M1's clipped importance-sampling policy optimisation; TRL's loss_type="cispo") as a GRPO-family
loss: one file, on the shipped rollout source, checked against its own definition (docs/rl.md, "Add an objective").

    python train.py --config configs/grpo.toml data.policy_loss="forks.cispo:CISPO" data.clip_ratio_high=4.0
    python scripts/rl/check_objectives.py --config configs/grpo.toml data.policy_loss="forks.cispo:CISPO"

Where PPO clips the ratio inside the objective (a clipped token gets no gradient), CISPO keeps every token's
gradient and truncates its importance weight instead, held constant:

    ℓ_t = −sg(min(ρ_t, 1 + ε_high)) · A · log π(y_t)          (sg: no gradient through the weight)

ε_high is data.clip_ratio_high (TRL's epsilon_high is the cap itself, 1 + ε_high here). The KL and entropy terms,
the aggregation and the ratio's level are the settings' as for any objective of the family.
"""

import torch

from accumulation.rl.objectives import PolicyLoss, PolicyObjective, RowTerms


class CISPO(PolicyLoss):
    # The loop's loss reads what the clipped surrogate reads (PolicyLoss.reads), and logs one more mean: the
    # truncated importance weight.
    logged = (*PolicyLoss.logged, "importance_weight")

    def policy_terms(self, log_probs, log_ratio, advantage, **extras):
        cap = 1 + self.objective.clip_high
        weight = log_ratio.exp().clamp(max=cap).detach()
        return -weight * advantage * log_probs, log_ratio.exp() > cap

    def log_terms(self, **terms):
        return terms | {"importance_weight": terms["log_ratio"].exp().clamp(max=1 + self.objective.clip_high)}

    @classmethod
    def policy_definition(cls, objective: PolicyObjective, row: RowTerms):
        ratio = (row.log_probs - row.old_log_probs).exp()
        if objective.level == "sequence":
            ratio = (row.log_probs - row.old_log_probs).mean().exp().expand_as(ratio)
        cap = 1 + objective.clip_high
        weight = torch.minimum(ratio, torch.full_like(ratio, cap)).detach()
        return -weight * row.advantage * row.log_probs, ratio > cap
