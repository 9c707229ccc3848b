"""The scripted agent: its change is the smallest unique hunk of the oracle solution, and its
episodes, played through the RL workflow in the real environment, solve the task with every tool
the profile offers (summaries included) and become SFT examples with the loss on its turns; a
scripted mistake is flagged by its detector, put right, and teaches the hint, not the mistake."""

import dataclasses
import difflib

import numpy as np
import pytest

from composer_jax import agent, data, envs, presets
from composer_jax.agent.oracle import (
    MISTAKES,
    Change,
    OracleEngine,
    OracleScript,
    failing_test_line,
    plan_change,
    unique_hunk,
    wrong_bodies,
)
from composer_jax.agent.sft import _scripts as sft_scripts
from composer_jax.agent.sft import episode_examples, sft_examples
from composer_jax.agent.workflow import SUMMARY_CLOSE, SUMMARY_OPEN
from composer_jax.config import ConfigError
from composer_jax.envs.tools import tool_profile

TOKENIZER = data.get_tokenizer("byte")


def test_the_change_is_the_removed_body_and_unique():
    task = envs.load_task_source("builtin_repo").take(1, "train", seed=2)[0]
    change = plan_change(task)
    path, stub = change.path, task.files[change.path]
    assert change.old == "    raise NotImplementedError\n" and stub.count(change.old) == 1
    assert stub.replace(change.old, change.new) == task.oracle_files[path]
    assert stub.splitlines()[change.line - 1].startswith(f"def {change.name}(")
    assert change.doc.startswith("x is ")
    # A stub repeated in the file widens the hunk until it is unique.
    twice = dataclasses.replace(
        task,
        files={**task.files, path: stub + "\n\ndef other(x):\n    raise NotImplementedError\n"},
        oracle_files={
            path: task.oracle_files[path] + "\n\ndef other(x):\n    raise NotImplementedError\n"
        },
    )
    widened = plan_change(twice)
    assert twice.files[path].count(widened.old) == 1 and widened.name == change.name
    assert twice.files[path].replace(widened.old, widened.new) == twice.oracle_files[path]


_SOLUTION = (
    "def f(xs, n):\n"
    '    """Return True and 2 < 3 when it is."""\n'
    "    total = 0\n"
    "    for x in xs:\n"
    "        total += x * 2\n"
    "    if total > n and True:\n"
    "        return total\n"
    "    return total // 2\n"
)
_STUB = (
    'def f(xs, n):\n    """Return True and 2 < 3 when it is."""\n    raise NotImplementedError\n'
)


def test_wrong_bodies_change_one_line_of_code_each():
    """Each kind of wrong body changes one code line (a left-out statement drops one); the
    docstring, a `return` and a block's only statement are never the line changed."""
    old, new, _, start = unique_hunk(_STUB, _SOLUTION)
    change = Change("m.py", old, new, "f", 1, 3, "", start)
    found = wrong_bodies(change, _STUB, _SOLUTION)
    changed = {}
    for kind, wrong in found.items():
        changed[kind] = set()
        for body in wrong:
            removed = [line for line in new.splitlines() if line not in body.splitlines()]
            added = [line for line in body.splitlines() if line not in new.splitlines()]
            assert len(removed) == 1 and len(added) <= 1, (kind, body)
            changed[kind].add((removed[0].strip(), added[0].strip() if added else None))
    assert changed["off_by_one"] == {("return total // 2", "return (total // 2) + 1")}
    assert changed["operator"] == {
        ("total += x * 2", "total -= x * 2"),
        ("if total > n and True:", "if total >= n and True:"),
        ("if total > n and True:", "if total > n or True:"),
        ("if total > n and True:", "if total > n and False:"),
        ("return total // 2", "return total / 2"),
    }
    assert changed["constant"] == {
        ("total = 0", "total = 1"),
        ("total += x * 2", "total += x * 3"),
        ("return total // 2", "return total // 3"),
    }
    assert changed["dropped_line"] == {("total = 0", None)}
    # A solution's hunk that is only a docstring and a `return` has no operator or line to drop.
    doc_only = 'def g():\n    """a < b and True"""\n    return x\n'
    g_stub = _STUB.replace("f(xs, n)", "g()")
    old, new, _, start = unique_hunk(g_stub, doc_only)
    only = wrong_bodies(Change("m.py", old, new, "g", 1, 3, "", start), g_stub, doc_only)
    assert {kind for kind, wrong in only.items() if wrong} == {"off_by_one"}


