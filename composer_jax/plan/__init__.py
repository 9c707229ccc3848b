"""Ahead-of-time plans: a step compiled for a mesh of virtual devices from abstract inputs (nothing
allocated), with its memory, collectives, FLOPs and an estimated time per device: the training
step and the layout changes ranked against it (`training`), the sampler's decode step (`decode`),
what both read from a compiled module and how it is priced (`costs`), and the datasheet numbers
of the target GPUs (`devices`)."""
