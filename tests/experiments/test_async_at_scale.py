"""The cluster-scale answers: the roofline costs they rest on, and their plots at toy sizes."""

from __future__ import annotations

import numpy as np
import pytest

from composer_jax import presets
from composer_jax.model import accounting
from composer_jax.plan import devices
from experiments import async_at_scale as scale


def test_decode_reads_the_active_weights_for_one_row_and_every_expert_for_many():
    """At one row each MoE layer touches its top-k experts (the active parameters); at 4096
    rows every expert; both memory-bound at kimi_k2's shape."""
    model, h200 = presets.kimi_k2().model, devices.by_name("H200")
    counts = accounting.count_params(model)
    bandwidth = 16 * h200.hbm_bytes_per_s
    one = scale.sampler_decode_s(model, h200, 16, rows=1, context=0)
    assert one == pytest.approx((counts.active - counts.embedding) / bandwidth)
    routed_active = counts.routed_experts * model.num_experts_per_tok / model.num_experts
    every = counts.active - routed_active - counts.embedding + counts.routed_experts
    many = scale.sampler_decode_s(model, h200, 16, rows=4096, context=0)
    assert many == pytest.approx(every / bandwidth, rel=1e-6)
    cached = scale.sampler_decode_s(model, h200, 16, rows=4096, context=10_000)
    assert cached > many


def test_roofline_costs_are_faster_on_b200_per_gpu_and_grow_with_rows():
    model = presets.kimi_k2().model
    h200, b200 = (scale.roofline_costs(model, d, scale.MEAN_CONTEXT) for d in ("H200", "B200"))
    assert list(h200.decode_s) == sorted(h200.decode_s)
    assert b200.train_s_per_token < h200.train_s_per_token
    assert h200.grading_s == scale.GRADING_S and h200.publish_s > 0


@pytest.mark.parametrize("sigma", [0.0, 1.0, 1.5])
def test_turn_lengths_keep_their_mean_as_the_tail_grows(sigma):
    drawn = scale.lengths(sigma).draw(np.random.default_rng(0), 200_000, scale.MAX_NEW_TOKENS)
    assert np.mean(drawn) == pytest.approx(scale.MEAN_TURN_TOKENS, rel=0.03)


def test_staleness_and_inflight_answers_plot_at_toy_sizes(tmp_path):
    """A few hundred episodes: every bound's histogram is a distribution within its bound, and
    the PNGs are written."""
    costs = scale.roofline_costs(presets.kimi_k2().model, "H200", scale.MEAN_CONTEXT)
    hists = scale.answer_staleness(costs, str(tmp_path), episodes=1024)
    for name, bound in (("max_staleness 1", 1), ("2", 2), ("4", 4)):
        assert sum(hists[name].values()) == pytest.approx(1.0)
        assert max(hists[name]) <= bound
    inflight = scale.answer_inflight(costs, str(tmp_path), episodes=1024)
    assert len(inflight["gain"]) == len(scale.SIGMAS)
    assert (tmp_path / "staleness.png").stat().st_size > 0
    assert (tmp_path / "inflight.png").stat().st_size > 0
