"""Unforgeable grading: the verdict comes from the harness's nonce line only, the code under test
never shares a process with the expected answers, and every known trick scores 0 and is flagged.
Also the harness's plain-data codec and HumanEval through the grader."""

import json
import math
import pathlib
import random
import shlex
import tempfile
import threading
import time

import pytest

from composer_jax import envs
from composer_jax.envs.environment import run_episode
from composer_jax.envs.grading import harness
from composer_jax.envs.grading import task as grading_task
from composer_jax.envs.grading.protocol import render_turn
from composer_jax.envs.grading.task import case_tests, encode_value, grade_solution
from composer_jax.envs.sandbox import isolation
from composer_jax.envs.tasks.humaneval import humaneval_tasks

TASK = envs.make_task(11)


def _attack(source: str, task=TASK, config=envs.EnvConfig()):
    write = render_turn(calls=(("write_file", {"path": "solution.py", "content": source}),))
    return run_episode(task, [write, render_turn(final="done")], config)


# A well-formed verdict line under a nonce the candidate can only guess.
_GUESSED_NONCE = "0" * 32
_FORGED_LINE = (
    _GUESSED_NONCE
    + " "
    + json.dumps({"tests": {t: "pass" for t in TASK.graded_tests}, "scores": {}})
)
# Finds the spec's cases among the objects of its own process and answers from them.
_ANSWER_THIEF = """
import gc


def _plain(data):
    tag, payload = data[0], data[1:]
    if tag == "none":
        return None
    if tag in ("list", "tuple"):
        items = [_plain(item) for item in payload[0]]
        return items if tag == "list" else tuple(items)
    return float.fromhex(payload[0]) if tag == "float" else payload[0]


def f(*args):
    for obj in gc.get_objects():
        if isinstance(obj, dict) and isinstance(obj.get("cases"), list):
            for encoded, want in obj["cases"]:
                if [_plain(a) for a in encoded] == list(args):
                    return _plain(want)
    return None
"""
# Makes every later json.dumps in its process write an all-pass verdict.
_VERDICT_PATCH = (
    "import json\n"
    "_real = json.dumps\n"
    "def _dumps(obj, *args, **kwargs):\n"
    "    if isinstance(obj, dict) and 'tests' in obj:\n"
    "        obj = {**obj, 'tests': {t: 'pass' for t in obj['tests']}}\n"
    "    return _real(obj, *args, **kwargs)\n"
    "json.dumps = _dumps\n"
    "def f(x):\n"
    "    return None\n"
)

ATTACKS = {
    "prints a verdict and exits at import": (
        f"import os\nprint({chr(10) + _FORGED_LINE!r}, flush=True)\nos._exit(0)\n"
    ),
    "builds the verdict at run time and exits": (
        "import json, sys\n"
        "nonce = ''.join(chr(48) for _ in range(32))\n"
        "tests = {'case_%d' % i: 'pass' for i in range(6)}\n"
        "print()\n"
        "print(nonce, json.dumps({'tests': tests, 'scores': {}}))\n"
        "sys.exit(0)\n"
    ),
    "returns an object equal to everything": (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "def f(x):\n"
        "    return Anything()\n"
    ),
    "returns a str subclass equal to everything": (
        "class S(str):\n    __eq__ = lambda self, other: True\ndef f(x):\n    return S('nope')\n"
    ),
    "finds the expected answers among its process's objects": _ANSWER_THIEF,
    "patches json.dumps to write an all-pass verdict": _VERDICT_PATCH,
}


def test_the_attacks_on_the_process_would_win_in_the_graders_process():
    """The controls of the attacks above that a separate process defeats: a grader that held
    the answers and wrote its verdict in the candidate's process would be fooled, and the forged
    line is a verdict the parser takes under the nonce it names."""
    assert grading_task.parse_verdict("\n" + _FORGED_LINE + "\n", _GUESSED_NONCE)[0] == {
        t: "pass" for t in TASK.graded_tests
    }
    spec = json.loads(json.dumps(TASK.grader))  # the answers, held as the harness holds them
    thief = {}
    exec(_ANSWER_THIEF, thief)  # noqa: S102
    cases = [(harness.decode(a), harness.decode(w)) for (a,), w in spec["cases"]]
    assert all(harness.same(thief["f"](arg), want) for arg, want in cases)
    before = json.dumps
    try:
        exec(_VERDICT_PATCH, {})  # noqa: S102
        forged = json.loads(json.dumps({"tests": {"case_0": "fail"}, "scores": {}}))
    finally:
        json.dumps = before
    assert forged["tests"] == {"case_0": "pass"}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_grading_attacks_score_zero_and_are_flagged(name):
    result = _attack(ATTACKS[name])
    assert result.done and result.reward == 0.0
    kinds = {flag.kind for flag in result.flags}
    assert "grader_tampering" in kinds, (name, result.flags)
    assert result.info["grade"]["passed"] == 0  # zero even before the flag zeroes the reward


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_grading_attacks_fail_the_tests_without_any_monitor(name):
    """The harness alone defeats them: graded directly, no monitor involved."""
    assert grade_solution(TASK, {"solution.py": ATTACKS[name]}).passed == 0


