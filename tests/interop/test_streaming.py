"""The streaming loader reads exactly what the eager reference reads, any region of any tensor,
on one device or sharded over eight, with host memory bounded by one tensor, and stops with one
line naming the tensor and file on a broken checkpoint."""

import json
import pathlib

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from composer_jax import interop, model
from composer_jax.config import MeshConfig
from composer_jax.interop import hf, streaming
from composer_jax.interop.safetensors_io import (
    INDEX_FILE,
    read_hf_checkpoint,
    read_safetensors_file,
)
from composer_jax.parallel import make_layout
from experiments import bench_load

from .deepseek_checkpoint import small_config, write_checkpoint

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf_deepseek_v3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("deepseek") / "ckpt")


def _pure(m) -> dict:
    return {
        jax.tree_util.keystr(p): np.asarray(x, np.float32)
        for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(m)))
    }


def _eager_params(folder) -> tuple[dict, object]:
    """The reference: every tensor read whole and dequantized by `safetensors_io`."""
    config, tensors = read_hf_checkpoint(folder)
    cfg = hf.config_from_hf(config, dtype="float32", param_dtype="float32")
    flat = jax.tree_util.tree_leaves_with_path(hf.params_from_hf(tensors, cfg))
    return {jax.tree_util.keystr(p): x for p, x in flat}, cfg


def test_the_written_checkpoint_has_the_hub_layout(checkpoint):
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    dtypes = {
        str(v.dtype) for file in files for v in read_safetensors_file(checkpoint / file).values()
    }
    config = json.loads((checkpoint / "config.json").read_text())
    assert len(files) > 3
    assert any(name.endswith("_scale_inv") for name in index["weight_map"])
    assert "model.layers.3.eh_proj.weight" in index["weight_map"]  # the MTP layer
    assert config["rope_scaling"]["type"] == "yarn" and config["num_nextn_predict_layers"] == 1
    assert {"bfloat16", "float8_e4m3fn", "float32"} <= dtypes


def test_streaming_load_equals_the_eager_reference(checkpoint):
    want, cfg = _eager_params(checkpoint)
    m = interop.load_hf_checkpoint(checkpoint)  # no model field given
    assert m.cfg == cfg and cfg.rope_scaling is not None and cfg.first_k_dense == 1
    got = _pure(m)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    logits = np.asarray(model.compute_logits(m, np.arange(12)[None] % cfg.vocab_size))
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("mesh", [MeshConfig(fsdp=8), MeshConfig(fsdp=4, cp=2, ep=("fsdp",))])
def test_sharded_load_equals_one_device(checkpoint, mesh):
    layout = make_layout(mesh, jax.devices()[:8])
    one_device = interop.load_hf_checkpoint(checkpoint, param_dtype="bfloat16")
    sharded = interop.load_hf_checkpoint(checkpoint, param_dtype="bfloat16", layout=layout)
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(sharded)))
    dtypes = [x.dtype for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(one_device)))]
    assert [x.dtype for x in leaves] == dtypes and jax.numpy.bfloat16 in dtypes
    assert any(not x.sharding.is_fully_replicated for x in leaves)
    assert all(len(x.sharding.device_set) == 8 for x in leaves)
    got, single = _pure(sharded), _pure(one_device)
    for key in single:
        np.testing.assert_array_equal(got[key], single[key], err_msg=key)


@pytest.mark.parametrize("fixture", ["written", "qlora_fused", "qlora_fp8"])
def test_any_region_reads_as_the_eager_reference(checkpoint, fixture, fresh_rng):
    """Random regions, read in strips of a few rows (a tiny buffer), of every tensor: fp8 blocks
    cut mid-block, fused and plain, equal the same region of the whole tensor read eagerly."""
    folder = checkpoint if fixture == "written" else FIXTURES / fixture
    _, eager = read_hf_checkpoint(folder)
    rng = fresh_rng
    with streaming.CheckpointReader(folder, buffer_bytes=300) as reader:
        sources = streaming.hf_sources(reader)
        assert sorted(sources) == sorted(eager)
        for name, source in sources.items():
            assert source.shape == eager[name].shape, name
            for _ in range(3):
                lo = [int(rng.integers(0, n)) for n in source.shape]
                index = tuple(
                    slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, source.shape)
                )
                got = source.read(index, np.float32)
                np.testing.assert_array_equal(got, np.asarray(eager[name][index], np.float32))


def test_views_compose_like_numpy(fresh_rng):
    rng = fresh_rng
    a = rng.standard_normal((24, 10)).astype(np.float32)
    view = streaming.SplitAxis(streaming.Transposed(streaming.ArraySource(a)), 1, (4, -1))
    want = a.T.reshape(10, 4, 6)
    stacked = streaming.Stacked(
        [view, streaming.SplitAxis(streaming.Transposed(streaming.ArraySource(a + 1)), 1, (4, -1))]
    )
    index = (slice(1, 2), slice(3, 9), slice(1, 3), slice(2, 5))
    np.testing.assert_array_equal(
        stacked.read(index, np.float32), np.stack([want, want + 1])[index]
    )
    np.testing.assert_array_equal(view.read((slice(None),) * 3, np.float32), want)


def _rewrite_shard(folder, file, edit):
    tensors = {k: np.array(v) for k, v in read_safetensors_file(folder / file).items()}
    safetensors.numpy.save_file(edit(tensors), folder / file)


def _shard_of(folder, name):
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]


