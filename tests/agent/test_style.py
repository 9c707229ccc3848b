"""The style monitor reads the diff as code: comments by tokenizer, code by the AST, only the
lines the episode added."""

from composer_jax.agent.style import MAX_LINE, added_lines, diff_issues, file_issues

BEFORE = """import os


def f(x):
    # An old comment the task came with.
    # x = old_code(x)
    raise NotImplementedError
"""


def _kinds(after, before=BEFORE):
    return sorted({(issue.line, issue.kind) for issue in file_issues("m.py", before, after)})


def test_only_added_lines_count():
    after = BEFORE.replace("    raise NotImplementedError\n", "    return x + 1\n")
    assert added_lines(BEFORE, after) == {7}
    assert _kinds(after) == []  # the task's own commented-out line is not the agent's


def test_commented_out_code_is_told_from_prose():
    after = BEFORE.replace(
        "    raise NotImplementedError\n",
        "    # y = helper(x)\n    # keep the sign of x, then add one\n    # return x\n"
        "    return x + 1  # plus one\n",
    )
    assert _kinds(after) == [(7, "commented_out_code"), (9, "commented_out_code")]


def test_a_long_comment_block_and_long_or_tabbed_lines():
    block = "".join(f"    # note {i} about the reasoning\n" for i in range(4))
    after = BEFORE.replace("    raise NotImplementedError\n", block + "\treturn x\n")
    kinds = _kinds(after.replace("\treturn x", "    return x"))
    assert kinds == [(n, "long_comment") for n in range(7, 11)]
    three = "".join(f"    # note {i}\n" for i in range(3))
    assert _kinds(BEFORE.replace("    raise NotImplementedError\n", three + "    return x\n")) == []
    long = "    return x + " + " + ".join(["1"] * 60) + "\n"
    assert len(long.rstrip()) > MAX_LINE
    assert _kinds(BEFORE.replace("    raise NotImplementedError\n", long)) == [(7, "long_line")]
    tabbed = "def g(y):\n\treturn y\n"
    assert _kinds(tabbed, before=None) == [(2, "tab_indent")]


def test_a_hash_in_a_string_is_no_comment_and_broken_code_counts_whole():
    after = BEFORE.replace("    raise NotImplementedError\n", '    return "# x = 1"\n')
    assert _kinds(after) == []
    broken = BEFORE.replace("    raise NotImplementedError\n", "    return (x +\n    y = 2\n")
    kinds = _kinds(broken)
    assert {k for _, k in kinds} == {"syntax_error"} and [n for n, _ in kinds] == [7, 8]


def test_diff_issues_read_only_changed_python_files():
    changes = {
        "m.py": {
            "before": BEFORE,
            "after": BEFORE.replace("raise NotImplementedError", "# z = x\n    return x"),
        },
        "notes.txt": {"before": None, "after": "# x = 1\n"},
        "gone.py": {"before": "x = 1\n", "after": None},
    }
    issues, added = diff_issues(changes)
    assert [(i.path, i.kind) for i in issues] == [("m.py", "commented_out_code")]
    assert added == 2
