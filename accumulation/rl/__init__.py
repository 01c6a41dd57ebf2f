"""Reinforcement-learning post-training (GRPO and its relatives): the three sizes of an update, the loss
aggregations with the unit of their normaliser, exact rollout sampling, the objective-level check, and the pieces
train.py runs GRPO with (on_policy.py: the on-policy data source and the clipped-surrogate loss, which
configs/grpo.toml names). Imported when a config names those pieces, by scripts/rl/check_objectives.py, by the
equivalence checker's GRPO reference (accumulation/checker/objective_reference.py) and by the tests; never by the
default run."""
