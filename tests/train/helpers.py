"""Small experiment configs and a throwaway code corpus for training tests."""

import dataclasses
import os
import sysconfig

from composer_jax import config as config_lib
from composer_jax import presets
from tests.helpers import tiny_model_config


def make_corpus(root: str, num_files: int = 40) -> str:
    """Copies some standard-library modules into `root`: real code, small and fixed."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))[:num_files]
    os.makedirs(root, exist_ok=True)
    for n in names:
        with open(os.path.join(stdlib, n), encoding="utf-8", errors="replace") as src:
            text = src.read()[:6000]
        with open(os.path.join(root, n), "w", encoding="utf-8") as dst:
            dst.write(text)
    return root


def small_model_config(**overrides) -> config_lib.ModelConfig:
    """The smallest model with every feature on (q_lora, MTP, 8 experts, shared expert)."""
    fields = dict(
        hidden_size=32,
        num_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    # The train tests' model keeps the preset's bf16 compute (the steps they check run in it).
    return tiny_model_config(**{"dtype": presets.tiny().model.dtype, **fields, **overrides})


# For runs whose phases do not matter to the test: tiny_experiment's two phases of different
# lengths compile two train steps.
ONE_PHASE = (config_lib.PhaseConfig("main", 1.0, seq_len=32, batch_size=8),)


def tiny_experiment(
    workdir: str, corpus: str, steps: int = 8, **train_overrides
) -> config_lib.ExperimentConfig:
    model = small_model_config()
    train = config_lib.TrainConfig(
        phases=(
            config_lib.PhaseConfig("main", 0.5, seq_len=32, batch_size=8),
            config_lib.PhaseConfig("long", 0.5, seq_len=64, batch_size=8, lr_scale=0.5),
        ),
        log_every=1,
        eval_every=4,
        eval_batches=1,
        checkpoint_every=3,
        keep_checkpoints=3,
    )
    train = dataclasses.replace(train, **train_overrides)
    return config_lib.ExperimentConfig(
        model=model,
        train=train,
        steps=steps,
        workdir=workdir,
        optim=config_lib.OptimizerConfig(warmup_steps=2),
        data=config_lib.DataConfig(corpus_root=corpus, eval_fraction=0.2),
    )
