"""Ahead-of-time plans: a step compiled for a mesh of virtual devices from abstract inputs (nothing
allocated), with its memory, collectives, FLOPs and an estimated time per device
(`training.plan_training_step`), and the datasheet numbers of the target GPUs (`devices`)."""