def test_a_hunk_is_unique_at_its_place_and_only_added_code_is_made_wrong():
    # A blank line occurs at two places, overlapping the one the fix must widen around.
    solution = "def f(x):\n    y = x * 2\n\n    y = y + 1\n\n    return y\n"
    wrong = solution.replace("    y = y + 1\n", "")
    old, new, _, _ = unique_hunk(wrong, solution)
    assert wrong.replace(old, new, 1) == solution
    # A form feed above (a line break to `str.splitlines`, not to `ast`) moves no row, and a
    # context line the widening took in (the signature) is never made wrong.
    stub = "\x0c\ndef f(x, n=0):\n    raise NotImplementedError\n\n\n"
    stub += "def g(x):\n    raise NotImplementedError\n"
    solution = stub.replace("    raise NotImplementedError\n", "    y = x + 5\n    return y\n", 1)
    old, new, _, start = unique_hunk(stub, solution)
    assert old.startswith("def f(x, n=0):")  # widened: the stub line occurs twice
    found = wrong_bodies(Change("m.py", old, new, "f", 2, 3, "", start), stub, solution)
    assert [body.splitlines()[1] for body in found["constant"]] == ["    y = x + 6"]
    assert found["dropped_line"] == [new.replace("    y = x + 5\n", "")]
    # A docstring line that reads like a `return` is not code.
    solution = 'def h(x):\n    """Doc.\n    return x + 1 is wrong\n    """\n    return x\n'
    stub = "def h(x):\n    raise NotImplementedError\n"
    old, new, _, start = unique_hunk(stub, solution)
    found = wrong_bodies(Change("m.py", old, new, "h", 1, 2, "", start), stub, solution)
    assert [body.splitlines()[-1] for body in found["off_by_one"]] == ["    return (x) + 1"]
    assert all("is wrong" in body for wrong in found.values() for body in wrong)


def test_the_failing_test_line_is_what_was_raised():
    pytest_output = (
        "F\n    assert f(2) == 5\nE   AssertionError: assert 4 == 5\n1 failed in 0.05s\n"
    )
    script_output = 'Traceback ...\n    x + 1\nTypeError: can only concatenate str (not "int")\n'
    for printed, code, line in [
        (pytest_output, 1, "E   AssertionError: assert 4 == 5"),
        (script_output, 1, 'TypeError: can only concatenate str (not "int")'),
        ("ok\n", 0, ""),  # it passed: nothing failed
        ("boom\n", 2, "boom"),  # nothing raised: the last line
    ]:
        transcript = envs.render_output("run_tests", f"{printed}[exit code {code}]")
        assert failing_test_line(transcript) == line


def test_the_script_uses_only_the_tools_offered():
    task = envs.load_task_source("builtin_repo").take(1, "train", seed=2)[0]
    full = [envs.parse_turn(t).calls for _, _, t in OracleScript(task, tool_profile("agent")).steps]
    tools = [c[0].tool if c else "final" for c in full]
    assert tools == ["search_code", "read_file", "todo", "edit_file", "run_tests", "todo", "final"]
    bare = OracleScript(task, ("write_file",))
    assert [envs.parse_turn(t).calls[0].tool for _, _, t in bare.steps[:-1]] == ["write_file"]


def _played(rl, tasks, tokenizer=TOKENIZER, scripts=None):
    model = presets.rl_tiny().model
    workflow, env = agent.build(
        rl.agent,
        tokenizer,
        model,
        max_len=rl.rollout.context_len,
        sampling=agent.rollout_sampling(rl.rollout),
        distill=rl.objective.distill_coef > 0,
    )
    engine = OracleEngine(
        scripts or [OracleScript(t, env.tools, env.open_tab_lines) for t in tasks],
        tokenizer,
        4,
        rl.rollout.context_len,
        model.num_moe_layers,
        model.num_experts_per_tok,
    )
    return agent.play(engine, [(t, f"o{i}") for i, t in enumerate(tasks)], workflow, env)


