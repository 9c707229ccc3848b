r"""Does the distillation teacher read its hint? Measured on the flagged turns an RL run trained on.

  python experiments/feedback_teacher.py runs/claims/agent128/seed=0 [RUN ...] [--scorer=FOLDER]
      [--max_turns=N] [--teacher_json=PATH]

Text-feedback distillation pulls each flagged turn toward the same policy with the detector's
hint inserted before the turn (`agent.generation.teacher_sequence`). That teaches something only
if the teacher's predictions depend on what the hint says. For every flagged turn in the run's
ledger (the exact episodes its trainer distilled), the model (default: the run's warm start, the
policy RL starts from) scores the turn three ways, each with its own routing:

- `hint`: the teacher the trainer used (the detector's hint);
- `other hint`: a hint another flagged turn of the run received, whose text differs (same
  format, the wrong content);
- `shuffled`: the real hint's tokens after its "[feedback]" prefix in a random order.

Per turn: KL(student || teacher) per token (what the distillation loss minimises) and the change
of the turn's log-probability (teacher minus student, summed over its tokens: a teacher that
reads "do not repeat the failing call" should find the repeat less likely). The content of the
hint matters where `hint` differs from the controls; the paired differences over turns carry
95% intervals, over all turns and per detector (the hint's opening words).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_sequences
from composer_jax.agent.generation import hinted_turns, teacher_sequence
from composer_jax.eval.passk import mean_interval
from composer_jax.model.transformer import forward
from composer_jax.rl.kl import exact_kl
from composer_jax.train import load_run
from composer_jax.train.workdir import read_run_config

# Names no other imported experiment defines (absl flags are process-wide).
_SCORER = flags.DEFINE_string(
    "scorer", "", "Run folder of the scoring model (default: warm start)."
)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 0, "Flagged turns per run (0: all).")
_JSON = flags.DEFINE_string("teacher_json", "", "Also write the results as JSON to this path.")
_SEED = flags.DEFINE_integer("control_seed", 0, "Seed of the controls (other hint, shuffle).")

VARIANTS = ("hint", "other hint", "shuffled")
PAD_MULTIPLE = 256


def turn_measures(
    student_logp_V: np.ndarray, teacher_logp_V: np.ndarray, tokens: np.ndarray
) -> tuple[float, float]:
    """(mean KL(student || teacher) per token, sum of teacher - student log-prob of `tokens`)
    from the two models' log-softmax rows predicting the turn's tokens."""
    kl = exact_kl(jnp.asarray(student_logp_V), jnp.asarray(teacher_logp_V))
    rows = np.arange(len(tokens))
    change = teacher_logp_V[rows, tokens] - student_logp_V[rows, tokens]
    return float(np.mean(kl)), float(np.sum(change))


def turn_scores(
    student: np.ndarray,
    teacher: np.ndarray,
    target_index: np.ndarray,
    tokens: np.ndarray,
    turn: tuple[int, int],
) -> tuple[float, float]:
    """`turn_measures` of tokens[start:end] from the student's and the teacher's log-softmax
    rows (`_log_softmax_rows`): each token is predicted at the position before it, in the teacher
    the position before its `target_index`."""
    start, end = turn
    return turn_measures(
        student[start - 1 : end - 1], teacher[target_index[start:end] - 1], tokens[start:end]
    )


def _log_softmax_rows(model, tokens: np.ndarray) -> np.ndarray:
    """log-softmax of the logits at every position of one unpacked sequence (padded to a
    multiple of PAD_MULTIPLE: one compile per length class)."""
    length = len(tokens)
    padded = -(-length // PAD_MULTIPLE) * PAD_MULTIPLE
    row = np.zeros((1, padded), np.int32)
    row[0, :length] = tokens
    segments = (np.arange(padded) < length).astype(np.int32)[None]
    positions = np.arange(padded, dtype=np.int32)[None]
    return np.asarray(_scores(model, row, positions, segments)[0, :length])


@jax.jit
def _scores(model, tokens_BT, positions_BT, segment_ids_BT):
    out = forward(model, tokens_BT, positions_BT, segment_ids_BT, with_mtp=False)
    return jax.nn.log_softmax(model.logits(out.hidden_BTD).astype(jnp.float32), axis=-1)


def _flagged_sequences(run: str):
    """(sequence, its hinted turns) of every trained group's flagged sequences."""
    ledger = GroupLedger(os.path.join(run, "ledger"))
    for group_id in ledger:
        if ledger.trained_step(group_id) is None:
            continue
        for seq in group_sequences(ledger.load(group_id)):
            if seq.teacher_tokens is not None:
                turns = hinted_turns(seq.tokens, seq.teacher_tokens, seq.teacher_target_index)
                yield seq, turns


def _control_hints(hint: np.ndarray, pool: list[np.ndarray], rng, prefix: int):
    """(another turn's hint with other tokens, the hint's tokens after `prefix` shuffled)."""
    others = [h for h in pool if not np.array_equal(h, hint)]
    other = others[rng.integers(len(others))] if others else hint
    shuffled = np.concatenate([hint[:prefix], rng.permutation(hint[prefix:])])
    return other, shuffled


