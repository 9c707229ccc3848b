r"""Whether an agent run's episodes act on a failing test, read back from its ledger.

  python experiments/episode_flow.py runs/claims/agent128/seed=0 [RUN ...] [--flow_json=PATH]

Each sample's chain of generations (a summary restarts it) is decoded into turns, each with the
context that followed it (tool outputs, a summary request). Counted per run, over every group in
its ledger: samples; samples with a failing visible test (a `run_tests` output whose exit code
is not 0); of those, the ones asked for a summary right at that output, the ones with an edit
applied after it, the ones whose summary there states a fix ("The fix writes:", as a repair's
scripted summary does), the ones whose summary begins with the function the prompt asks for (as
every scripted summary does: a name carried through the summary) and the ones that reached
reward 1; samples with two or more applied edits (`edit_file` / `write_file` reported done),
edits tried and applied in a restarted generation, the ones whose `new` is the fix their summary
stated and, of those that did not apply, the ones whose `old` the file did not hold once, the
ones cut off by the turn budget and the ones missing an argument; and reward 1 among the samples
whose first test passed. A run whose episodes make one attempt shows no applied edit after a
failing test and no reward 1 after one.
"""

import collections
import dataclasses
import json
import os
import re

import numpy as np
from absl import app, flags

from composer_jax import envs
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_sequences
from composer_jax.agent.workflow import SUMMARY_CLOSE, SUMMARY_OPEN
from composer_jax.envs.environment import CUT_OFF_CALL
from composer_jax.envs.tools import run_tests_exit_codes
from composer_jax.train.runs import run_tokenizer

_JSON = flags.DEFINE_string("flow_json", "", "Also write the table as JSON to this path.")

_APPLIED = re.compile(r'<output tool="(?:edit_file|write_file)">(?:edited|wrote) ')
_EDIT_CALL = re.compile(r'<call tool="(?:edit_file|write_file)">')
# Why an edit tried after a restart did not apply, by the error the environment answered.
_EDIT_ERRORS = {
    "restart_edit_old_not_once": re.compile(r"`old` must occur exactly once"),
    "restart_edit_cut_off": re.compile(re.escape(CUT_OFF_CALL)),
    "restart_edit_missing_argument": re.compile(r"(?:edit|write)_file: missing argument"),
}
# The function a repository task asks for (`builtin_repo`'s prompt), whose name a summary's first
# line repeats.
_FUNCTION = re.compile(r"The body of `(\w+)`")
COLUMNS = (
    "samples",
    "failing_test",
    "summary_at_failure",
    "fix_planned_at_failure",
    "summary_names_function",
    "edit_after_failure",
    "reward_1_after_failure",
    "two_applied_edits",
    "edits_tried_after_restart",
    "edits_applied_after_restart",
    "restart_edits_as_planned",
    "restart_edit_old_not_once",
    "restart_edit_cut_off",
    "restart_edit_missing_argument",
    "first_test_passed",
    "reward_1_first_test_passed",
)


@dataclasses.dataclass(frozen=True)
class Turn:
    generation: int  # 0 until the first summary, then one more per restart
    text: str  # what the policy wrote
    after: str  # the context that followed it, up to the policy's next turn


def _first_turn(seq) -> int:
    """Where the policy's first turn begins: the prompt is what precedes it."""
    written = np.flatnonzero(np.asarray(seq.policy_mask))
    return int(written[0]) if written.size else len(seq.tokens)


