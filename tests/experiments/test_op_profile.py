"""op_profile reads XLA's per-op times off a jax.profiler trace: ops named as in the optimized
HLO, with opcode, shape and the JAX operation; a scanned body's ops counted once per iteration;
the big product outweighs a small elementwise op."""

import jax
import jax.numpy as jnp

from experiments import op_profile


def test_ops_are_named_timed_and_counted_per_call():
    a = jnp.ones((384, 384), jnp.float32)

    def fn(a):
        def body(carry, _):
            return jnp.tanh(carry @ a), None

        out, _ = jax.lax.scan(body, a, None, length=3)
        return out + 1.0

    ops = op_profile.xla_op_times(fn, a, repeats=3)
    assert ops == sorted(ops, key=lambda op: -op.ms) and all(op.ms > 0 for op in ops)
    products = [op for op in ops if "dot_general" in op.source]
    assert products, op_profile.format_ops(ops)
    assert products[0].count == 3  # once per scan step, per call
    assert "f32[384,384]" in products[0].shape
    assert sum(op_profile.by_opcode(ops).values()) == sum(op.ms for op in ops)
    table = op_profile.format_ops(ops, top=2)
    assert table.count("\n") == 3 and products[0].name in op_profile.format_ops(ops)
