"""The asynchronous actor loop that feeds the RL objective: the coordinator and its rollout
thread, samplers, environment pools, the group ledger, in-flight records, the trainer, the
evaluator; `composer_jax.actor.run.run_rl` runs it all. Submodules are imported where used, so
`import composer_jax.actor.ledger` does not pull in JAX-heavy parts."""
