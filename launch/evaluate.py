r"""A model on coding tasks: pass@1 / pass@k with 95% intervals, best-of-K, tokens, turns and tool
calls per task, a per-task JSON and a table.

  python -m launch.evaluate --config.workdir=runs/rl_tiny                        # its held-out tasks
  python -m launch.evaluate --config.workdir=runs/rl_tiny --tasks=humaneval --samples=4
  python -m launch.evaluate --config.workdir=runs/rl_tiny --tasks=state_tracking:per_length=4
  python -m launch.evaluate --hf_dir=path/to/hf --tasks=jsonl:tasks.jsonl --split=train
  python -m launch.evaluate --config.workdir=runs/rl/warm_start --trained_by=runs/rl  # then runs/rl

`--tasks` takes any task source spec (composer_jax.envs.load_task_source); without it a run is
evaluated on its own held-out tasks; `--trained_by=RUN` takes the prompts an RL run trained on
(its warm start against it: what RL did on the tasks it saw; `launch.compare --reports` pairs
the two reports). Episodes are played by the run's agent workflow (its tools' evaluation
profile, summaries, feedback, behaviour rewards) in the real sandboxed environments, several at
once (`--env_workers`); the sampling settings default to the run's RL settings.
"""

import dataclasses
import re
import sys

from absl import flags
from etils import epath

from launch import cli, malloc

