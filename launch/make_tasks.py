"""Build verified repository tasks from a package and its own tests.

    python -m launch.make_tasks --package=toolz==1.2.0 --out=toolz.jsonl.gz
    python -m launch.make_tasks --path=./my_package_checkout --out=mine.jsonl
    python -m launch.make_tasks --from_set=old.jsonl.gz --out=new.jsonl.gz  # add replay

The package's source distribution comes from the registry pip is configured for (or a local
folder); the tasks are written as a repository task set (`composer_jax.envs.tasks.repo_task_sets`),
which `--config.rl.tasks=repositories:PATH` and `launch.evaluate` read back.
"""

import hashlib
import sys
from pathlib import Path

from absl import flags
from tqdm import tqdm

from composer_jax.envs.tasks import repo_factory
from composer_jax.envs.tasks.repo_task_sets import (
    TaskSetError,
    read_repository,
    read_task_set,
    write_task_set,
)
from launch import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("package", None, "a requirement for pip, e.g. toolz==1.2.0")
flags.DEFINE_string("path", None, "a local source folder instead of --package")
flags.DEFINE_string(
    "from_set", None, "a task set made without replay: record it for its tasks (same ids, splits)"
)
flags.DEFINE_string("out", None, "the task-set file to write (.jsonl or .jsonl.gz)")
flags.DEFINE_integer("max_tasks", 100, "at most this many tasks")
flags.DEFINE_integer("seed", 0, "which candidates are tried first, and the graded tests' sample")
flags.DEFINE_float("held_out", 0.2, "share of functions held out (by function id)")
flags.DEFINE_bool("all_held_out", False, "hold out the whole package (a held-out repository)")
flags.DEFINE_string("cache", str(Path.home() / ".cache" / "composer_jax" / "sdists"), "downloads")
flags.DEFINE_string("backend", "auto", "sandbox backend for the verification gradings")


def _held_out(task_id: str) -> bool:
    if FLAGS.all_held_out:
        return True
    digest = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < FLAGS.held_out


def _repository() -> repo_factory.Repository:
    if FLAGS.path:
        tree = Path(FLAGS.path).resolve()
        if not tree.is_dir():
            cli.fail(f"--path={FLAGS.path}: no such folder")
        return repo_factory.find_layout(tree, tree.name, "local", f"path:{tree}")
    tree = repo_factory.fetch_source(FLAGS.package, Path(FLAGS.cache))
    name, _, version = tree.name.rpartition("-")
    return repo_factory.find_layout(tree, name.replace("-", "_"), version, FLAGS.package)


def _progress_bar(description: str):
    bar = tqdm(desc=description, unit="candidate")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return bar, progress


def _build():
    """(repository, tasks, report) from --package / --path, or from --from_set."""
    if sum(map(bool, (FLAGS.package, FLAGS.path, FLAGS.from_set))) != 1:
        cli.fail("give exactly one of --package, --path and --from_set")
    if FLAGS.from_set:
        repo = read_repository(FLAGS.from_set)
        bar, progress = _progress_bar(f"recording replay for {repo.name}")
        tasks, report = repo_factory.add_replay(
            read_task_set(FLAGS.from_set), backend=FLAGS.backend, progress=progress
        )
    else:
        repo = _repository()
        bar, progress = _progress_bar(f"verifying {repo.name}")
        repo, tasks, report = repo_factory.build_tasks(
            repo,
            max_tasks=FLAGS.max_tasks,
            seed=FLAGS.seed,
            held_out=_held_out,
            backend=FLAGS.backend,
            progress=progress,
        )
    bar.close()
    return repo, tasks, report


def main(argv):
    del argv
    if not FLAGS.out:
        cli.fail("--out is required")
    try:
        repo, tasks, report = _build()
    except (repo_factory.FactoryError, TaskSetError) as error:
        sys.exit(f"make_tasks: {error}")
    write_task_set(FLAGS.out, repo, tasks)
    held = sum(t.split == "held_out" for t in tasks)
    print(f"{repo.name} {repo.version}: {report.summary()}")
    print(f"wrote {len(tasks)} tasks ({held} held out) to {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
