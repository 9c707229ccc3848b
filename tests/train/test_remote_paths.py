"""Runs in a bucket, offline: pretraining and its resume on a `gs://` workdir, and an RL run
stopped by a signal and resumed there (ledger, in-flight records, weight store, checkpoints).

Why this scheme: `gs://` is the one bucket scheme both epath (metrics, config, launches, the
checkpoint folders) and orbax (checkpoint tensors) serve, so it is the one whose real code paths a
run crosses: URIs kept as URIs, epath's fsspec backend, orbax's gs:// handling (no atomic
rename; `commit_success.txt` markers; deletions past `keep_checkpoints`). Only the storage under
the three Google clients is swapped for a local folder: fsspec's `gs` protocol (gcsfs) becomes a
DirFileSystem over the folder, tensorstore's `gcs` kvstore (orbax's spec, and a `gs://` URL that
the weight store opens) a `file` one over the same folder, and orbax's bucket-layout query
(google-cloud-storage) answers "flat namespace".
`memory://` is no alternative: epath does not route it to fsspec, and orbax would write its
tensors under a local folder named `memory:`. A mock of epath would skip the code under test.
"""

import dataclasses
import importlib
import json
import os
import signal

import jax
import numpy as np
import pytest
import tensorstore as ts
from etils.epath import backend as epath_backend
from flax import nnx
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from composer_jax import config, interop, model, presets
from composer_jax.actor import run as run_lib
from composer_jax.actor.inflight import GroupState, InFlightStore
from composer_jax.actor.ledger import Group, GroupLedger
from composer_jax.actor.run import run_rl
from composer_jax.config import ConfigError
from composer_jax.data.tokenizer import load_tokenizer
from composer_jax.interop import hf, streaming
from composer_jax.train import load_run, read_metrics, run_pretraining
from composer_jax.train import workdir as workdir_lib
from composer_jax.train.runs import run_tokenizer, save_run_tokenizer
from composer_jax.train.workdir import check_run_folder, prepare_workdir
from tests.actor.test_ledger import make_group
from tests.actor.test_run_rl import GROUPS_PER_STEP, STEPS, _check_finished_run
from tests.train.helpers import ONE_PHASE, make_corpus, tiny_experiment


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A local folder served as `gs://`; the test runs in an empty cwd to catch a `gs:` folder."""
    root = tmp_path / "storage"
    root.mkdir()

    class LocalBucket(DirFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, finalize_on_close=False, **kwargs):
            super().__init__(path=str(root), fs=LocalFileSystem(auto_mkdir=True), **kwargs)

        @classmethod
        def _strip_protocol(cls, path):
            return str(path).removeprefix("gs://").removeprefix("gcs://").rstrip("/")

    registry = importlib.import_module("fsspec.registry")._registry  # undone after the test
    for name in ("gs", "gcs"):
        monkeypatch.setitem(registry, name, LocalBucket)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    gcs_spec = gcs_utils.get_kvstore_for_gcs

    def local_kvstore(path):
        spec = gcs_spec(path)
        return {"driver": "file", "path": str(root / spec["bucket"] / spec["path"])}

    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", local_kvstore)
    open_kvstore = ts.KvStore.open

    def open_local_kvstore(spec, *args, **kwargs):
        if isinstance(spec, str) and spec.startswith("gs://"):
            spec = {"driver": "file", "path": f"{root}/{spec.removeprefix('gs://')}"}  # as is
        return open_kvstore(spec, *args, **kwargs)

    monkeypatch.setattr(ts.KvStore, "open", staticmethod(open_local_kvstore))
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    # google-cloud-storage's one use (that layout query) is answered, so run_path needs it not.
    monkeypatch.setitem(workdir_lib._SCHEMES, "gs", gcs_utils.__name__)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield root
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    assert os.listdir(cwd) == []  # nothing of gs:// became a local folder


def _computed(path):
    """The metrics without wall-clock times."""
    return [{k: v for k, v in m.items() if "seconds" not in k} for m in read_metrics(path)]


def test_pretraining_resumes_in_a_bucket(bucket, tmp_path):
    """A 6-step run whose latest checkpoint is then damaged resumes from step 3 and redoes steps
    4-6 bit for bit: restore (the data loader's position too: one phase, so step 3 is
    mid-phase), set-aside, metrics truncation and launches all on gs://."""
    corpus = make_corpus(str(tmp_path / "corpus"))
    cfg = tiny_experiment("gs://runs/tiny", corpus, steps=6, phases=ONE_PHASE)
    assert run_pretraining(cfg, progress=False).final_step == 6
    first = _computed("gs://runs/tiny/metrics.jsonl")
    run = bucket / "runs" / "tiny"
    assert {"3", "6"} <= set(os.listdir(run / "checkpoints"))
    assert (run / "checkpoints" / "6" / "commit_success.txt").exists()  # orbax's gs:// commit
    for path in (run / "checkpoints" / "6").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00" * 7)

    assert run_pretraining(cfg, progress=False).final_step == 6
    assert (run / "checkpoints" / "6.damaged").is_dir()
    launches = [json.loads(line) for line in (run / "launches.jsonl").read_text().splitlines()]
    assert [launch["resumed_step"] for launch in launches] == [None, 3]
    assert json.loads((run / "config.json").read_text())["workdir"] == "gs://runs/tiny"
    assert _computed("gs://runs/tiny/metrics.jsonl") == first
    loaded = load_run("gs://runs/tiny")  # also how an RL run loads a bucket rl.warm_start
    assert loaded.step == 6 and loaded.config == cfg and len(loaded.metrics) == len(first)
    assert check_run_folder("gs://runs/tiny", "rl.warm_start") == "gs://runs/tiny"