_RUN = cli.define_run_folder("A run's folder (pretraining, SFT or RL).")
_HF_DIR = flags.DEFINE_string("hf_dir", "", "Or a Hugging Face folder (model + tokenizer).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of the run (default: the latest).")
_TASKS = flags.DEFINE_string("tasks", "", "Task source spec (default: the run's held-out tasks).")
_TRAINED_BY = flags.DEFINE_string(
    "trained_by", "", "Or the RL prompts this RL run's folder trained on (its epoch, in order)."
)
_SPLIT = flags.DEFINE_string(
    "split", "", "Split (default: the run's held-out split, else the source's evaluation split)."
)
_NUM_TASKS = flags.DEFINE_integer(
    "num_tasks", 0, "Tasks to evaluate (0: all; 32 of an endless source).", lower_bound=0
)
_SAMPLES = flags.DEFINE_integer("samples", 4, "Episodes per task (K).", lower_bound=1)
_KS = flags.DEFINE_list("ks", ["1", "2", "4"], "k values of pass@k / best-of-k (<= samples).")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Sampling temperature (0: greedy).", lower_bound=0
)
_MAX_TURNS = flags.DEFINE_integer(
    "max_turns", None, "Turns per episode (default: the run's).", lower_bound=1
)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Tokens per turn.", lower_bound=1)
_CONTEXT_LEN = flags.DEFINE_integer("context_len", None, "Tokens per episode.", lower_bound=1)
_NUM_SLOTS = flags.DEFINE_integer("num_slots", None, "Episodes decoded at once.", lower_bound=1)
_ENV_WORKERS = flags.DEFINE_integer(
    "env_workers", 4, "Environment steps run at once.", lower_bound=1
)
# Checked at parsing: the model loads before the sampling settings are used.
flags.register_validator(
    "ks",
    lambda ks: all(k.isascii() and k.isdigit() and int(k) >= 1 for k in ks),
    "expected whole numbers >= 1, comma-separated",
)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (and the task source's).")
_REQUIRE_SANDBOX = flags.DEFINE_bool(
    "require_sandbox", True, "Refuse to run model code without an isolating sandbox."
)
_OUT = flags.DEFINE_string("out", "", "Report JSON (default: <workdir>/eval/<tasks>.json).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")

_ENDLESS_DEFAULT = 32


def _load(config_lib):
    """(model, tokenizer, run config or None)."""
    if bool(_RUN()) == bool(_HF_DIR.value):
        raise config_lib.ConfigError("give exactly one of --config.workdir and --hf_dir")
    if _RUN():
        from composer_jax.train import load_run

        run = load_run(_RUN(), _STEP.value)
        return run.model, run.tokenizer, run.config
    from composer_jax import data, interop

    model = interop.load_hf_checkpoint(_HF_DIR.value)
    return model, data.load_tokenizer(_HF_DIR.value), None


def _tasks(config_lib, run_cfg):
    from composer_jax.envs import task_source

    if _TRAINED_BY.value:
        return _trained_prompts(config_lib)
    if _TASKS.value:
        spec, field = _TASKS.value, "--tasks"
    elif run_cfg is not None:
        rl = run_cfg.rl
        spec = rl.heldout.tasks or rl.tasks or run_cfg.data.tasks
        field = "the run's held-out tasks"
    else:
        raise config_lib.ConfigError("--tasks: needed with --hf_dir")
    source = task_source(spec, field)
    split = _SPLIT.value
    if not split:
        own = run_cfg.rl.heldout.split if run_cfg is not None and not _TASKS.value else None
        split = own or source.eval_split
    if split not in source.splits:
        raise config_lib.ConfigError(f"--split: {source.name} has splits {source.splits}")
    size = source.size(split)
    count = _NUM_TASKS.value or (size if size is not None else _ENDLESS_DEFAULT)
    if _TASKS.value or run_cfg is None:
        return source, split, source.take(count, split, _SEED.value)
    # The run's own held-out tasks, as its held-out check draws them: none it trained on.
    from composer_jax.actor.setup import untrained_tasks

    return source, split, untrained_tasks(run_cfg, source, split, count)


def _trained_prompts(config_lib):
    """(source, "train", the first --num_tasks prompts of the --trained_by run's RL epoch)."""
    from composer_jax.actor.setup import rl_prompt_tasks, rl_task_source
    from composer_jax.train.workdir import read_run_config

    if _TASKS.value or _SPLIT.value:
        raise config_lib.ConfigError("--trained_by: give it alone, without --tasks or --split")
    trainer = read_run_config(_TRAINED_BY.value)
    tasks = rl_prompt_tasks(trainer)
    return rl_task_source(trainer), "train", tasks[: _NUM_TASKS.value or len(tasks)]


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    from composer_jax import agent, envs
    from composer_jax import config as config_lib
    from composer_jax.agent.stages import format_stages
    from composer_jax.eval import format_table, write_report
    from composer_jax.eval.tasks import TaskEvalConfig, evaluate_tasks
    from composer_jax.train import CheckpointError

    try:
        model, tokenizer, run_cfg = _load(config_lib)
        source, split, tasks = _tasks(config_lib, run_cfg)
        rl = run_cfg.rl if run_cfg is not None else config_lib.RLConfig()
        cfg = TaskEvalConfig(
            samples=_SAMPLES.value,
            ks=tuple(int(k) for k in _KS.value),
            temperature=_TEMPERATURE.value,
            max_turns=_MAX_TURNS.value or rl.agent.max_turns,
            max_new_tokens=_MAX_NEW_TOKENS.value or rl.rollout.max_new_tokens,
            context_len=_CONTEXT_LEN.value or rl.rollout.context_len,
            num_slots=_NUM_SLOTS.value or max(rl.rollout.num_slots, _SAMPLES.value),
            env_workers=_ENV_WORKERS.value,
            seed=_SEED.value,
            require_isolation=_REQUIRE_SANDBOX.value,
        )
        agent.check_agent_config(rl.agent)
        print(
            f"Evaluating {len(tasks)} tasks of {source.name} ({split} split), "
            f"{cfg.samples} samples each",
            flush=True,
        )
        report = evaluate_tasks(model, tokenizer, tasks, cfg, rl, _PROGRESS.value)
    except (
        CheckpointError,
        config_lib.ConfigError,
        envs.IsolationUnavailable,
        ValueError,
        OSError,
    ) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    report["setup"] = {
        "model": _RUN() or _HF_DIR.value,
        "tasks": source.name,
        "split": split,
        **dataclasses.asdict(cfg),
    }
    out = _OUT.value
    if not out:
        folder = epath.Path(_RUN() or ".") / "eval"  # a bucket run's folder too
        folder.mkdir(parents=True, exist_ok=True)
        out = str(folder / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", source.name)[:80] + ".json"))
    write_report(report, out)
    print(format_table(report))
    print(
        "Where the episodes stopped (each stage checked on its own; counted at the first missed):"
    )
    print(format_stages(report["stages"]))
    timing = report["timing"]
    print(
        f"{timing['total_seconds']:.0f} s in all: {timing['generation_seconds']:.0f} s "
        f"generating, {timing['environment_seconds']:.0f} s in the environments (tool calls and "
        f"grading). Per-task results: {out}",
        flush=True,
    )


if __name__ == "__main__":
    malloc.exec_with_tunables()
    cli.run(main)
