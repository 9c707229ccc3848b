"""The README's set-up is two command lines on a fresh clone (virtualenv, install and main job;
tests), and .ci/run installs exactly as the first says and runs the second."""

import configparser
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_commands() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_setup_is_two_lines_starting_with_the_virtualenv():
    install, tests = setup_commands()
    assert install.startswith("python3.12 -m venv .venv && source .venv/bin/activate && ")
    assert 'pip install -e ".[dev,golden]" -c constraints.txt' in install
    assert tests == 'python -m pytest -q -m "not slow or slow_sample"'


def test_ci_installs_as_the_readme_says_and_runs_its_test_command():
    install, tests = setup_commands()
    install_only = install.split(" && python -m launch.rl")[0]  # CI does not run the main job
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    assert install_only in ci
    assert tests in ci
    assert ci.index(install_only) < ci.index(tests)


def test_the_constraints_pin_every_requirement():
    """constraints.txt (the versions CI tested) pins every requirement and dev tool."""
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO, "setup.cfg"))
    extras = parser["options.extras_require"]
    wanted = parser["options"]["install_requires"] + extras["dev"] + extras["golden"]
    names = {
        re.sub(r"[-_.]+", "-", m).lower()
        for m in re.findall(r"^\s*([A-Za-z0-9_.-]+)", wanted, re.M)
    }
    with open(os.path.join(REPO, "constraints.txt")) as f:
        pinned = {
            re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
            for line in f
            if "==" in line and not line.startswith("#")
        }
    assert names <= pinned, sorted(names - pinned)
