r"""Parameter, FLOP and memory accounting of a config, from shapes alone (nothing is allocated).

python -m launch.accounting [--config=kimi_k2]
"""

from launch import cli

_CONFIG = cli.define_config("kimi_k2")


def main(argv):
    del argv
    from composer_jax import config as config_lib
    from launch import runtime

    runtime.initialize()
    from composer_jax.model import accounting

    cfg = cli.experiment_config(_CONFIG)
    config_lib.validate_model(cfg.model)
    c = accounting.count_params(cfg.model)
    print(f"total parameters      {c.total / 1e9:12.2f} B  (embeddings, head and MTP included)")
    print(
        f"active per token      {c.active / 1e9:12.2f} B  ({cfg.model.num_experts_per_tok} of "
        f"{cfg.model.num_experts} routed experts)"
    )
    print(f"  embedding           {c.embedding / 1e9:12.2f} B")
    print(f"  output head         {c.output_head / 1e9:12.2f} B")
    print(f"  routed experts      {c.routed_experts / 1e9:12.2f} B")
    print(f"  MTP heads           {c.mtp / 1e9:12.2f} B")
    params, opt_state = _train_state_bytes(cfg)
    print(
        f"train state           {_bytes(params + opt_state):>15}  (weights {_bytes(params)}, "
        f"{cfg.optim.name} state {_bytes(opt_state)}; bf16 copies for compute are transient)"
    )
    for phase in cfg.train.phases:
        flops = accounting.train_flops_per_token(cfg.model, phase.seq_len)
        print(
            f"phase {phase.name:<14} seq {phase.seq_len:>7}: {flops / 1e9:10.1f} GFLOP/token "
            f"(training), {flops * phase.seq_len * phase.batch_size / 1e15:10.1f} PFLOP/step"
        )


def _bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _train_state_bytes(cfg) -> tuple[int, int]:
    """(weights, optimizer state) bytes of cfg's train state from shapes alone: what
    `optim.make_optimizer`'s init allocates (Muon keeps one moment per matrix, AdamW two)."""
    import jax
    import optax
    from flax import nnx

    from composer_jax import optim
    from composer_jax.model import Transformer
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train.step import split_model

    _, params, _ = split_model(nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))))
    tx = optim.make_optimizer(
        cfg.optim, optax.constant_schedule(0.0), logical_axes_of(params), verbose=False
    )
    state = jax.eval_shape(tx.init, params)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return nbytes(params), nbytes(state)


if __name__ == "__main__":
    cli.run(main)
