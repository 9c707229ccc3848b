"""op_profile reads XLA's per-op times off a jax.profiler trace: ops named as in the optimized
HLO, with opcode, shape and the JAX operation; a scanned body's ops counted once per iteration;
the big product outweighs a small elementwise op."""

import jax
import jax.numpy as jnp
import pytest

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
    assert sum(op_profile.by_opcode(ops).values()) == pytest.approx(sum(op.ms for op in ops))
    table = op_profile.format_ops(ops, top=2)
    assert table.count("\n") == 3 and products[0].name in op_profile.format_ops(ops)


def test_products_are_grouped_by_pass_and_operation():
    """A loss gradient's products: the forward's einsum, and its two transposes in the backward
    (a weight gradient and an input gradient), each group summing its ops."""
    x = jnp.ones((256, 128), jnp.float32)
    w = jnp.ones((128, 192), jnp.float32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(jnp.einsum("mk,kn->mn", x, w)))

    ops = op_profile.xla_op_times(jax.grad(loss, argnums=(0, 1)), w, x, repeats=2)
    products = op_profile.by_product(ops)
    assert {(p.backward, p.operation) for p in products} == {
        (False, "mk,kn->mn"),
        (True, "mk,kn->mn"),
    }, op_profile.format_products(products)
    shapes = {p.shape for p in products if p.backward}
    assert shapes == {"f32[128,192]", "f32[256,128]"}  # the weight's and the input's gradients
    gemms = [op for op in ops if op_profile.kind(op) in ("gemm library", "dot")]
    assert abs(sum(p.ms for p in products) - sum(op.ms for op in gemms)) < 1e-9
    assert "| backward | mk,kn->mn |" in op_profile.format_products(products)