def test_scripted_episodes_solve_repository_tasks_through_the_workflow():
    rl = dataclasses.replace(
        presets.rl_agent_tiny().rl,
        agent=dataclasses.replace(presets.rl_agent_tiny().rl.agent, open_tab_lines=0),
    )  # every tool used
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source("builtin_repo:max_ops=2").take(4, "train", seed=5)
    outcomes = _played(rl, tasks, tokenizer)
    assert [o.reward for o in outcomes] == [1.0] * 4
    assert all(o.num_turns == 7 and o.num_tool_calls == 6 for o in outcomes)
    assert all(o.summaries >= 1 for o in outcomes)  # the preset's budget is reached
    assert all(o.behaviour == dict.fromkeys(o.behaviour, 0.0) for o in outcomes)  # a clean agent
    chain = outcomes[0].sequences
    after = tokenizer.decode(chain[1].tokens)
    assert SUMMARY_OPEN in after and "Done: " in after and "Next: " in after


def test_with_the_function_in_an_open_tab_the_script_edits_at_once():
    rl = dataclasses.replace(
        presets.rl_agent_tiny().rl,
        agent=dataclasses.replace(
            presets.rl_agent_tiny().rl.agent, open_tab_lines=40, summary_budget=0
        ),
    )
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source("builtin_repo:max_ops=2").take(2, "train", seed=5)
    tools = [
        [
            envs.parse_turn(t).calls[0].tool
            for _, _, t in OracleScript(task, rl.agent.tools.split(","), 40).steps[:-1]
        ]
        for task in tasks
    ]
    assert tools == [["todo", "edit_file", "run_tests", "todo"]] * 2
    outcomes = _played(rl, tasks, tokenizer)
    assert [o.reward for o in outcomes] == [1.0] * 2 and all(o.num_turns == 5 for o in outcomes)
    first = tokenizer.decode(outcomes[0].sequences[0].tokens)
    assert "Open in the editor: helpers/" in first and 'tool="search_code"' not in first


def test_a_restart_after_an_edit_shows_the_open_tab_as_the_edit_left_it():
    """A summary restarts the generation from the task's first observation, whose tab shows the
    stub; once the episode has edited the function, the restart shows it as it is now."""
    base = presets.rl_agent_tiny().rl
    rl = dataclasses.replace(
        base,
        agent=dataclasses.replace(base.agent, open_tab_lines=40, summary_budget=1, max_summaries=2),
    )
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source("builtin_repo:max_ops=2").take(2, "train", seed=5)
    for task, outcome in zip(tasks, _played(rl, tasks, tokenizer)):
        assert outcome.reward == 1.0 and outcome.summaries == 2
        change = plan_change(task)
        after = [
            tokenizer.decode(s.tokens).rsplit(SUMMARY_CLOSE, 1)[1] for s in outcome.sequences[1:]
        ]
        assert "Open in the editor" not in after[0]  # the first summary came before the edit
        assert after[1].startswith(f"\nOpen in the editor: {change.path}, lines ")
        assert change.new in after[1] and "NotImplementedError" not in after[1]


def test_episode_examples_train_on_the_agents_tokens_only(tmp_path):
    cfg = presets.rl_agent_tiny()
    cfg = dataclasses.replace(
        cfg,
        rl=dataclasses.replace(cfg.rl, agent=dataclasses.replace(cfg.rl.agent, open_tab_lines=0)),
    )
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source(cfg.data.tasks).take(3, "train", seed=0)
    examples = episode_examples(cfg.rl.agent, cfg.rl.rollout, cfg.model, tokenizer, tasks)
    assert len(examples) >= 6  # two or more generations per episode
    for example in examples:
        tokens, mask = example["tokens"], example["loss_mask"]
        assert tokens.shape == mask.shape and len(tokens) < cfg.rl.rollout.context_len
        taught = tokenizer.decode(tokens[mask == 1])
        assert "<call" in taught or "<final>" in taught or "Done: " in taught
        assert "<output" not in taught and "Tools:" not in taught
    first_turn = sft_examples(presets.rl_tiny())(TOKENIZER)
    assert isinstance(first_turn[0], tuple) and "write_file" in first_turn[0][1]


