"""The test loop's own configuration: a test that hangs fails with the stacks of every thread,
and every run shows its slowest tests. Checked by running pytest with the project's ini file on
a throwaway test in a subprocess."""

import configparser
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INI = os.path.join(REPO, "setup.cfg")

HANGING_TEST = """
import threading
import time


def helper_thread_waiting_forever(event):
    event.wait()


def test_that_hangs():
    threading.Thread(target=helper_thread_waiting_forever, args=(threading.Event(),),
                     daemon=True).start()
    time.sleep(60)


def test_after_the_hang():
    pass
"""


def run_pytest_with_project_ini(tmp_path, *args):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(HANGING_TEST))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            INI,
            "--rootdir",
            str(tmp_path),
            *args,
            str(tmp_path / "test_hang.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_hanging_test_fails_with_every_threads_stack_and_the_run_goes_on(tmp_path):
    # The project's method and reporting, with the limit lowered so the check takes seconds.
    result = run_pytest_with_project_ini(tmp_path, "-o", "timeout=2")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "Timeout" in out and "test_that_hangs" in out, out[-3000:]
    assert "helper_thread_waiting_forever" in out, out[-3000:]  # the other thread's stack too
    assert "1 failed, 1 passed" in out, out[-3000:]  # the hang costs one test, not the run
    assert "slowest" in out, out[-3000:]  # the durations table


def test_the_default_limit_fits_the_tier_and_is_set_in_the_ini():
    ini = configparser.ConfigParser()
    ini.read(INI)
    options = ini["tool:pytest"]
    assert 60 <= float(options["timeout"]) <= 600
    assert options["timeout_method"] == "signal"  # fails the one test; "thread" ends the run
    assert "--durations=" in options["addopts"]


CRASHING_TESTS = """
import os
import signal


def _attempt(name):
    # Each attempt leaves a line, so the test run can count them.
    with open(os.path.join(os.path.dirname(__file__), name + ".attempts"), "a+") as f:
        f.seek(0)
        earlier = len(f.readlines())
        f.write("attempt\\n")
    return earlier


def test_crashes_its_first_worker():
    if _attempt("once") == 0:
        os.kill(os.getpid(), signal.SIGSEGV)


def test_crashes_every_worker():
    _attempt("always")
    os.kill(os.getpid(), signal.SIGSEGV)


def test_fails():
    _attempt("fails")
    assert False
"""


def test_a_test_whose_worker_crashes_runs_once_more_and_a_failure_does_not(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASHING_TESTS)
    command = [sys.executable, "-m", "pytest", "-c", INI, "--rootdir", str(tmp_path), "-n", "1"]
    result = subprocess.run(
        [*command, str(tmp_path / "test_crash.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    attempts = {
        name: len((tmp_path / f"{name}.attempts").read_text().splitlines())
        for name in ("once", "always", "fails")
    }
    assert attempts == {"once": 2, "always": 2, "fails": 1}, out[-3000:]
    assert "2 failed, 1 passed" in out and "2 rerun" in out, out[-3000:]


TIERED_TESTS = """
import pytest


def test_default():
    pass


@pytest.mark.skip(reason="the golden extra is not installed")
def test_skipped():
    pass


@pytest.mark.slow
@pytest.mark.slow_sample
def test_in_the_slow_sample():
    pass


@pytest.mark.slow
def test_slow_only():
    pass
"""


def test_the_run_ends_with_counts_per_tier_and_each_skips_reason(tmp_path):
    (tmp_path / "test_tiers.py").write_text(TIERED_TESTS)
    # a module skipped whole at collection, as the golden tests are without transformers
    (tmp_path / "test_golden.py").write_text(
        'import pytest\n\npytest.importorskip("composer_jax_no_such_package")\n'
    )
    with open(os.path.join(REPO, "tests", "conftest.py")) as f:
        (tmp_path / "conftest.py").write_text(f.read())
    command = [sys.executable, "-m", "pytest", "-c", INI, "--rootdir", str(tmp_path), "-n", "0"]
    result = subprocess.run(
        [*command, "-m", "not slow or slow_sample", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert "tier default: 1 passed, 0 failed, 0 error, 2 skipped\n" in out, out[-3000:]
    assert "could not import 'composer_jax_no_such_package'" in out, out[-3000:]
    assert "tier slow: 1 passed, 0 failed, 0 error, 0 skipped (the slow sample;" in out, out
    assert "the golden extra is not installed" in out, out[-3000:]
