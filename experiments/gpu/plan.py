"""The GPU check's plan: every case with its kind, worker group, timeout and parameters.

The dry run has the same cases (same kinds, same backends, same model paths) with tiny shapes, so
a CPU run exercises everything the GPU run will do except the speed. Order is priority: when the
budget runs out, the cases at the end are the ones skipped (rerun them with --cases).
"""

from __future__ import annotations

import fnmatch

from experiments.gpu import gemm_cases

PRECISIONS = ("bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd")


def _case(name, kind, params, timeout_s, group=None):
    return dict(name=name, kind=kind, group=group or name, timeout_s=timeout_s, params=params)


def build(dry_run: bool) -> list[dict]:
    gemm = gemm_cases.cases(dry_run)
    shapes = list(dict.fromkeys(c["group"] for c in gemm))
    first_shapes = [c for c in gemm if c["group"] in shapes[:2]]
    other_shapes = [c for c in gemm if c["group"] not in shapes[:2]]
    if dry_run:
        tests = dict(paths=["tests/kernels"], select=["-k", "many_k_steps"], limit_s=110)
        check = dict(preset="dry", batch=2, seq_len=32, steps=2)
        small = dict(preset="dry", batch=2, seq_len=32, steps=2)
        wide = dict(preset="dry", batch=2, seq_len=64, steps=2)
        decode = [dict(preset="dry", context=32, steps=8), dict(preset="dry", context=64, steps=8)]
        batching = dict(
            preset="dry", slots=2, requests=4, prompt_len=(4, 24), new_tokens=(4, 12),
            buckets=(32,),
        )  # fmt: skip
    else:
        tests = dict(paths=["tests/kernels"], select=[], limit_s=170)
        check = dict(preset="tiny", batch=4, seq_len=128, steps=3)
        small = dict(preset="small", batch=16, seq_len=2048, steps=5)
        wide = dict(preset="wide", batch=16, seq_len=2048, steps=3)
        decode = [
            dict(preset="small", context=1024, steps=64),
            dict(preset="small", context=8192, steps=64),
        ]
        batching = dict(
            preset="small", slots=64, requests=128, prompt_len=(64, 1024), new_tokens=(32, 256),
            buckets=(128, 512, 1024),
        )  # fmt: skip
    plan = [
        _case("probe", "probe", {}, 120),
        _case("tests/kernels", "pytest", tests, tests["limit_s"] + 10),
        *first_shapes,
        _case("collective/ragged_all_to_all", "ragged_all_to_all", dict(rows=4096, width=128), 60),
        *[
            _case(f"train_check/{p}", "train_check", {**check, "precision": p}, 150, "train_check")
            for p in PRECISIONS
        ],
        _case("mfu/small/bf16", "train_mfu", {**small, "precision": "bf16"}, 240),
        _case("mfu/small/nvfp4_fwd_mxfp8_bwd", "train_mfu", {**small, "precision": PRECISIONS[2]}, 240),
        *[
            _case(f"decode/{d['context']}", "decode", d, 180, "decode")
            for d in decode
        ],
        _case(f"batching/{batching['slots']}_slots", "batching", batching, 240),
        _case("mfu/wide/bf16", "train_mfu", {**wide, "precision": "bf16"}, 300),
        _case("mfu/wide/nvfp4_fwd_mxfp8_bwd", "train_mfu", {**wide, "precision": PRECISIONS[2]}, 300),
        *other_shapes,
    ]  # fmt: skip
    return plan


def select(plan: list[dict], patterns: list[str]) -> list[dict]:
    """Cases whose name matches any shell pattern (all of them when `patterns` is empty)."""
    if not patterns:
        return plan
    chosen = [c for c in plan if any(fnmatch.fnmatchcase(c["name"], p) for p in patterns)]
    if not chosen:
        raise ValueError(f"no case matches {patterns}; cases: {[c['name'] for c in plan]}")
    return chosen