def test_a_repaired_episode_fails_the_tests_fixes_the_line_and_learns_only_the_fix():
    """With `repair_rng` the script first edits in a body with one line wrong: the visible
    tests fail, the next generation (the preset's budget asks for a summary at the traceback)
    sees the wrong body in its open tab, edits that line alone and tests again. The wrong edit
    is left out of the loss; the fix is learned."""
    cfg = presets.rl_agent_tiny()
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source(cfg.data.tasks).take(8, "train", seed=0)
    env = agent.env_config(cfg.rl.agent)
    # The scripts `episode_examples` plays below (seed 0, every one a repair where it can be).
    clean, scripts = sft_scripts(tasks, env, (), 0.0, 0, repairs=1.0)
    assert len(clean) == len(tasks) and not any(s.repaired for s in clean)
    assert len(scripts) >= 4
    outcomes = _played(cfg.rl, [s.task for s in scripts], tokenizer, scripts)
    assert [o.reward for o in outcomes] == [1.0] * len(scripts)
    failed = single = at_failure = told = 0
    for script, outcome in zip(scripts, outcomes):
        change, (fix_old, fix_new) = script.change, script.fix
        edits = [c.args for c in outcome.trace.tool_calls if c.tool == "edit_file"]
        wrong = edits[0]["new"]
        assert edits[0] == {"path": change.path, "old": change.old, "new": wrong}
        assert edits[1] == {"path": change.path, "old": fix_old, "new": fix_new}
        edited = script.task.files[change.path].replace(change.old, wrong, 1)
        assert edited.count(fix_old) == 1
        assert edited.replace(fix_old, fix_new) == script.task.oracle_files[change.path]
        diff = list(difflib.ndiff(fix_old.splitlines(), fix_new.splitlines()))
        assert sum(line[0] == "+" for line in diff) == 1  # one line put right
        assert sum(line[0] == "-" for line in diff) <= 1
        single += len(fix_old.splitlines()) == 1
        first = tokenizer.decode(outcome.sequences[0].tokens)
        failed += "[exit code 1]" in first.split('<output tool="run_tests">', 1)[1]
        # A summary at the failure holds, within its token budget, the lines the fix writes
        # and leaves the lines it replaces to the open tab; what failed follows, room allowing.
        summary = first[first.rfind(SUMMARY_OPEN) :]
        if f"Next: fix {change.name}." in summary:
            assert f"The fix writes:\n{fix_new.rstrip()}\n" in summary, summary
            replaced = set(fix_old.splitlines()) - set(fix_new.splitlines())
            assert not any(line in summary for line in replaced)
            assert failing_test_line(first) and failing_test_line(first) not in fix_new
            told += f"The tests failed: {failing_test_line(first)}" in summary
            at_failure += 1
    assert failed >= 4 and single >= 1 and at_failure >= 2 and told >= 1
    examples = episode_examples(
        cfg.rl.agent, cfg.rl.rollout, cfg.model, tokenizer, tasks, repairs=1.0
    )
    taught = "".join(tokenizer.decode(e["tokens"][e["loss_mask"] == 1]) for e in examples)
    shown = "".join(tokenizer.decode(e["tokens"]) for e in examples)
    clean_edits = [
        envs.render_call(
            "edit_file", {"path": s.change.path, "old": s.change.old, "new": s.change.new}
        )
        for s in clean
    ]
    kept = 0
    for script, outcome in zip(scripts, outcomes):
        edits = [c.args for c in outcome.trace.tool_calls if c.tool == "edit_file"]
        mistake, fix = (envs.render_call("edit_file", args) for args in edits)
        # A wrong body can be another task's solution (a step left out): only that is taught.
        assert taught.count(mistake) == clean_edits.count(mistake)
        kept += fix in taught
        if mistake not in clean_edits:  # a repair the tests missed is left out whole
            assert (fix in taught) == (mistake in shown)
        assert clean_edits[tasks.index(script.task)] in taught  # its clean episode, beside
    assert kept == failed


def test_episodes_that_do_not_fit_are_left_out_and_none_is_an_error():
    cfg = presets.rl_agent_tiny()
    small = dataclasses.replace(
        cfg.rl,
        rollout=dataclasses.replace(cfg.rl.rollout, context_len=200),
        agent=dataclasses.replace(cfg.rl.agent, summary_budget=0),
    )
    cfg = dataclasses.replace(cfg, rl=small, data=dataclasses.replace(cfg.data, sft_tasks=2))
    tasks = envs.load_task_source(cfg.data.tasks).take(2, "train", seed=1)
    outcomes = _played(small, tasks)
    assert all(o.truncated and o.reward == 0 for o in outcomes)  # no room for the episode
    assert episode_examples(cfg.rl.agent, cfg.rl.rollout, cfg.model, TOKENIZER, tasks) == []
    with pytest.raises(ConfigError, match="data.sft_style: the scripted agent solved none"):
        sft_examples(cfg)(TOKENIZER)