def test_a_bucket_run_keeps_its_tokenizer(bucket):
    tokenizer = load_tokenizer("code_bpe_2k")
    save_run_tokenizer(tokenizer, "gs://runs/bpe")
    assert (bucket / "runs" / "bpe" / "tokenizer" / "tokenizer.json").is_file()
    assert run_tokenizer("gs://runs/bpe").fingerprint() == tokenizer.fingerprint()
    save_run_tokenizer(tokenizer, "gs://runs/bpe")  # the same one again: left as it is


def test_ledger_and_in_flight_records_in_a_bucket(bucket):
    """Objects written whole (no temporary ones), damaged records set aside in the bucket, the
    newest two in-flight records kept; reopening gives the same view."""
    ledger = GroupLedger("gs://runs/rl/ledger")
    for i in range(3):
        ledger.add(make_group(Group, i))
    ledger.mark_trained(["g00000"], step=1)
    ledger.mark_trained(["g00001"], step=2)
    assert ledger.rewind(1) == ["g00001"]
    groups = bucket / "runs" / "rl" / "ledger" / "groups"
    (groups / "g00002.npz").write_bytes(b"torn")
    reopened = GroupLedger("gs://runs/rl/ledger")
    assert reopened.directory == "gs://runs/rl/ledger"
    assert reopened.pending() == ["g00001"] and reopened.trained_step("g00000") == 1
    assert reopened.corrupt == ["g00002"] and (groups / "g00002.npz.corrupt").is_file()
    assert reopened.load("g00001").metadata == make_group(Group, 1).metadata
    assert not [p for p in (bucket / "runs").rglob("*") if p.name.startswith(".tmp-")]

    store = InFlightStore("gs://runs/rl/inflight")
    for step in (2, 4, 6):
        store.save(step, [GroupState(f"p{step:05d}-g", step, [])])
    assert sorted(os.listdir(bucket / "runs" / "rl" / "inflight")) == [
        "step-000000004.pkl",
        "step-000000006.pkl",
    ]
    assert store.load(6) == [GroupState("p00006-g", 6, [])] and store.load(2) == []


def _small_rl(workdir: str, **fields) -> config.ExperimentConfig:
    """`rl_tiny` at the size of tests/actor/test_run_rl.py's runs."""
    cfg = presets.PRESETS["rl_tiny"]()
    rl = dataclasses.replace(
        cfg.rl,
        heldout=dataclasses.replace(cfg.rl.heldout, num_tasks=2, samples=1),
        rollout=dataclasses.replace(
            cfg.rl.rollout,
            group_size=2,
            groups_per_step=GROUPS_PER_STEP,
            num_slots=4,
            context_len=512,
            max_new_tokens=24,
            max_staleness=8,  # nothing dropped: every prompt must be trained once
            skip_uniform_groups=False,
            num_prompts=0,
            env_workers="thread",
        ),
        agent=dataclasses.replace(
            cfg.rl.agent,
            max_turns=2,  # samples wait between turns: in-flight records matter
        ),
        warm_start_steps=4,
    )
    train = dataclasses.replace(cfg.train, checkpoint_every=2)
    return dataclasses.replace(cfg, workdir=workdir, steps=STEPS, train=train, rl=rl, **fields)