def test_a_truncated_shard_names_tensor_and_file(checkpoint, tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    last = sorted(folder.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"^{last.name}: tensor '.*' .*truncated") as error:
        interop.load_hf_checkpoint(folder)
    assert "\n" not in str(error.value)


def test_a_missing_tensor_names_tensor_and_file(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    file = _shard_of(folder, name)
    _rewrite_shard(folder, file, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=f"tensor '{name}' in {file}, found in no shard"):
        interop.load_hf_checkpoint(folder)


def test_a_wrong_dtype_names_tensor_and_file(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    name = "model.layers.2.input_layernorm.weight"
    file = _shard_of(folder, name)
    _rewrite_shard(folder, file, lambda t: t | {name: t[name].astype(np.int32)})
    with pytest.raises(ValueError, match=f"^{file}: tensor '{name}' is int32"):
        interop.load_hf_checkpoint(folder)
    name = "model.layers.0.self_attn.o_proj.weight"
    file = _shard_of(folder, name)
    scale = name + "_scale_inv"
    _rewrite_shard(folder, file, lambda t: {k: v for k, v in t.items() if k != scale})
    index = json.loads((folder / INDEX_FILE).read_text())
    del index["weight_map"][scale]
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"^{file}: tensor '{name}' is float8_e4m3fn but has no"):
        interop.load_hf_checkpoint(folder)


def test_a_scale_grid_that_does_not_fit_the_block_size_is_named(tmp_path):
    """Inverse scales of 64-row blocks under weight_block_size [128, 128]: the streaming reader
    sliced them and applied them to the wrong blocks, without a word."""
    folder = write_checkpoint(tmp_path / "ckpt")
    name = "model.layers.0.self_attn.o_proj.weight"
    scale, file = name + "_scale_inv", _shard_of(folder, name)
    _rewrite_shard(folder, file, lambda t: t | {scale: np.repeat(t[scale], 2, axis=0)})
    with pytest.raises(ValueError, match=f"^{file}: scale '{scale}' has shape .* needs"):
        interop.load_hf_checkpoint(folder)


@pytest.mark.timeout(600)
def test_load_memory_is_about_one_tensor(tmp_path):
    """A 56 MiB (bf16) model whose largest tensor is 3 MiB: the streaming load holds under 1.5x
    the largest tensor plus a fixed allowance besides the model, measured in a fresh process
    from its own high-water mark (measured: 26 MiB, of which 23 MiB
    is the fixed cost of compiling the piece writes, seen on a 1 MiB checkpoint too); the eager
    reference (whole float32 copies), run the same way, holds 225 MiB, so the bound has teeth."""
    cfg = small_config(
        hidden_size=512,
        vocab_size=3072,
        num_experts=64,
        moe_intermediate_size=128,
        num_layers=3,
        first_k_dense=1,
        intermediate_size=256,
    )
    folder = write_checkpoint(
        tmp_path / "big", cfg, fp8_block=None, mtp_layers=0, shard_bytes=16 << 20
    )
    largest, limit = bench_load.memory_limit(folder)
    assert largest == 3072 * 512 * 2
    held = bench_load.measure(folder, "streaming")["held"]
    assert held < limit, (held, limit)
    assert bench_load.measure(folder, "eager")["held"] > limit


def test_two_processes_load_like_one(checkpoint, tmp_path):
    """2 processes x 4 devices (fsdp=4 x cp=2, experts across both): every device shard equals
    the one-process load's slice, the logits are the same, and each process reads only what
    its devices hold (between them, every tensor)."""
    from tests.multiprocess_probe import LOAD_TOKENS
    from tests.test_multiprocess import _launch

    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["tests.multiprocess_probe", "load", str(checkpoint), str(tmp_path)]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one = interop.load_hf_checkpoint(checkpoint)
    want = _pure(one)
    covered = {key: np.zeros(x.shape, int) for key, x in want.items()}
    read = []
    for index in range(2):
        with np.load(tmp_path / f"{index}.npz") as shards:
            read.append(int(shards["bytes_read"]))
            total = int(shards["total_bytes"])
            for name in shards.files:
                if "@" not in name or name.endswith("@start"):
                    continue
                key = name.split("@")[0]
                piece, start = shards[name], shards[name + "@start"]
                region = tuple(slice(a, a + n) for a, n in zip(start, piece.shape))
                np.testing.assert_array_equal(piece, want[key][region], err_msg=name)
                covered[key][region] += 1
            if index == 0:
                logits = shards["logits"]
    assert all((c >= 1).all() for c in covered.values())  # every parameter, all of it
    np.testing.assert_array_equal(
        logits, np.asarray(model.compute_logits(one, np.array(LOAD_TOKENS)))
    )
    assert all(r < 0.8 * total for r in read) and sum(read) >= total, (read, total)


def test_two_processes_export_like_one(checkpoint, tmp_path):
    """Loaded over 2 processes x 4 devices and exported by both: each process writes its share
    of the shard files, and together they are the one-process export byte for byte."""
    from tests.test_multiprocess import _launch

    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["tests.multiprocess_probe", "export", str(checkpoint), str(tmp_path)]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wrote = {
        line[1]: line.split("wrote")[1].split()
        for line in done.stdout.splitlines()
        if "] wrote" in line
    }
    assert set(wrote) == {"0", "1"} and all(wrote.values())
    assert not set(wrote["0"]) & set(wrote["1"])
    one = interop.load_hf_checkpoint(checkpoint)
    interop.export_hf_checkpoint(one, tmp_path / "one", dtype="fp8", shard_bytes=64 << 10)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "export").iterdir())
    assert sorted(wrote["0"] + wrote["1"]) == [f for f in files if f.endswith(".safetensors")]
    for name in files:
        assert (tmp_path / "export" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
