"""The rooms of `composer_jax/envs/` import one way, and keep their private modules to themselves.

Read from the source with `ast` (nothing is imported, function-level imports included):
- a module of a room imports only its own room and the rooms below it: tasks -> grading ->
  sandbox, tools -> sandbox (tools and grading/tasks never import each other), and never the envs
  top level (`composer_jax.envs` itself, `environment`, `worker`), which composes the rooms;
- a room's private modules (a `_`-prefixed name, e.g. `sandbox/_mount_root.py`) are imported only
  from inside that room.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ENVS = "composer_jax.envs"
# Each room and the other rooms it may import.
ALLOWED = {
    "sandbox": frozenset(),
    "tools": frozenset({"sandbox"}),
    "grading": frozenset({"sandbox"}),
    "tasks": frozenset({"grading", "sandbox"}),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    """{dotted name: file} of every module and package under composer_jax/."""
    return {module_name(p): p for p in sorted((REPO / "composer_jax").rglob("*.py"))}


def room_of(name: str) -> str | None:
    """The room a module belongs to: a room's name, "top" for the envs top level, None outside
    envs/."""
    if name != ENVS and not name.startswith(ENVS + "."):
        return None
    rest = name[len(ENVS) + 1 :].split(".")
    return rest[0] if rest[0] in ALLOWED else "top"


def imported(tree: ast.AST, name: str, is_package: bool, known) -> list[tuple[int, str]]:
    """(line, imported module) of every import in `tree`; `from p import x` counts as importing
    `p.x` where that is a module, else `p`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = ".".join(p for p in (package, node.module) if p)
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else base))
    return found


def violations(path: str, name: str, is_package: bool, source: str, known) -> list[str]:
    """What the module `name` (file `path`, text `source`) breaks of the rules above."""
    room = room_of(name)
    problems = []
    for line, target in imported(ast.parse(source), name, is_package, known):
        target_room = room_of(target)
        where = f"{path}:{line}: imports {target}"
        if room in ALLOWED and target_room is not None and target_room != room:
            if target_room == "top":
                problems.append(f"{where} (the envs top level; room {room} lies below it)")
            elif target_room not in ALLOWED[room]:
                allowed = ", ".join(sorted(ALLOWED[room])) or "no other room"
                problems.append(f"{where} (room {room} may import {allowed})")
        if target_room in ALLOWED and room != target_room:
            inside = target[len(ENVS) + len(target_room) + 2 :].split(".")
            if any(part.startswith("_") for part in inside):
                problems.append(f"{where} (private to room {target_room})")
    return problems


def test_rooms_import_downward_and_keep_private_modules_private():
    modules = all_modules()
    assert {room_of(n) for n in modules} >= {*ALLOWED, "top", None}
    problems = []
    for name, path in modules.items():
        relative = str(path.relative_to(REPO))
        source = path.read_text(encoding="utf-8")
        problems += violations(relative, name, path.name == "__init__.py", source, modules)
    assert not problems, "layering of composer_jax/envs broken:\n" + "\n".join(problems)


def test_the_check_finds_bad_imports():
    """The check itself fails on each kind of bad import (so its silence above means something)."""
    known = set(all_modules())

    def check(name, source, is_package=False):
        return violations(name.replace(".", "/") + ".py", name, is_package, source, known)

    box = "composer_jax.envs.sandbox.box"
    assert check(box, "from composer_jax.envs.tasks import sources\n")  # upward
    assert check(box, "def f():\n    from composer_jax.envs.grading import task\n")  # in a function
    assert check(box, "from ..tools import toolbox\n")  # relative, sideways-up
    assert check(box, "from composer_jax.envs import Task\n")  # the top level's re-export
    assert check(box, "import composer_jax.envs.environment\n")
    assert check("composer_jax.envs.grading.task", "from composer_jax.envs.tools import TOOLS\n")
    assert check("composer_jax.envs.tools.toolbox", "from composer_jax.envs.grading import task\n")
    assert check("composer_jax.envs.tasks.sources", "import composer_jax.envs.tools.todo\n")
    assert check("composer_jax.agent.oracle", "from composer_jax.envs.sandbox import _mount_root\n")
    assert check("composer_jax.envs.environment", "from .grading._code_monitor import constructs\n")
    assert check("composer_jax.envs.tasks.focus", "import composer_jax.envs.grading._repo_runner\n")
    # What the rules allow.
    assert not check(
        "composer_jax.envs.tasks.sources", "from composer_jax.envs.sandbox import box\n"
    )
    assert not check("composer_jax.envs.grading.monitors", "from . import _code_monitor\n")
    assert not check("composer_jax.envs.environment", "from composer_jax.envs.tools import TOOLS\n")
    assert not check("composer_jax.actor.setup", "from composer_jax.envs import task_source\n")


def test_each_room_says_what_it_holds_and_may_import():
    for room in ALLOWED:
        init = REPO / "composer_jax" / "envs" / room / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert docstring and "import" in docstring.lower(), f"{init} needs a docstring saying so"
