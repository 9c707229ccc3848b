"""The JAX 0.11 / 0.12 spelling shims pick the call each signature takes."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import mgpu_compat


def test_load_passes_an_index_only_where_the_signature_requires_one(monkeypatch):
    calls = []

    def load_with_index(src, idx, *, layout=None, optimized=True):
        calls.append(("index", src, idx, layout, optimized))

    def load_without_index(src, *, layout=None, optimized=True):
        calls.append(("no index", src, layout, optimized))

    monkeypatch.setattr(plgpu, "load", load_with_index)
    mgpu_compat.load("ref", "layout")
    monkeypatch.setattr(plgpu, "load", load_without_index)
    mgpu_compat.load("ref", "layout", optimized=False)
    assert calls == [("index", "ref", (), "layout", True), ("no index", "ref", "layout", False)]
