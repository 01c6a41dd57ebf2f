"""Reinforcement-learning post-training (GRPO and its relatives): the three sizes of an update, the objectives (the
loss aggregations with the unit of their normaliser; clip, ratio level, KL and entropy terms), the task and its
reward, exact rollout sampling, the objective-level check, and the pieces train.py runs GRPO with (settings.py: the
run's keys and refusals; on_policy.py: the on-policy data source and the loss configs/grpo.toml names). Imported
when a config names those pieces, by scripts/rl/, by the equivalence checker's GRPO reference
(accumulation/checker/objective_reference.py) and by the tests; never by the default run."""
