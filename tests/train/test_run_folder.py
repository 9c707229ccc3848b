"""`RunFolder`: a start checks before it creates, commits the config, the launch record and the
tokenizer only when asked, resumes only the same config (naming a changed field), keeps the train
state's checkpoints, and reads a finished run back with its tokenizer."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import ConfigError
from composer_jax.train import RunFolder
from composer_jax.train.runs import TOKENIZER_DIR
from composer_jax.train.workdir import LAUNCHES
from tests.data.helpers import make_hf_folder
from tests.train.helpers import tiny_experiment

VOCAB = 416  # the test BPE has 400 ids; the model pads its embedding to 416 rows


@pytest.fixture
def cfg(tmp_path):
    """A config with a BPE tokenizer (so the folder keeps its files) in a workdir not made yet."""
    make_hf_folder(tmp_path / "tok")
    cfg = tiny_experiment(str(tmp_path / "run"), str(tmp_path / "corpus"), steps=2)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=VOCAB),
        data=dataclasses.replace(cfg.data, tokenizer=str(tmp_path / "tok")),
    )


def _launches(workdir) -> list[dict]:
    with open(os.path.join(workdir, LAUNCHES)) as f:
        return [json.loads(line) for line in f]


def test_a_start_creates_the_folder_and_writes_only_on_commit(cfg):
    folder = RunFolder.start(cfg)
    assert folder.path == cfg.workdir and os.listdir(folder.path) == []
    assert folder.tokenizer.vocab_size == 400
    launch = folder.commit(None, "pretrain")
    assert sorted(os.listdir(folder.path)) == ["config.json", LAUNCHES, TOKENIZER_DIR]
    assert launch["kind"] == "pretrain" and launch["resumed_step"] is None
    assert _launches(folder.path) == [launch]
    stored = json.load(open(os.path.join(folder.path, "config.json")))
    assert stored["data"]["tokenizer"] == cfg.data.tokenizer


def test_the_same_config_resumes_and_a_changed_one_is_refused_by_field(cfg):
    RunFolder.start(cfg).commit(None, "pretrain")
    RunFolder.start(cfg).commit(2, "pretrain")
    assert [r["resumed_step"] for r in _launches(cfg.workdir)] == [None, 2]
    changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, learning_rate=0.5))
    with pytest.raises(ConfigError, match=r"Differing fields:\n  optim.learning_rate"):
        RunFolder.start(changed)
    with pytest.raises(ConfigError, match="already holds a run"):
        RunFolder.start(dataclasses.replace(cfg, resume="never"))
    assert len(_launches(cfg.workdir)) == 2  # a refused start wrote nothing


def test_a_resume_whose_tokenizer_files_changed_is_refused(cfg, tmp_path):
    """The same `data.tokenizer` path, other files: the config reads the same, the token ids
    do not; the run's saved copy is kept as it was."""
    RunFolder.start(cfg).commit(None, "pretrain")
    saved = RunFolder.open(cfg.workdir).tokenizer.fingerprint()
    for name in os.listdir(tmp_path / "tok"):
        os.remove(tmp_path / "tok" / name)
    make_hf_folder(tmp_path / "tok", vocab_size=300)
    with pytest.raises(ConfigError, match="data.tokenizer: .* is not the tokenizer .* trained"):
        RunFolder.start(cfg)
    assert RunFolder.open(cfg.workdir).tokenizer.fingerprint() == saved
    assert len(_launches(cfg.workdir)) == 1


def test_a_refused_start_creates_nothing(cfg):
    with pytest.raises(ConfigError, match="holds no run"):
        RunFolder.start(dataclasses.replace(cfg, resume="must"))
    narrow = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=259))
    with pytest.raises(ConfigError, match="data.tokenizer: .*model.vocab_size"):
        RunFolder.start(narrow)
    assert not os.path.exists(cfg.workdir)


def test_checkpoints_commit_and_restore(cfg):
    folder = RunFolder.start(cfg)
    assert folder.restore_latest({"w": jnp.zeros((2, 3))}) is None
    folder.commit(None, "pretrain")
    state = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((4,), jnp.int32)}
    folder.save(1, state, {"phase": 0})
    folder.save(2, jax.tree.map(lambda x: x + 1, state), {"phase": 1})
    assert folder.latest_step() == 2
    folder.close()
    assert folder.checkpoint_dir == os.path.join(cfg.workdir, "checkpoints")
    again = RunFolder.start(dataclasses.replace(cfg, resume="must"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    step, restored, metadata = again.restore_latest(abstract)
    assert step == 2 and metadata == {"phase": 1}
    np.testing.assert_array_equal(restored["w"], state["w"] + 1)
    earlier, metadata = again.restore(1, abstract)
    np.testing.assert_array_equal(earlier["b"], state["b"])
    again.close()


def test_a_finished_run_opens_with_its_config_and_tokenizer(cfg, tmp_path):
    started = RunFolder.start(cfg)
    started.commit(None, "pretrain")
    opened = RunFolder.open(cfg.workdir)
    assert opened.cfg == cfg and opened.metrics() == []
    assert opened.tokenizer.fingerprint() == started.tokenizer.fingerprint()
    with pytest.raises(ConfigError, match="rl.warm_start: .* is not a run folder"):
        RunFolder.open(str(tmp_path / "tok"), "rl.warm_start")
