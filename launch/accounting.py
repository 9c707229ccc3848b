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
    # fp32 master weights + two fp32 Adam moments; bf16 copies for compute are transient.
    print(f"train state (fp32 weights + Adam)  {c.total * 12 / 2**40:8.2f} TiB")
    for phase in cfg.train.phases:
        flops = accounting.train_flops_per_token(cfg.model, phase.seq_len)
        print(
            f"phase {phase.name:<14} seq {phase.seq_len:>7}: {flops / 1e9:10.1f} GFLOP/token "
            f"(training), {flops * phase.seq_len * phase.batch_size / 1e15:10.1f} PFLOP/step"
        )


if __name__ == "__main__":
    cli.run(main)