def test_the_oracle_passes_and_a_wrong_type_fails():
    assert grade_solution(TASK, TASK.oracle_files).reward == 1.0
    wrong = TASK.oracle_files["solution.py"].replace("return x", "return repr(x)")
    assert grade_solution(TASK, {"solution.py": wrong}).reward == 0.0


def test_code_under_test_holds_only_its_own_pipes_in_the_spare_and_in_a_fresh_child():
    """The candidate's process has descriptors 0-2 (its pipes to the harness) and nothing else:
    not the harness's input (the answers) nor its verdict channel, whether it runs in the child
    forked before the input was read or, after that child died, in a fresh interpreter."""
    source = (
        "import os\n"
        "def f(crash):\n"
        "    if crash:\n"
        "        os._exit(3)\n"
        "    return sorted(os.listdir('/proc/self/fd'))\n"
    )
    # 3: the child's reply channel (a copy of its stdout); 4: the listing's own directory
    own_pipes = encode_value(["0", "1", "2", "3", "4"])
    cases = [
        [[encode_value(crash)], own_pipes if not crash else encode_value(0)]
        for crash in (False, True, False)
    ]
    task = envs.Task(
        task_id="descriptors",
        prompt="",
        files={"solution.py": source},
        grader={"kind": "cases", "module": "solution", "function": "f", "cases": cases},
        graded_tests=case_tests(3),
    )
    outcomes = grade_solution(task, {}).outcomes
    assert outcomes == {"case_0": "pass", "case_1": "error", "case_2": "pass"}


def _secret_task(solution: str) -> tuple[envs.Task, str]:
    """(a task graded on three cases whose expected answers hold a fresh marker, the marker)."""
    marker = f"cj-secret-{random.randrange(10**9)}"
    cases = [[[encode_value(i)], encode_value(f"{marker}-{i}")] for i in range(3)]
    task = envs.Task(
        task_id="secret",
        prompt="",
        files={"solution.py": solution},
        grader={"kind": "cases", "module": "solution", "function": "f", "cases": cases},
        graded_tests=case_tests(3),
    )
    return task, marker


def _spy_task(honest: envs.Task, marker: str) -> envs.Task:
    """`honest`'s task with a solution that searches every readable temporary folder for a file
    holding `marker` (the expected answers) and answers with what it finds."""
    head, tail = marker[:6], marker[6:]  # not written out whole in the spy's own source
    spy_source = (
        "import os\n"
        "def f(x):\n"
        f"    marker = {head!r} + {tail!r}\n"
        "    own = os.getcwd()\n"
        "    for root in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        "        for folder, subfolders, names in os.walk(root):\n"
        "            if folder.startswith(own):\n"
        "                continue\n"
        "            # A grader's files sit near the top and are small: search only there, so the\n"
        "            # search ends while the other sample is still graded, whatever else /tmp holds\n"
        "            # (a clone with its virtualenv took 20 s to read whole).\n"
        "            if folder[len(root):].count(os.sep) >= 3:\n"
        "                subfolders.clear()\n"
        "            for name in names:\n"
        "                path = os.path.join(folder, name)\n"
        "                try:\n"
        "                    if os.path.getsize(path) > 1 << 20:\n"
        "                        continue\n"
        "                    text = open(path, errors='ignore').read()\n"
        "                except OSError:\n"
        "                    continue\n"
        "                if marker in text:\n"
        "                    return marker + '-' + str(x)\n"
        "    return 'nothing'\n"
    )
    return envs.Task(
        **{
            **honest.to_json(),
            "task_id": "spy",
            "files": {"solution.py": spy_source},
            "graded_tests": honest.graded_tests,
        }
    )


@pytest.mark.skipif(not isolation.usable("bwrap"), reason="needs a second backend to compare")
@pytest.mark.parametrize("backend", ["bwrap", "rlimit"])
def test_a_sibling_cannot_read_hidden_answers_while_a_sample_is_graded(backend):
    """Two samples graded at once on the same backend: one slow honest grade, one sample whose
    code searches every readable temporary folder for the other's expected answers."""
    honest, marker = _secret_task("import time\ndef f(x):\n    time.sleep(0.3)\n    return x\n")
    spy = _spy_task(honest, marker)
    options = {"backend": backend, "require_isolation": False}
    results = {}
    slow = threading.Thread(
        target=lambda: results.setdefault("honest", grade_solution(honest, {}, **options))
    )
    slow.start()
    time.sleep(0.2)
    results["spy"] = grade_solution(spy, {}, **options)
    slow.join()
    assert results["spy"].passed == 0


def test_the_spy_finds_answers_a_grader_would_leave_in_a_temporary_folder():
    """The attack above is real: answers written to a file under the system's temporary folder
    (as a grader that kept them on disk would) are found and score every case."""
    honest, marker = _secret_task("def f(x):\n    return x\n")
    with tempfile.TemporaryDirectory(prefix="cj_answers_", dir="/tmp") as folder:
        (pathlib.Path(folder) / "answers.json").write_text(json.dumps(honest.grader["cases"]))
        spied = grade_solution(
            _spy_task(honest, marker), {}, backend="rlimit", require_isolation=False
        )
    assert spied.passed == 3


