"""Reinforcement-learning post-training (GRPO and its relatives): the three sizes of an update, the loss
aggregations with the unit of their normaliser, exact rollout sampling, and the objective-level check. Imported
only by the GRPO fork (scripts/rl/grpo.py) and its tests, never by the default run."""