# Slow tier: the heaviest bucket run (test_pretraining_resumes_in_a_bucket keeps resuming from
# a bucket in the default run).
@pytest.mark.slow
def test_an_rl_run_in_a_bucket_stops_on_sigterm_and_resumes_exactly_once(bucket, monkeypatch):
    """SIGTERM after step 3 (its checkpoint and groups in flight saved at once), then a start
    with resume=must trains on to the end: every group trained exactly once, and every file of
    the run (ledger, in-flight records, weight stores, checkpoints, held-out results, curves)
    in the bucket."""

    class StopAfterStep3(run_lib.MetricsWriter):
        def write(self, step, record):
            super().write(step, record)
            if step == 3 and "reward_mean" in record:
                signal.raise_signal(signal.SIGTERM)  # the loop's handler: stop at this step

    with monkeypatch.context() as patch:
        patch.setattr(run_lib, "MetricsWriter", StopAfterStep3)
        stopped = run_rl(_small_rl("gs://runs/rl"), progress=False)
    assert (stopped.final_step, stopped.interrupted) == (3, "SIGTERM")
    run = bucket / "runs" / "rl"
    assert sorted(os.listdir(run / "inflight")) == ["step-000000002.pkl", "step-000000003.pkl"]

    finished = run_rl(_small_rl("gs://runs/rl", resume="must"), progress=False)
    assert (finished.final_step, finished.interrupted) == (STEPS, None)
    _check_finished_run(str(run))
    launches = [json.loads(line) for line in (run / "launches.jsonl").read_text().splitlines()]
    assert [launch["resumed_step"] for launch in launches] == [None, 3]
    assert len(json.loads((run / "heldout.json").read_text())) == 2  # before RL, after it
    attempts = sorted(os.listdir(run / "weights"))
    assert len(attempts) == 2  # one store per start, each read by that start's sampler
    for attempt in attempts:
        assert os.listdir(run / "weights" / attempt / "manifests")
    assert (run / "warm_start" / "config.json").is_file()
    assert (run / "checkpoints" / str(STEPS) / "commit_success.txt").exists()


def test_an_rl_run_on_s3_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = dataclasses.replace(presets.PRESETS["rl_tiny"](), workdir="s3://runs/rl")
    with pytest.raises(ConfigError, match=r"^workdir: 's3://runs/rl' has the scheme s3://"):
        run_rl(cfg, progress=False)
    assert os.listdir(tmp_path) == []


def test_an_unserved_scheme_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^workdir: 'memory://x' has the scheme memory://;"):
        prepare_workdir("memory://x")
    with pytest.raises(ConfigError, match=r"^workdir: .*s3://") as error:
        prepare_workdir("s3://bucket/run")  # epath could, orbax cannot write s3:// checkpoints
    assert "\n" not in str(error.value)
    try:
        import gcsfs  # noqa: F401
        import google.cloud.storage  # noqa: F401
    except ImportError:  # gs:// without its clients: named, and no local folder made
        with pytest.raises(ConfigError, match=r"^workdir: gs://b/run needs the gcs extra") as error:
            prepare_workdir("gs://b/run")
        assert "\n" not in str(error.value)
    assert os.listdir(tmp_path) == []


def test_an_export_to_a_bucket_writes_the_same_files_there_and_nothing_here(bucket, tmp_path):
    tokenizer = load_tokenizer("code_bpe_2k")
    m = model.init_model(dataclasses.replace(presets.tiny().model, vocab_size=2048), seed=3)
    interop.export_hf_checkpoint(m, "gs://exports/tiny", tokenizer)
    local = tmp_path / "local"
    interop.export_hf_checkpoint(m, local, tokenizer)
    remote = bucket / "exports" / "tiny"
    names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert names and names == sorted(
        str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()
    )
    for name in names:
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name


def test_a_checkpoint_in_a_bucket_streams_like_a_local_one(bucket, tmp_path):
    """A sharded fp8 export in the bucket loads through the streaming reader's remote path
    (strips fetched, no memory map) to the model the local folder gives, reading each byte once."""
    m = model.init_model(dataclasses.replace(presets.tiny().model, dtype="float32"), seed=4)
    interop.export_hf_checkpoint(m, "gs://exports/fp8", dtype="fp8", shard_bytes=64 << 10)
    local = bucket / "exports" / "fp8"
    assert len(list(local.glob("*.safetensors"))) > 2
    with streaming.CheckpointReader("gs://exports/fp8") as reader:
        remote = hf.load_from_reader(reader)
        assert reader.bytes_read == reader.total_bytes
    want = nnx.to_pure_dict(nnx.state(interop.load_hf_checkpoint(local)))
    jax.tree.map(np.testing.assert_array_equal, want, nnx.to_pure_dict(nnx.state(remote)))
