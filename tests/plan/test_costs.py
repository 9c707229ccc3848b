"""The communication estimate of compiled collectives against the bytes a ring algorithm sends."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.mesh import AXES
from composer_jax.plan import costs
from composer_jax.plan.devices import by_name

FULL = 8 * 2**20  # bytes of the whole buffer (float32)


def _seconds_to_send(body, elements_a_device):
    """The estimated communication time on an H100 of `body` run over 8 devices (fsdp)."""
    mesh = jax.make_mesh((1, 8, 1), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    fn = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    x = jax.ShapeDtypeStruct(
        (8 * elements_a_device,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
    )
    compiled = jax.jit(fn).lower(x).compile()
    planned = costs.CompiledCosts(**costs.read_costs(compiled, dict(mesh.shape), 0.0))
    return costs.estimate(planned, by_name("H100"))["communication_s"]


def test_a_reduce_scatter_sends_what_the_all_gather_of_its_input_does():
    """A ring reduce-scatter of a buffer and the all-gather that rebuilds it each send 7/8 of
    it from every device (the reduce-scatter was estimated at an eighth of that)."""
    gather = _seconds_to_send(lambda x: jax.lax.all_gather(x, "fsdp", tiled=True), FULL // 32)
    scatter = _seconds_to_send(lambda x: jax.lax.psum_scatter(x, "fsdp", tiled=True), FULL // 4)
    nvlink = by_name("H100").nvlink_bytes_per_s / 2
    assert gather == pytest.approx(7 / 8 * FULL / nvlink, rel=1e-6)
    assert scatter == pytest.approx(gather, rel=1e-6)


def test_a_permute_sends_its_whole_buffer():
    ring = [(i, (i + 1) % 8) for i in range(8)]
    seconds = _seconds_to_send(lambda x: jax.lax.ppermute(x, "fsdp", ring), FULL // 4)
    assert seconds == pytest.approx(FULL / (by_name("H100").nvlink_bytes_per_s / 2), rel=1e-6)