def _prefix_length(pool: list[np.ndarray]) -> int:
    """Tokens every hint starts with (the rendered "[feedback] " marker)."""
    first = pool[0]
    length = min(len(h) for h in pool)
    for other in pool[1:]:
        differ = np.flatnonzero(first[:length] != other[:length])
        length = int(differ[0]) if differ.size else length
    return length


def run_teacher_reads(run: str, model, tokenizer, rng, max_turns: int = 0) -> dict:
    """Per-turn measures of the three teachers on the run's flagged turns, and their summary."""
    flagged = list(_flagged_sequences(run))
    pool = [hint for _, turns in flagged for _, _, hint in turns]
    if not pool:
        raise SystemExit(f"{run}: no flagged turn in its trained groups (distill_coef 0?)")
    prefix = _prefix_length(pool)
    rows = []
    for seq, turns in flagged:
        if max_turns and len(rows) >= max_turns:
            break
        student = _log_softmax_rows(model, seq.tokens)
        room = max_turns - len(rows) if max_turns else len(turns)
        for index, (start, end, hint) in enumerate(turns[:room]):
            other, shuffled = _control_hints(hint, pool, rng, prefix)
            row = {"hint_text": tokenizer.decode(hint.tolist()).strip(), "tokens": end - start}
            for name, variant in zip(VARIANTS, (hint, other, shuffled)):
                spans = [(s, e, variant if i == index else h) for i, (s, e, h) in enumerate(turns)]
                teacher_tokens, target = teacher_sequence(seq.tokens, spans)
                teacher = _log_softmax_rows(model, teacher_tokens)
                kl, change = turn_scores(student, teacher, target, seq.tokens, (start, end))
                row[name] = {"kl": kl, "logp_change": change}
            rows.append(row)
    return {"turns": rows, "summary": summarise(rows), "by_hint": by_hint(rows)}


def summarise(rows: list[dict]) -> dict:
    """Mean and 95% interval over turns of each variant's measures, and of hint minus each
    control (paired by turn)."""
    out = {}
    for measure in ("kl", "logp_change"):
        for name in VARIANTS:
            out[f"{name}/{measure}"] = mean_interval([r[name][measure] for r in rows])
        for control in VARIANTS[1:]:
            paired = [r["hint"][measure] - r[control][measure] for r in rows]
            out[f"hint - {control}/{measure}"] = mean_interval(paired)
    return out


def hint_opening(text: str, words: int = 2) -> str:
    """The first words of a hint after its marker: which detector wrote it."""
    return " ".join(text.removeprefix("[feedback]").split()[:words])


def by_hint(rows: list[dict]) -> dict:
    """Hint minus another turn's hint, paired by turn, per hint opening (per detector)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(hint_opening(row["hint_text"]), []).append(row)
    return {
        opening: {
            "turns": len(group),
            **{
                measure: mean_interval(
                    [r["hint"][measure] - r["other hint"][measure] for r in group]
                )
                for measure in ("kl", "logp_change")
            },
        }
        for opening, group in sorted(groups.items(), key=lambda item: -len(item[1]))
    }


def format_summary(run: str, result: dict) -> str:
    summary = result["summary"]
    lines = [
        f"{run}: {len(result['turns'])} flagged turns",
        "| teacher | KL(student || teacher) per token | turn log-prob change (teacher - student) |",
        "| --- | ---: | ---: |",
    ]
    labels = (*VARIANTS, *(f"hint - {c}" for c in VARIANTS[1:]))
    for label in labels:
        cells = [
            f"{m:+.3f} +- {w:.3f}"
            for m, w in (summary[f"{label}/kl"], summary[f"{label}/logp_change"])
        ]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += ["", "| hint opens with | turns | hint - another hint: KL | log-prob change |"]
    lines.append("| --- | ---: | ---: | ---: |")
    for opening, group in result["by_hint"].items():
        (kl, kl_w), (lp, lp_w) = group["kl"], group["logp_change"]
        lines.append(
            f"| {opening} | {group['turns']} | {kl:+.3f} +- {kl_w:.3f} | {lp:+.2f} +- {lp_w:.2f} |"
        )
    return "\n".join(lines)


def main(argv):
    runs = argv[1:]
    if not runs:
        raise app.UsageError("name one or more RL run folders")
    results = {}
    for run in runs:
        cfg = read_run_config(run)
        scorer = _SCORER.value or cfg.rl.warm_start or os.path.join(run, "warm_start")
        loaded = load_run(scorer)
        rng = np.random.default_rng(_SEED.value)
        results[run] = run_teacher_reads(run, loaded.model, loaded.tokenizer, rng, _MAX_TURNS.value)
        results[run]["model"] = scorer
        print(format_summary(run, results[run]), flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
