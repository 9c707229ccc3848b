"""Tools: strict/lenient argument checking, workspace confinement, errors go to the agent."""

import pytest

from composer_jax.envs.sandbox import Sandbox
from composer_jax.envs.tools import TOOL_SPECS, ToolBox, ToolError, check_args

ALL = tuple(TOOL_SPECS)


@pytest.fixture
def tools(tmp_path):
    box = Sandbox.from_files({"a.py": "x = 1\ny = 2\n", "d/b.txt": "needle\n"}, root=str(tmp_path))
    yield ToolBox(box, ALL, test_command="python3 a.py && echo tests-ok")
    box.close()


def test_file_tools(tools):
    assert tools.call("read_file", {"path": "a.py", "start": "2", "end": "2"})[0] == "y = 2\n"
    assert tools.call("write_file", {"path": "new/c.py", "content": "z"})[1].ok
    assert tools.call("edit_file", {"path": "a.py", "old": "x = 1", "new": "x = 3"})[1].ok
    assert tools.call("read_file", {"path": "/workspace/a.py"})[0].startswith("x = 3")
    assert tools.call("list_dir", {})[0].split() == ["a.py", "d/", "new/"]
    assert "d/b.txt:1:needle" in tools.call("grep", {"pattern": "nee+dle"})[0]
    assert "tests-ok" in tools.call("run_tests", {})[0]
    assert "exit code 3" in tools.call("run_shell", {"command": "exit 3"})[0]


@pytest.mark.parametrize(
    "tool,args,message",
    [
        ("read_file", {"path": "../../etc/passwd"}, "outside the workspace"),
        ("read_file", {"path": "/etc/passwd"}, "outside the workspace"),
        ("read_file", {"path": "a.py", "start": "one"}, "must be an integer"),
        ("read_file", {}, "missing argument 'path'"),
        ("read_file", {"path": "a.py", "bogus": "1"}, "unknown argument"),
        ("edit_file", {"path": "a.py", "old": "nothere", "new": ""}, "exactly once"),
        ("launch_missiles", {}, "unknown tool"),
        ("write_file", {"path": "d", "content": "x"}, "is a directory"),
    ],
)
def test_bad_calls_return_errors(tools, tool, args, message):
    text, record = tools.call(tool, args)
    assert not record.ok and message in text and text.startswith("error:")
    assert record.seconds >= 0 and record.output_bytes == len(text.encode())


def test_symlink_escape_is_refused(tools):
    tools.call("run_shell", {"command": "ln -s /etc/passwd link"})
    assert "outside the workspace" in tools.call("read_file", {"path": "link"})[0]


def test_lenient_mode_tolerates_what_strict_rejects():
    spec = TOOL_SPECS["read_file"]
    args = {"path": "a", "start": " 3 ", "extra": "x"}
    with pytest.raises(ToolError):
        check_args(spec, args, strict=True)
    assert check_args(spec, args, strict=False) == {"path": "a", "start": 3}


def test_output_is_truncated_and_calls_logged(tmp_path):
    with Sandbox.from_files({}, root=str(tmp_path)) as box:
        tools = ToolBox(box, ("run_shell",), max_output_bytes=100)
        text, _ = tools.call("run_shell", {"command": "seq 1 1000"})
        assert "output truncated" in text
        assert [r.tool for r in tools.log] == ["run_shell"]
        assert "unknown tool" in tools.call("read_file", {"path": "x"})[0]


def test_schema_is_json_schema_like():
    schema = TOOL_SPECS["edit_file"].schema()
    assert schema["parameters"]["required"] == ["path", "old", "new"]
    assert schema["parameters"]["additionalProperties"] is False
