"""Experiment presets: `tiny` (CPU, minutes), `small` (~100M parameters, one GPU), `kimi_k2`
(the 1.04T / 32B-active shape, for accounting and cluster launch), `deepseek_v3` (671B / 37B
active, the same phases and mesh), `rl_tiny` (the RL main job),
`rl_tiny_bpe` (the main job on the shipped BPE tokenizer), `rl_agent_tiny` (the multi-turn coding
agent in repositories) and `rl_small`."""

import dataclasses

from composer_jax.config import (
    LONG_CONTEXT_ATTENTION_BLOCK,
    AgentConfig,
    ExperimentConfig,
    HeldoutConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    PhaseConfig,
    RLConfig,
    RLObjectiveConfig,
    RolloutConfig,
    TrainConfig,
    YarnConfig,
)


def tiny() -> ExperimentConfig:
    """Runs in minutes on a laptop CPU: 3 phases (main on the stdlib, long context, SFT on the
    built-in coding tasks)."""
    return ExperimentConfig(
        model=ModelConfig(),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.7, seq_len=128, batch_size=8),
                PhaseConfig("long_context", fraction=0.2, seq_len=256, batch_size=4, lr_scale=0.5),
                PhaseConfig(
                    "sft",
                    fraction=0.1,
                    seq_len=576,
                    batch_size=4,
                    lr_scale=0.25,
                    data="tasks",
                ),
            ),
            eval_every=50,
            checkpoint_every=50,
        ),
        steps=300,
        workdir="runs/tiny",
    )


def small() -> ExperimentConfig:
    """About 100M total parameters: a single-GPU model for real ablations."""
    model = ModelConfig(
        vocab_size=259,
        hidden_size=512,
        num_layers=8,
        first_k_dense=1,
        num_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=6,
        num_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=32768,
        num_mtp_layers=1,
    )
    return ExperimentConfig(
        model=model,
        optim=OptimizerConfig(learning_rate=1e-3, warmup_steps=500),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.8, seq_len=2048, batch_size=64),
                PhaseConfig(
                    "long_context", fraction=0.15, seq_len=8192, batch_size=16, lr_scale=0.3
                ),
                PhaseConfig("sft", fraction=0.05, seq_len=2048, batch_size=64, lr_scale=0.1),
            ),
            log_every=20,
            eval_every=500,
            checkpoint_every=500,
        ),
        steps=20000,
        workdir="runs/small",
    )


def deepseek_v3_model() -> ModelConfig:
    """The DeepSeek-V3 shape (671B total / 37B active), as its config.json describes it
    (tests/model/test_transformer.py checks the two agree); for accounting, the plan and
    continued pretraining from the released checkpoint (`--config.init_from`). Its one MTP head
    is this project's (a dense block, trained from scratch), not the release's MoE layer."""
    return ModelConfig(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        first_k_dense=3,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rope_scaling=YarnConfig(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=163840,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_experts=256,
        num_experts_per_tok=8,
        num_shared_experts=1,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        num_mtp_layers=1,
        attention_block_size=LONG_CONTEXT_ATTENTION_BLOCK,
    )


def kimi_k2_model() -> ModelConfig:
    """The Kimi-K2 shape (1.04T total / 32B active): DeepSeek-V3's architecture with 384 experts,
    64 heads, one dense layer and K2's own YaRN (factor 32, both betas 1: one ramp edge); what
    loading the released config.json gives, used for accounting and plans, never allocated."""
    v3 = deepseek_v3_model()
    return dataclasses.replace(
        v3,
        vocab_size=163840,
        first_k_dense=1,
        num_heads=64,
        rope_theta=50000.0,
        rope_scaling=dataclasses.replace(
            v3.rope_scaling, factor=32.0, beta_fast=1.0, beta_slow=1.0
        ),
        max_position_embeddings=131072,
        num_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        num_mtp_layers=0,
    )


def kimi_k2() -> ExperimentConfig:
    """Kimi K2's pre-training recipe at its shape: MuonClip (Muon for every matrix, with the
    update's RMS matched to AdamW's so both share one learning rate, and QK-clip at the report's
    threshold of 100), peak 2e-4 after 500 warm-up steps, held (K2: 10T of its 15.5T tokens),
    then a cosine decay to 2e-5 over the last 35% of the steps; weight decay 0.1."""
    return ExperimentConfig(
        model=kimi_k2_model(),
        optim=OptimizerConfig(
            name="muon",
            learning_rate=2e-4,
            muon_learning_rate=2e-4,
            muon_scaling="rms",
            warmup_steps=500,
            schedule="wsd",
            decay_fraction=0.35,
            min_lr_ratio=0.1,
            weight_decay=0.1,
            qk_clip_threshold=100.0,
        ),
        # 64-way FSDP (the long-context phase's batch of 64 caps replica x fsdp at 64) with the
        # experts split over it (64 divides the 384 experts), context parallelism over the rest:
        # cp=2 on 128 GPUs, 4 on 256, 16 on 1024.
        mesh=MeshConfig(replica=1, fsdp=64, cp=-1, ep=("fsdp",)),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.9, seq_len=32768, batch_size=512),
                PhaseConfig(
                    "long_context", fraction=0.08, seq_len=262144, batch_size=64, lr_scale=0.3
                ),
                PhaseConfig("sft", fraction=0.02, seq_len=32768, batch_size=512, lr_scale=0.1),
            )
        ),
        steps=100000,
        workdir="runs/kimi_k2",
    )


