"""One tokenizer per run: chosen by data.tokenizer / init_from / the RL warm start, saved with the
run, found by load_run and written by the export; pretraining from an HF folder on JSONL."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import interop
from composer_jax.config import ConfigError
from composer_jax.data import ByteTokenizer, HFTokenizer, load_tokenizer
from composer_jax.model import init_model
from composer_jax.train import load_run, loop, run_pretraining
from composer_jax.train.runs import (
    TOKENIZER_DIR,
    check_run_tokenizer,
    resolve_tokenizer,
    run_tokenizer,
    save_run_tokenizer,
)
from tests.data.helpers import make_hf_folder
from tests.train.helpers import tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 416  # the test BPE has 400 ids; the model pads its embedding to 416 rows


def _cfg(tmp_path, **data):
    cfg = tiny_experiment(str(tmp_path / "run"), str(tmp_path), steps=2)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def test_tokenizer_resolution_rules(tmp_path):
    make_hf_folder(tmp_path / "tok")
    bpe = str(tmp_path / "tok")
    cfg = _cfg(tmp_path)
    assert cfg.data.tokenizer == "auto" and isinstance(resolve_tokenizer(cfg), ByteTokenizer)
    wide = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    assert isinstance(resolve_tokenizer(dataclasses.replace(wide, init_from=bpe)), HFTokenizer)
    with pytest.raises(ConfigError, match="data.tokenizer: .*model.vocab_size: 259 is smaller"):
        resolve_tokenizer(
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=bpe))
        )
    explicit_byte = dataclasses.replace(
        wide, init_from=bpe, data=cfg.data.__class__(tokenizer="byte")
    )
    with pytest.raises(ConfigError, match="is not the tokenizer init_from was trained with"):
        resolve_tokenizer(explicit_byte)
    # A warm-start run's saved tokenizer is inherited; an old run without one means its config's.
    warm = tmp_path / "warm"
    load_tokenizer(bpe).save(str(warm / TOKENIZER_DIR))
    (warm / "config.json").write_text(json.dumps({"data": {"tokenizer": "auto"}}))
    rl = dataclasses.replace(wide, rl=dataclasses.replace(wide.rl, warm_start=str(warm)))
    assert resolve_tokenizer(rl).fingerprint() == load_tokenizer(bpe).fingerprint()
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"data": {"tokenizer": "byte"}}))
    assert isinstance(run_tokenizer(str(old)), ByteTokenizer)
    # Checked where it is loaded (configs know no tokenizer), before any work of a run.
    nowhere = _cfg(tmp_path, tokenizer=str(tmp_path / "nowhere"))
    config_lib.validate(nowhere)
    with pytest.raises(ConfigError, match="data.tokenizer: unknown tokenizer"):
        resolve_tokenizer(nowhere)
    shipped = _cfg(tmp_path, tokenizer="code_bpe_2k")
    shipped = dataclasses.replace(
        shipped, model=dataclasses.replace(shipped.model, vocab_size=2048)
    )
    assert isinstance(resolve_tokenizer(shipped), HFTokenizer)


def _write_documents(path, count=60):
    # Seeded: with random lengths a first batch could by chance hold no document's first piece.
    rng = np.random.default_rng(0)
    words = ["def", "return", "x", "(", ")", ":", "\n    ", "é", "中文", "42", " ", "class"]
    with open(path, "w") as f:
        for i in range(count):
            text = f"doc {i} " + "".join(rng.choice(words, size=int(rng.integers(5, 80))))
            f.write(json.dumps({"body": text}) + "\n")


def _pretrained_folder(tmp_path, cfg):
    """An HF-format checkpoint with a BPE tokenizer, as `launch.export` writes it."""
    make_hf_folder(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    pretrained = init_model(dataclasses.replace(cfg.model, num_mtp_layers=0), seed=3)
    interop.export_hf_checkpoint(pretrained, tmp_path / "hf", tokenizer)
    return str(tmp_path / "hf"), tokenizer


def test_pretrain_from_hf_folder_on_jsonl_with_its_tokenizer(tmp_path):
    _write_documents(tmp_path / "docs.jsonl")
    cfg = tiny_experiment(str(tmp_path / "run"), str(tmp_path / "docs.jsonl"), steps=2)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=VOCAB),
        data=dataclasses.replace(cfg.data, text_field="body"),
        train=dataclasses.replace(
            cfg.train,
            phases=cfg.train.phases[:1]
            and (dataclasses.replace(cfg.train.phases[0], fraction=1.0),),
        ),
    )
    hf_dir, tokenizer = _pretrained_folder(tmp_path, cfg)
    cfg = dataclasses.replace(cfg, init_from=hf_dir)
    assert sorted(os.listdir(hf_dir)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # The documents reach the model as the checkpoint tokenizer's ids.
    corpora = loop._Corpora(loop.open_corpus(cfg), resolve_tokenizer(cfg))
    batch = next(loop._make_iterator(cfg, corpora, 0))
    segments = [
        row[ids == k]
        for row, ids in zip(batch["tokens"], batch["segment_ids"])
        for k in range(1, ids.max() + 1)
    ]
    firsts = [s for s in segments if s[0] == tokenizer.bos_id]  # the first piece of a document
    assert firsts and all(tokenizer.decode(s).startswith("doc ") for s in firsts)
    result = run_pretraining(
        cfg, progress=False, pretrained=functools.partial(interop.load_pretrained, cfg)
    )
    assert result.final_step == 2 and np.isfinite(result.eval_nll_end)
    run = load_run(cfg.workdir)
    assert run.step == 2 and run.config == cfg and any("loss" in m for m in run.metrics)
    assert run.tokenizer.fingerprint() == tokenizer.fingerprint()
    assert os.path.isfile(os.path.join(cfg.workdir, TOKENIZER_DIR, "tokenizer.json"))
    # Export, then import: the same weights (MTP heads are not part of the format) and tokenizer.
    interop.export_hf_checkpoint(run.model, tmp_path / "out", run.tokenizer)
    back = interop.load_hf_checkpoint(tmp_path / "out", dtype=run.model.cfg.dtype)
    ours, theirs = nnx.to_pure_dict(nnx.state(run.model)), nnx.to_pure_dict(nnx.state(back))
    ours.pop("mtp")
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    exported = load_tokenizer(str(tmp_path / "out"))
    assert exported.encode("héllo 中文") == tokenizer.encode("héllo 中文")
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    # Generation stops where ours does: eos, and the chat template's end of turn.
    assert generation["eos_token_id"] == [tokenizer.eos_id, tokenizer.encode("<|im_end|>")[0]]
    assert generation["bos_token_id"] == tokenizer.bos_id
    assert exported.fingerprint() == tokenizer.fingerprint()  # bos framing is serving-only


def test_byte_model_exports_a_tokenizer_transformers_can_read(tmp_path):
    cfg = tiny_experiment(str(tmp_path / "run"), str(tmp_path), steps=2)
    m = init_model(dataclasses.replace(cfg.model, num_mtp_layers=0), seed=1)
    interop.export_hf_checkpoint(m, tmp_path / "out", ByteTokenizer())
    exported = load_tokenizer(str(tmp_path / "out"))
    assert isinstance(exported, HFTokenizer)
    text = "byte-level: é 😀\n\t x"
    assert exported.encode(text, add_bos=True) == ByteTokenizer().encode(text, add_bos=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        257,
        258,
        256,
    )


@pytest.mark.slow
def test_command_line_pretrain_export_convert(tmp_path):
    """The documented commands: launch.pretrain --config.init_from=HF_DIR on JSONL documents,
    launch.export of the run, launch.convert of the export with --eval_dir and --prompt."""
    _write_documents(tmp_path / "docs.jsonl")
    base = tiny_experiment(str(tmp_path / "run"), str(tmp_path / "docs.jsonl"), steps=2)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=VOCAB))
    hf_dir, tokenizer = _pretrained_folder(tmp_path, base)
    config_file = tmp_path / "cfg.py"
    config_file.write_text(
        textwrap.dedent(f"""
        import dataclasses
        import ml_collections
        from composer_jax import config
        from tests.train.helpers import tiny_experiment

        def get_config():
            cfg = tiny_experiment({str(tmp_path / "run")!r}, {str(tmp_path / "docs.jsonl")!r}, 2)
            cfg = dataclasses.replace(
                cfg,
                model=dataclasses.replace(cfg.model, vocab_size={VOCAB}),
                data=dataclasses.replace(cfg.data, text_field="body"),
            )
            return ml_collections.ConfigDict(config.to_dict(cfg))
    """)
    )
    env = dict(os.environ, PYTHONPATH=REPO)

    def run(*args):
        out = subprocess.run(
            [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    run(
        "launch.pretrain",
        f"--config={config_file}",
        f"--config.init_from={hf_dir}",
        "--progress=false",
    )
    assert run_tokenizer(str(tmp_path / "run")).fingerprint() == tokenizer.fingerprint()
    run("launch.export", f"--config.workdir={tmp_path / 'run'}", f"--out={tmp_path / 'out'}")
    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("def f(x):\n    return x * 2\n" * 20)
    stdout = run(
        "launch.convert",
        f"--hf_dir={tmp_path / 'out'}",
        f"--eval_dir={code}",
        "--window=32",
        "--stride=16",
        "--prompt=def g(",
        "--max_new_tokens=4",
    )
    assert "bits/byte" in stdout and "greedy continuation of 'def g('" in stdout


def test_a_chat_template_added_to_the_tokenizer_folder_is_not_the_runs_tokenizer(tmp_path):
    """Added between a run and its resume, `chat_template.jinja` changes every prompt's tokens
    (template format instead of the generic one): the resume is refused."""
    folder = tmp_path / "bpe"
    make_hf_folder(folder, chat_template=None)
    before = load_tokenizer(str(folder))
    fingerprint = before.fingerprint()
    check_run_tokenizer(str(tmp_path / "run"), before)  # nothing saved yet: nothing to check
    save_run_tokenizer(before, str(tmp_path / "run"))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    after = load_tokenizer(str(folder))
    assert after.chat_template and after.fingerprint() != fingerprint
    with pytest.raises(ConfigError, match="is not the tokenizer"):
        check_run_tokenizer(str(tmp_path / "run"), after)
