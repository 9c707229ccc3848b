"""A run from a Hugging Face checkpoint takes its architecture from the checkpoint's config.json:
no model field by hand, and every setting the model cannot represent named in one error."""

import json
import os
import shutil
import subprocess
import sys

from composer_jax.interop import config_from_hf
from composer_jax.interop.safetensors_io import read_hf_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
YARN = os.path.join(REPO, "tests", "fixtures", "hf_deepseek_v3", "yarn")


def pretrain(*args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run(
        [sys.executable, "-m", "launch.pretrain", "--config=tiny", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_architecture_comes_from_the_checkpoint(tmp_path):
    result = pretrain(f"--config.init_from={YARN}", "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    model = json.loads(result.stdout)["model"]
    want = config_from_hf(read_hf_config(YARN))
    for name in ("vocab_size", "hidden_size", "num_layers", "q_lora_rank", "n_group"):
        assert model[name] == getattr(want, name), name
    assert model["rope_scaling"]["factor"] == 4.0  # yarn, from the checkpoint
    assert model["num_mtp_layers"] == 1 and model["dtype"] == "bfloat16"  # the config's own


def test_every_unsupported_setting_is_named_in_one_line(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(YARN, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(scoring_func="softmax", tie_word_embeddings=True)
    (folder / "config.json").write_text(json.dumps(config))
    result = pretrain(f"--config.init_from={folder}", "--print_config", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: init_from:"), result.stderr
    assert "scoring_func='softmax'" in lines[0] and "tie_word_embeddings=True" in lines[0]


def test_a_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    result = pretrain(f"--config.init_from={tmp_path / 'empty'}", "--print_config", cwd=tmp_path)
    assert result.returncode == 2 and "has no config.json" in result.stderr