def chain_turns(sequences, decode) -> list[Turn]:
    """The turns of one sample's generations, in order; `decode` turns token ids into text."""
    turns = []
    for generation, seq in enumerate(sequences):
        mask = np.asarray(seq.policy_mask, np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        runs = list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
        for i, (start, end) in enumerate(runs):
            following = runs[i + 1][0] if i + 1 < len(runs) else len(seq.tokens)
            text, after = decode(seq.tokens[start:end]), decode(seq.tokens[end:following])
            turns.append(Turn(generation, text, after))
    return turns


def sample_flow(turns: list[Turn], reward: float, function: str = "") -> collections.Counter:
    """The counts of one sample (see the module docstring); `function`: the name of the
    function its task asks for, where the prompt names one."""
    counts = collections.Counter(samples=1)
    exits = [(i, code) for i, t in enumerate(turns) for code in run_tests_exit_codes(t.after)]
    applied = [i for i, t in enumerate(turns) if _APPLIED.search(t.after)]
    counts["two_applied_edits"] = len(applied) >= 2
    restarted = [i for i, t in enumerate(turns) if t.generation > 0]
    counts["edits_tried_after_restart"] = sum(
        bool(_EDIT_CALL.search(turns[i].text)) for i in restarted
    )
    counts["edits_applied_after_restart"] = sum(i in applied for i in restarted)
    counts["restart_edits_as_planned"] = sum(_edits_as_planned(turns, i) for i in restarted)
    for name, error in _EDIT_ERRORS.items():
        counts[name] = sum(
            bool(_EDIT_CALL.search(turns[i].text) and error.search(turns[i].after))
            for i in restarted
        )
    failing = [i for i, code in exits if code != 0]
    if failing:
        first = failing[0]
        counts["failing_test"] = 1
        counts["summary_at_failure"] = asked = turns[first].after.rstrip().endswith(SUMMARY_OPEN)
        summary = turns[first + 1].text if asked and first + 1 < len(turns) else ""
        counts["fix_planned_at_failure"] = _planned_fix(summary) is not None
        counts["summary_names_function"] = bool(function) and summary.startswith(f"{function} (")
        counts["edit_after_failure"] = any(i > first for i in applied)
        counts["reward_1_after_failure"] = reward >= 1
    if exits and exits[0][1] == 0:
        counts["first_test_passed"] = 1
        counts["reward_1_first_test_passed"] = reward >= 1
    return counts


def _planned_fix(summary: str) -> str | None:
    """The fix a summary states: its indented (function body) lines, blank lines among them
    kept, after "The fix writes:"; None when it states none."""
    _, stated, rest = summary.partition("The fix writes:\n")
    lines = []
    for line in rest.split(SUMMARY_CLOSE, 1)[0].split("\n"):
        if line.strip() and not line[0].isspace():
            break
        lines.append(line)
    fix = "\n".join(lines).strip("\n")
    return fix if stated and fix else None


def _edits_as_planned(turns: list[Turn], i: int) -> bool:
    """Whether turn `i` edits in the fix its generation's summary stated."""
    summaries = [j for j in range(i) if turns[j].generation == turns[i].generation - 1]
    planned = _planned_fix(turns[summaries[-1]].text) if summaries else None
    return planned is not None and any(
        call.tool == "edit_file" and call.args.get("new", "").strip("\n") == planned
        for call in envs.parse_turn(turns[i].text).calls
    )


def run_flow(workdir: str) -> dict[str, int]:
    """The counts summed over every sample of the run's ledger."""
    tokenizer = run_tokenizer(workdir)
    ledger = GroupLedger(os.path.join(workdir, "ledger"))
    total = collections.Counter()
    for group_id in ledger:
        group = ledger.load(group_id)
        chains = collections.defaultdict(list)
        for seq in group_sequences(group):
            chains[seq.sample_index].append(seq)
        for sample, chain in chains.items():
            decode = lambda ids: tokenizer.decode(np.asarray(ids).tolist())  # noqa: E731
            turns = chain_turns(chain, decode)
            named = _FUNCTION.search(decode(chain[0].tokens[: _first_turn(chain[0])]))
            total += sample_flow(turns, float(group.rewards[sample]), named[1] if named else "")
    if not total["samples"]:
        raise SystemExit(f"{workdir}: no samples in its ledger")
    return {name: int(total[name]) for name in COLUMNS}


def main(argv):
    runs = argv[1:]
    if not runs:
        raise app.UsageError("name one or more RL run folders")
    table = {run: run_flow(run) for run in runs}
    print("| run | " + " | ".join(COLUMNS) + " |")
    print("| --- | " + " | ".join("---:" for _ in COLUMNS) + " |")
    for run, counts in table.items():
        print(f"| {run} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    app.run(main)
