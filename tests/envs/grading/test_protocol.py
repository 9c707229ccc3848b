"""Protocol round trips (through the byte tokenizer too), a fuzzed parser, and a long output's
head cut with its end kept."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_jax.data import ByteTokenizer
from composer_jax.envs.environment import EnvConfig, Episode
from composer_jax.envs.grading.protocol import (
    EpisodeCounts,
    count_bytes,
    cut_output_head,
    cuttable_output_lines,
    parse_turn,
    render_call,
    render_output,
    render_turn,
)
from composer_jax.envs.tasks.builtin_tasks import make_task

MARKERS = ("<think>", "</think>", "<call", "</call>", "<arg", "</arg>", "<final>", "</final>")
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60).filter(
    lambda s: not any(m in s for m in MARKERS)
)
name = st.text(st.sampled_from("abcdefgh_"), min_size=1, max_size=8)
# An argument value may hold every marker but the closing ones a turn's generation stops at
# ("</call>", "</final>") and "</arg>": render_call refuses those.
CLOSING = ("</arg>", "</call>", "</final>")
value = st.lists(
    st.one_of(st.sampled_from([m for m in MARKERS if m not in CLOSING]), text), max_size=6
).map("".join)


@given(
    text,
    st.lists(st.tuples(name, st.dictionaries(name, value, max_size=3)), max_size=3),
    st.one_of(st.none(), text),
)
@settings(max_examples=150, deadline=None)
def test_render_parse_round_trip(thinking, calls, final):
    rendered = render_turn(thinking, tuple(calls), final)
    turn = parse_turn(rendered)
    assert turn.errors == ()
    assert turn.thinking == thinking
    assert [(c.tool, c.args) for c in turn.calls] == [(t, a) for t, a in calls]
    assert turn.final == final
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(rendered)) == rendered
    output = render_output("run_shell", thinking)
    assert tokenizer.decode(tokenizer.encode(output)) == output


@pytest.mark.parametrize("marker", CLOSING)
def test_a_value_holding_a_closing_marker_is_refused(marker):
    """The parse would end the call (or the sampler the turn) there: the file written would be
    cut short and the rest read as more of the turn."""
    with pytest.raises(ValueError, match="argument value must not contain"):
        render_call("write_file", {"path": "notes.txt", "content": f"a {marker} b"})


@given(
    st.one_of(
        st.text(max_size=500),
        st.lists(
            st.one_of(
                st.sampled_from(MARKERS + ('<call tool="x">', '<arg name="p">', ">", '"')),
                st.text(max_size=20),
            ),
            max_size=60,
        ).map("".join),
    )
)
@settings(max_examples=400, deadline=None)
def test_parser_is_total(model_output):
    turn = parse_turn(model_output)
    counts = EpisodeCounts()
    counts.add_turn(turn, count_bytes)
    assert counts.turns == 1


def test_parser_is_linear_on_adversarial_input():
    for piece in ("<call", '<call tool="a">' + "<arg", "<think>" * 2 + "</think"):
        start = time.monotonic()
        parse_turn(piece * 40_000)
        assert time.monotonic() - start < 2.0


def test_malformed_output_reports_errors():
    turn = parse_turn('<call tool="write_file"><arg name="path">a.py</arg>')
    assert turn.calls[0].args == {"path": "a.py"} and turn.errors
    assert parse_turn("just text").untagged == "just text"


def test_counts_cover_each_kind():
    output = render_turn("plan", (("run_tests", {}),), None) + " stray"
    turn = parse_turn(output)
    counts = EpisodeCounts()
    counts.add_turn(turn, count_bytes)
    assert counts.tool_calls == 1 and counts.turns == 1
    total = counts.thinking_tokens + counts.tool_call_tokens + counts.final_tokens
    assert total == count_bytes(output)


def test_render_rejects_unrepresentable_values():
    with pytest.raises(ValueError):
        render_call("write_file", {"content": "x</arg>"})


@given(
    st.lists(
        st.one_of(
            st.text(max_size=80),
            st.sampled_from(
                [
                    '<call tool="read_file"><arg name="path">solution.py</arg></call>',
                    '<call tool="write_file"><arg name="path">../x</arg>'
                    '<arg name="content">1</arg></call>',
                    '<call tool="list_dir"><arg name="path">',
                    '<call tool="nope">',
                    "<final>",
                    "</call>",
                ]
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
@settings(max_examples=25, deadline=None)
def test_episode_step_never_raises(turns):
    with Episode(make_task(3), EnvConfig(max_turns=3)) as episode:
        for text in turns:
            result = episode.step(text)
            assert isinstance(result.observation, str)
            if result.done:
                assert 0.0 <= result.reward <= 1.0
                break


def test_counts_in_any_tokenizers_tokens(tmp_path):
    """`count_tokens` may be a real tokenizer's: each kind counts that tokenizer's tokens."""
    from composer_jax.data import load_tokenizer
    from tests.data.helpers import make_hf_folder

    make_hf_folder(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    output = "hm " + render_turn("plan é中", (("write_file", {"path": "a.py", "content": "x=1"}),))
    turn = parse_turn(output)
    counts = EpisodeCounts()
    counts.add_turn(turn, tokenizer.count_tokens)
    count = tokenizer.count_tokens
    assert counts.thinking_tokens == count(turn.think_text) + count(turn.untagged) > 0
    assert counts.tool_call_tokens == count(turn.calls[0].text) > 0
    assert counts.tool_call_tokens < count_bytes(turn.calls[0].text)  # BPE merges bytes


def test_a_cut_takes_the_last_outputs_head_and_keeps_what_was_raised_and_how_it_ended():
    edited = render_output("edit_file", "edited a.py")
    pytest_run = render_output(
        "run_tests",
        "F\n____ test_f ____\n    def test_f():\n>       assert f(1) == 2\nE       assert 3 == 2\n"
        "E        +  where 3 = f(1)\n=== short test summary info ===\n"
        "FAILED tests/test_a.py::test_f - assert 3 == 2\n1 failed in 0.05s\n[exit code 1]",
    )
    observation = f"{edited}\n{pytest_run}"
    assert cuttable_output_lines(observation) == 4  # up to pytest's last run of `E` lines
    cut = cut_output_head(observation, 4, "[{} lines cut]")
    assert cut.startswith(f'{edited}\n<output tool="run_tests">\n[4 lines cut]\nE       assert 3')
    assert cut.endswith("1 failed in 0.05s\n[exit code 1]\n</output>")
    traceback = (
        "Traceback:\n  File a.py\n    f()\nValueError: no\nduring it\nKeyError: k\n[exit code 1]"
    )
    assert cuttable_output_lines(render_output("run_tests", traceback)) == 5  # the last raised
    # Nothing raised: all but the last two lines; a printed tag is not the output's opening.
    printed = render_output("run_shell", 'a\n<output tool="x">\nb\n</output>\nc\n[exit code 0]')
    assert cuttable_output_lines(printed) == 4
    assert (
        cut_output_head(printed, 4, "[{}]")
        == '<output tool="run_shell">\n[4]\nc\n[exit code 0]\n</output>'
    )
    for whole in (edited, render_output("run_tests", "ok\n[exit code 0]"), f"{pytest_run}\nnote"):
        assert cuttable_output_lines(whole) == 0