def deepseek_v3() -> ExperimentConfig:
    """Continued pretraining of DeepSeek-V3 with kimi_k2's phases and mesh (64 divides its 256
    experts as it does Kimi-K2's 384) and DeepSeek-V3's own optimizer: AdamW (0.9, 0.95), weight
    decay 0.1, peak 2.2e-4 after 2,000 warm-up steps, held (DeepSeek-V3: 10T of 14.8T tokens),
    then a cosine decay to 2.2e-5 over the last 30% of the steps, gradients clipped at 1, and its
    sequence-wise balance loss at 1e-4."""
    model = dataclasses.replace(deepseek_v3_model(), balance_loss_alpha=1e-4)
    optim = OptimizerConfig(
        name="adamw",
        learning_rate=2.2e-4,
        warmup_steps=2000,
        schedule="wsd",
        decay_fraction=0.3,
        min_lr_ratio=0.1,
        b1=0.9,
        b2=0.95,
        weight_decay=0.1,
        clip_norm=1.0,
    )
    return dataclasses.replace(kimi_k2(), model=model, optim=optim, workdir="runs/deepseek_v3")


def rl_tiny() -> ExperimentConfig:
    """The main job of `launch/rl.py`: SFT warm start of the tiny model on single-transform
    built-in tasks, then asynchronous RL on them (constant learning rate, one epoch over the
    prompts). Sized for a 2-core CPU: one-turn episodes (write the solution; graded at once),
    steps of 8 groups x 4 with dynamic sampling (groups that all pass or all fail carry no task
    signal and are skipped), and no distillation (a policy this small cannot use a hint; the
    mechanics are tested on their own). What RL can teach here is per function (which transform
    a description names), so distinct prompts per step matter more than samples per prompt: 8 x 4
    gained more held-out reward than 2 x 16 or 4 x 8 from the same warm start, and a larger
    learning rate degrades the policy instead. On prompts it never trains on (the held-out
    check), RL gains only where the warm start already reads descriptions: from 500 SFT steps at
    lr 3e-3 (held-out 0.19) 24 RL steps gained nothing measurable; from 600 steps at lr 6e-3
    (0.52) they gain about +0.02 and 36 steps about +0.026. Measured trade-offs:
    experiments/RESULTS.md."""
    base = tiny()
    return dataclasses.replace(
        base,
        # Adam without weight decay, as the report's RL (decay would pull the policy toward 0).
        optim=OptimizerConfig(
            learning_rate=1e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0
        ),
        data=dataclasses.replace(base.data, tasks="builtin:max_ops=1"),
        train=dataclasses.replace(
            base.train,
            phases=(PhaseConfig("sft", 1.0, seq_len=576, batch_size=8, data="tasks"),),
            log_every=1,
            checkpoint_every=5,
        ),
        rl=RLConfig(
            objective=RLObjectiveConfig(distill_coef=0.0),
            rollout=RolloutConfig(
                group_size=4,
                groups_per_step=8,
                num_prompts=1000,  # 36 steps schedule about 540 groups (dynamic sampling skips)
                max_staleness=2,
                skip_uniform_groups=True,
                num_slots=32,
                # Its prompts are 242-317 tokens (bytes) with the chat format, so a one-turn
                # sample of 192 new tokens fits in 512: cache rows and training rows of 512, not
                # 768 (a third of the trainer's tokens, which share the 2 cores with decoding).
                context_len=512,
                max_new_tokens=192,
                prefill_buckets=(64, 128, 384),  # one chunk per group's prompt
            ),
            agent=AgentConfig(max_turns=1),
            weight_delta="add",
            # A warm start that reads the descriptions: 600 steps at lr 6e-3 score 0.52 on the
            # held-out check where 500 at 3e-3 scored 0.19 and 800 at 3e-3 0.47 (RESULTS.md).
            warm_start_steps=600,
            warm_start_lr=6e-3,
            heldout=HeldoutConfig(
                split="train",  # fresh instances of training functions (the held-out seed)
                # One sample of many tasks: for the same episodes, more tasks narrow the paired
                # interval most (32 x 2: +-0.09, 256 x 1: +-0.036, 512 x 1: +-0.026); 768 tasks
                # give +-0.021 in 50-60 s a check on 2 cores.
                num_tasks=768,
                samples=1,
            ),
        ),
        steps=36,
        workdir="runs/rl_tiny",
    )


