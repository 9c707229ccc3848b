"""The learning-rate schedules against their definitions written out step by step."""

import dataclasses
import math

import numpy as np
import optax
import pytest

from composer_jax import config as config_lib
from composer_jax import optim, presets

PEAK, FLOOR = 2e-4, 0.1


def _written_out(step: int, total: int, warmup: int, decay: int) -> float:
    """Linear warm-up to PEAK, the peak held, then cosine to FLOOR x PEAK over `decay` steps."""
    if step < warmup:
        return PEAK * step / warmup
    into_decay = min(max(step - (total - decay), 0), decay)
    cosine = 0.5 * (1 + math.cos(math.pi * into_decay / decay))
    return PEAK * (FLOOR + (1 - FLOOR) * cosine)


def _config(**fields) -> config_lib.OptimizerConfig:
    return config_lib.OptimizerConfig(learning_rate=PEAK, min_lr_ratio=FLOOR, **fields)


@pytest.mark.parametrize("warmup", [0, 7])
def test_cosine_decays_over_everything_after_the_warmup(warmup):
    total = 50
    schedule = optim.learning_rate_schedule(_config(warmup_steps=warmup), total)
    got = np.array([schedule(s) for s in range(total + 3)])
    want = [_written_out(s, total, warmup, total - warmup) for s in range(total + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    # The same curve as optax's own warm-up + cosine, which this schedule replaced.
    if warmup:
        theirs = optax.warmup_cosine_decay_schedule(0.0, PEAK, warmup, total, PEAK * FLOOR)
        np.testing.assert_allclose(got, [theirs(s) for s in range(total + 3)], rtol=1e-6)


@pytest.mark.parametrize("warmup, fraction", [(5, 0.3), (0, 0.5), (10, 1.0)])
def test_wsd_holds_the_peak_then_decays_over_the_last_fraction(warmup, fraction):
    total = 60
    cfg = _config(warmup_steps=warmup, schedule="wsd", decay_fraction=fraction)
    schedule = optim.learning_rate_schedule(cfg, total)
    decay = round(fraction * (total - warmup))
    got = np.array([schedule(s) for s in range(total + 3)])
    want = [_written_out(s, total, warmup, decay) for s in range(total + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    stable = got[warmup : total - decay + 1]
    assert np.all(stable == np.float32(PEAK)) and got[total] == pytest.approx(PEAK * FLOOR)
    if fraction == 1.0:  # the whole run decaying is the cosine schedule
        cosine = optim.learning_rate_schedule(dataclasses.replace(cfg, schedule="cosine"), total)
        np.testing.assert_allclose(got, [cosine(s) for s in range(total + 3)], rtol=1e-6)


def test_phase_scales_multiply_the_schedule():
    cfg = _config(warmup_steps=2, schedule="wsd", decay_fraction=0.5)
    plain = optim.learning_rate_schedule(cfg, 20)
    scaled = optim.learning_rate_schedule(cfg, 20, [12, 8], [1.0, 0.3])
    for step in range(20):
        factor = 1.0 if step < 12 else 0.3
        assert float(scaled(step)) == pytest.approx(factor * float(plain(step)), rel=1e-6)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"schedule": "linear"}, "optim.schedule: must be one of cosine, wsd, got 'linear'"),
        ({"decay_fraction": 0.0}, "optim.decay_fraction: must lie in (0, 1]"),
        ({"decay_fraction": 1.5}, "optim.decay_fraction: must lie in (0, 1]"),
    ],
)
def test_bad_schedules_are_refused_naming_the_field(fields, needle):
    cfg = presets.tiny()
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **fields))
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.validate(cfg)
    assert needle in str(error.value)