# -------------------------------------------------------------------------------- the codec


def _random_value(rng, depth=0):
    kind = rng.randrange(9 if depth < 3 else 5)
    if kind == 0:
        return rng.randrange(-(10**30), 10**30)
    if kind == 1:
        return rng.choice([rng.uniform(-1e6, 1e6), math.inf, -0.0, 1e-310])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(5)))
    items = [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return items
    if kind == 6:
        return tuple(items)
    if kind == 7:
        return {str(i): v for i, v in enumerate(items)}
    return frozenset(x for x in items if isinstance(x, (int, str, bytes)))


def test_codec_round_trips_plain_data_with_exact_types():
    rng = random.Random()
    for _ in range(300):
        value = _random_value(rng)
        back = harness.decode(harness.encode(value))
        assert harness.same(back, value) or back == value


def test_codec_refuses_objects_and_malformed_data():
    with pytest.raises(TypeError):
        harness.encode(object())
    for bad in (["int", "1"], ["list", 3], ["nope", 1], "x", [], ["dict", [[1]]], ["bool", 1]):
        with pytest.raises(ValueError):
            harness.decode(bad)
    assert (
        not harness.same(True, 1) and not harness.same(2.0, 2) and harness.same(math.nan, math.nan)
    )


# ------------------------------------------------------------------------------ HumanEval


@pytest.fixture(scope="module")
def humaneval():
    return humaneval_tasks("test")


def test_humaneval_has_164_tasks_and_splits_by_id(humaneval):
    assert len(humaneval) == 164 and len({t.task_id for t in humaneval}) == 164
    train, held_out = humaneval_tasks("train"), humaneval_tasks("held_out")
    assert len(train) + len(held_out) == 164 and 20 < len(held_out) < 50


def test_humaneval_sample_canonical_solutions_pass_and_stubs_fail(humaneval):
    for task in random.Random().sample(humaneval, 8):
        assert grade_solution(task, task.oracle_files).reward == 1.0, task.task_id
        assert grade_solution(task, {}).reward == 0.0, task.task_id


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "rlimit"])
def test_every_humaneval_canonical_solution_passes(humaneval, backend):
    failed = [
        t.task_id
        for t in humaneval
        if grade_solution(t, t.oracle_files, backend=backend, require_isolation=False).reward != 1.0
    ]
    assert failed == []


# The code under test runs in a child of the harness: it finds the nonce in its parent's memory,
# writes a verdict line with it where the sandbox's output goes (the sandbox's first process
# holds that descriptor), then overwrites the nonce in the parent's memory, so the harness's own
# line no longer counts. (Killing the harness would do where it is not the first process of its
# PID namespace, which ignores SIGKILL from inside.)
_NONCE_THIEF = r"""
import json, os, re


def _regions(pid):
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if "r" in fields[1] and high - low <= (256 << 20):
                yield low, high, "w" in fields[1]


def _forge():
    parent = os.getppid()
    mem = os.open(f"/proc/{parent}/mem", os.O_RDWR)
    nonce, places = None, []
    for low, high, writable in _regions(parent):
        try:
            data = os.pread(mem, high - low, low)
        except OSError:
            continue
        if nonce is None and (found := re.search(rb'"nonce": "([0-9a-f]{32})"', data)):
            nonce = found.group(1)
        if writable and nonce is not None:
            places += [low + m.start() for m in re.finditer(re.escape(nonce), data)]
    verdict = {"tests": {f"case_{i}": "pass" for i in range(64)}, "scores": {}}
    line = f"\n{nonce.decode()} {json.dumps(verdict)}\n"
    for target in ("/proc/1/fd/1", f"/proc/{parent}/fd/1"):
        try:
            with open(target, "w") as out:
                out.write(line)
        except OSError:
            pass
    for place in places:
        os.pwrite(mem, b"0" * len(nonce), place)


def f(x):
    _forge()
    return None
"""


def _harness_without(monkeypatch, call: str) -> None:
    """The grader's harness with one of its defences (a call in `main`) left out."""
    source = pathlib.Path(harness.__file__).read_text(encoding="utf-8")
    assert source.count(f"    {call}()\n") == 1
    weakened = source.replace(f"    {call}()\n", "    pass\n") + "\nmain()\n"
    monkeypatch.setattr(
        grading_task, "_HARNESS_COMMAND", "exec python3 -I -B -c " + shlex.quote(weakened)
    )


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            name, marks=pytest.mark.skipif(not isolation.usable(name), reason=f"{name} not usable")
        )
        for name in ("bwrap", "unshare")
    ],
)
def test_the_harness_memory_and_descriptors_are_closed_to_the_code_under_test(backend, monkeypatch):
    options = {"backend": backend, "require_isolation": True}
    assert grade_solution(TASK, {"solution.py": _NONCE_THIEF}, **options).reward == 0.0
    _harness_without(monkeypatch, "_no_dump")  # the control: the same attack wins without it
    assert grade_solution(TASK, {"solution.py": _NONCE_THIEF}, **options).reward == 1.0