BPE_TOKENIZER = "code_bpe_2k"  # shipped; trained by experiments/train_bpe.py
BPE_VOCAB = 2048


def rl_tiny_bpe() -> ExperimentConfig:
    """`rl_tiny` on the shipped 2048-id BPE tokenizer (about 2.8 bytes per token on the task
    episodes) instead of bytes: the same model apart from its embedding and head rows, the same
    steps and budgets in tokens. Measured against rl_tiny: experiments/RESULTS.md."""
    base = rl_tiny()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, vocab_size=BPE_VOCAB),
        data=dataclasses.replace(base.data, tokenizer=BPE_TOKENIZER),
        workdir="runs/rl_tiny_bpe",
    )


# The agent's tools in `rl_agent_tiny`: find, read, edit, test and plan (no shell, no rewrite of
# whole files; a call to another tool answers "tool not available", which feedback targets).
AGENT_TINY_TOOLS = "read_file,edit_file,run_tests,search_code,todo"


def rl_agent_tiny() -> ExperimentConfig:
    """The coding agent end to end on 2 cores: multi-turn episodes in small repositories
    (`builtin_repo`: the function whose body was removed is in the first observation's open tab,
    as an editor shows it; plan, edit, run the tests, report; find and read tools for the rest of
    the repository), a summary whenever a generation's context reaches 448 tokens (the chain
    shares the final reward), text-feedback distillation on tool errors, and the behaviour
    rewards (open todo items, tool errors, the diff's style, the final message's communication,
    reward hacking). The warm start is 800 SFT steps on 2000 of the scripted agent's episodes
    played through the same workflow (`data.sft_style` "episode"), on the shipped BPE tokenizer
    (the byte model's contexts would be 2.7x longer). The held-out check plays 8 samples of 32
    functions RL and SFT never saw, so pass@1 and best-of-8 are reported before and after RL
    (the report's fig. 5). Before the open tab and the longer SFT the warm start solved none of
    them (every lever measured: RESULTS.md, issue 48)."""
    base = rl_tiny_bpe()
    return dataclasses.replace(
        base,
        data=dataclasses.replace(
            base.data, tasks="builtin_repo:max_ops=2", sft_style="episode", sft_tasks=2000
        ),
        train=dataclasses.replace(
            base.train,
            phases=(PhaseConfig("sft", 1.0, seq_len=768, batch_size=8, data="tasks"),),
        ),
        rl=dataclasses.replace(
            base.rl,
            objective=dataclasses.replace(base.rl.objective, distill_coef=0.1),
            rollout=dataclasses.replace(
                base.rl.rollout,
                groups_per_step=6,
                context_len=768,
                max_new_tokens=128,
                prefill_buckets=(64, 128, 256),
                # Every group trains: a group whose samples all pass still differs in behaviour.
                skip_uniform_groups=False,
                num_prompts=0,
            ),
            agent=dataclasses.replace(
                base.rl.agent,
                tools=AGENT_TINY_TOOLS,
                open_tab_lines=40,
                max_turns=8,
                summary_budget=448,
                summary_max_tokens=128,
                max_summaries=2,
                behaviour_rewards=(
                    "todo_unfinished=0.05",
                    "tool_errors=0.1",
                    "style=0.05",
                    "communication=0.1",
                    "harm=0.5",
                ),
            ),
            warm_start_steps=800,
            warm_start_lr=6e-3,
            heldout=HeldoutConfig(split="held_out", num_tasks=32, samples=8),
        ),
        steps=16,
        workdir="runs/rl_agent_tiny",
    )


def rl_small() -> ExperimentConfig:
    """RL on the `small` model (one GPU): RL-sized learning rate, longer contexts, more slots.
    Warm-start it from a `small` pretraining run with --config.rl.warm_start=WORKDIR."""
    base = small()
    return dataclasses.replace(
        base,
        optim=OptimizerConfig(
            learning_rate=1e-5, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0
        ),
        train=dataclasses.replace(
            base.train,
            phases=(PhaseConfig("sft", 1.0, seq_len=2048, batch_size=64, data="tasks"),),
            log_every=1,
            checkpoint_every=20,
        ),
        rl=RLConfig(
            rollout=RolloutConfig(
                group_size=8,
                groups_per_step=16,
                max_staleness=4,
                num_slots=128,
                context_len=4096,
                max_new_tokens=1024,
            ),
            agent=AgentConfig(max_turns=8, summary_budget=3072, summary_max_tokens=512),
            heldout=HeldoutConfig(num_tasks=128, samples=4),
        ),
        steps=500,
        workdir="runs/rl_small",
    )


PRESETS = {
    "tiny": tiny,
    "small": small,
    "kimi_k2": kimi_k2,
    "deepseek_v3": deepseek_v3,
    "rl_tiny": rl_tiny,
    "rl_tiny_bpe": rl_tiny_bpe,
    "rl_agent_tiny": rl_agent_tiny,
    "rl_small": rl_small,
}