def test_a_task_whose_solution_the_protocol_cannot_carry_is_left_out(caplog):
    """A solution holding "</call>" cannot be written as a tool call (the turn would end
    there): its task gets no scripted episode, the others still do."""
    cfg = presets.rl_agent_tiny()
    good, bad = envs.load_task_source(cfg.data.tasks).take(2, "train", seed=0)
    change = plan_change(bad)
    marked = bad.oracle_files[change.path].replace(change.new, change.new + "# </call>\n")
    bad = dataclasses.replace(bad, oracle_files={**bad.oracle_files, change.path: marked})
    tokenizer = data.load_tokenizer("code_bpe_2k")
    examples = episode_examples(cfg.rl.agent, cfg.rl.rollout, cfg.model, tokenizer, [bad, good])
    assert examples  # the good task's
    assert f"task {bad.task_id}: no scripted episode, left out" in caplog.text


def _agent_without_summaries():
    """The agent preset with the summary budget off: an episode is one generation."""
    cfg = presets.rl_agent_tiny()
    rl = dataclasses.replace(
        cfg.rl, agent=dataclasses.replace(cfg.rl.agent, summary_budget=0, max_turns=8)
    )
    return dataclasses.replace(cfg, rl=rl)


@pytest.mark.parametrize("kind", sorted(MISTAKES))
def test_a_scripted_mistake_is_rejected_flagged_by_its_detector_and_then_put_right(kind):
    cfg = _agent_without_summaries()
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source(cfg.data.tasks).take(3, "train", seed=4)
    workflow, env = agent.build(
        cfg.rl.agent,
        tokenizer,
        cfg.model,
        max_len=cfg.rl.rollout.context_len,
        sampling=agent.rollout_sampling(cfg.rl.rollout),
        distill=True,
    )
    rng = np.random.default_rng()
    scripts = [OracleScript(t, env.tools, env.open_tab_lines, rng, (kind,)) for t in tasks]
    engine = OracleEngine(
        scripts,
        tokenizer,
        4,
        cfg.rl.rollout.context_len,
        cfg.model.num_moe_layers,
        cfg.model.num_experts_per_tok,
    )
    outcomes = agent.play(engine, [(t, f"o{i}") for i, t in enumerate(tasks)], workflow, env)
    for outcome, script in zip(outcomes, scripts):
        ((wrong, right),) = script.mistakes
        assert wrong != right
        assert outcome.reward == 1.0, wrong  # the episode still solves the task
        # The one flag is the mistake's own detector: the next call answers the error.
        assert outcome.feedback == {MISTAKES[kind]: 1}, wrong
        failed = [c for c in outcome.trace.tool_calls if not c.ok]
        assert len(failed) == 1 and outcome.num_turns == len(script.steps) + 1


def test_feedback_examples_teach_the_hints_and_not_the_mistakes():
    cfg = _agent_without_summaries()
    tokenizer = data.load_tokenizer("code_bpe_2k")
    tasks = envs.load_task_source(cfg.data.tasks).take(4, "train", seed=6)
    args = (cfg.rl.agent, cfg.rl.rollout, cfg.model, tokenizer, tasks)
    plain = episode_examples(*args)
    examples = episode_examples(*args, feedback=1.0, seed=int(np.random.default_rng().integers(99)))
    assert len(plain) == 4 and all("[feedback]" not in tokenizer.decode(e["tokens"]) for e in plain)
    generations, hinted = examples[0::3], [e for i, e in enumerate(examples) if i % 3]
    assert len(generations) == 4 and len(hinted) == 8  # each mistake: its detector's and a repeat's
    for generation, plain_generation in zip(generations, plain):
        taught = tokenizer.decode(generation["tokens"][generation["loss_mask"] == 1])
        # What the plain episode teaches, and not one token of the mistake.
        assert taught == tokenizer.decode(
            plain_generation["tokens"][plain_generation["loss_mask"] == 1]
        )
    for example in hinted:
        tokens, mask = example["tokens"], example["loss_mask"]
        assert mask[-1] == 1 and mask.sum() == len(tokens) - np.argmax(mask)  # the turn alone
        context = tokenizer.decode(tokens[mask == 0])
        assert context.splitlines()[-1].startswith("[feedback] ")
        assert envs.parse_turn(tokenizer.decode(tokens[mask == 1])).calls
