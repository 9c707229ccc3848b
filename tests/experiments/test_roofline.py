"""Roofline arithmetic on hand-computable numbers."""

from __future__ import annotations

import dataclasses

import pytest

from composer_jax import presets
from composer_jax.model import accounting
from composer_jax.plan import devices
from experiments import roofline

# Round numbers: 100 FLOP/s bf16, 200 fp8, 400 fp4; 10 B/s HBM; 20 B/s NVLink (10 one way).
TOY = devices.DeviceSpec("toy", 100.0, 200.0, 400.0, 10.0, 20.0, 1e9, 1)
WORK = roofline.Workload(
    tokens=10,
    expert_flops=600.0,
    dense_flops=300.0,
    attention_flops=100.0,
    memory_bytes=50.0,
    comm_bytes=40.0,
    model_flops=1000.0,
)


def test_bf16_split_and_best_mfu():
    pred = roofline.predict(WORK, TOY, "bf16")
    assert pred.gemm_s == pytest.approx(9.0)  # (600 + 300) / 100
    assert pred.attention_s == pytest.approx(1.0)
    assert pred.memory_s == pytest.approx(5.0)  # 50 / 10
    assert pred.comm_s == pytest.approx(4.0)  # 40 / (20 / 2)
    assert pred.serial_s == pytest.approx(19.0)
    assert pred.overlapped_s == pytest.approx(15.0)  # max(9 + 1 + 5, 4)
    assert pred.best_mfu == pytest.approx(1000 / (15 * 100))
    assert [r[0] for r in pred.rows()] == ["GEMM", "attention", "memory-bound", "communication"]
    assert sum(r[2] for r in pred.rows()) == pytest.approx(1.0)


def test_low_precision_expert_formats():
    # Forward third of the expert FLOPs at fp4, the backward two thirds at fp8.
    pred = roofline.predict(WORK, TOY, "nvfp4_fwd_mxfp8_bwd")
    assert pred.gemm_s == pytest.approx(200 / 400 + 400 / 200 + 300 / 100)
    assert roofline.predict(WORK, TOY, "mxfp8").gemm_s == pytest.approx(600 / 200 + 3.0)
    # No FP4 MMA (Hopper): the NVFP4 forward runs as bf16.
    hopper_like = dataclasses.replace(TOY, fp4_flops=None)
    assert roofline.predict(WORK, hopper_like, "nvfp4_fwd_mxfp8_bwd").gemm_s == pytest.approx(
        200 / 100 + 400 / 200 + 3.0
    )
    with pytest.raises(ValueError, match="expert_precision"):
        roofline.predict(WORK, TOY, "fp3")


def test_communication_bound_step():
    pred = roofline.predict(dataclasses.replace(WORK, comm_bytes=400.0), TOY)
    assert pred.overlapped_s == pytest.approx(40.0)
    assert pred.best_mfu == pytest.approx(1000 / (40 * 100))


def test_workload_flops_of_the_tiny_model_by_hand():
    cfg = presets.tiny().model  # hidden 64, 8 experts of 32, top-2, one MoE layer
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts) == (64, 32, 8)
    assert (cfg.num_experts_per_tok, cfg.num_moe_layers) == (2, 1)
    work = roofline.workload(cfg, seq_len=16, batch_per_device=2)
    routed_active = 3 * 64 * 32 * 2  # gate, up, down of the two chosen experts
    assert work.tokens == 32
    assert work.expert_flops == pytest.approx(6 * routed_active * 32)
    total = work.expert_flops + work.dense_flops + work.attention_flops
    assert total == pytest.approx(work.model_flops)
    assert work.model_flops == pytest.approx(accounting.train_flops_per_token(cfg, 16) * 32)
    assert work.comm_bytes == 0.0
    # Low precision adds quantization traffic; more devices add communication.
    assert roofline.workload(cfg, 16, 2, "mxfp8").memory_bytes > work.memory_bytes
    assert roofline.workload(cfg, 16, 2, devices=8).comm_bytes > 0


def test_device_table_lookup():
    assert devices.spec_for("NVIDIA H200").name == "H200"
    assert devices.spec_for("NVIDIA GB200").name == "GB200"
    assert devices.spec_for("NVIDIA B200").name == "B200"
    assert devices.spec_for("cpu") is None
    assert devices.by_name("H100").peak("fp4") is None
    assert devices.by_name("B200").peak("fp4") == 4 * devices.by_name("B200").peak("bf16")
    with pytest.raises(ValueError, match="MMA format"):
        devices.by_name("H100").peak("int8")
