"""The GPU check's markdown report, rendered from its JSON results."""

from __future__ import annotations

import collections

GiB = 2**30


def _fmt(value, spec: str = ".1f", none: str = "") -> str:
    return none if value is None else format(value, spec)


def _status(result: dict) -> str:
    status = result["status"]
    if status in ("n/a", "skipped", "timeout", "crash"):
        return f"{status}: {result.get('reason', '')}".rstrip(": ")
    if status == "fail":
        why = result.get("error") or str(result.get("check", ""))
        return f"FAIL: {why}"[:160]
    return status


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines + [""]


def _gemm_section(results: list[dict]) -> list[str]:
    lines = ["## Grouped GEMM", ""]
    lines.append(
        "Kernel time on the device (CUPTI) unless the timer column says otherwise; % peak is of "
        "the MMA format the case runs; `vs ragged_dot` is lax.ragged_dot bf16's time over the "
        "case's (> 1: faster), the wgrad kernel against XLA's ragged_dot_general."
    )
    lines.append("")
    by_shape = collections.defaultdict(list)
    for r in results:
        by_shape[r["name"].split("/")[1]].append(r)
    for shape, rows in by_shape.items():
        base = {r["name"].split("/")[2]: r.get("ms") for r in rows if r["status"] == "ok"}
        table = []
        for r in rows:
            backend = r["name"].split("/")[2]
            ref = base.get("xla_wgrad_bf16" if "wgrad" in backend else "ragged_dot_bf16")
            ms = r.get("ms")
            speedup = _fmt(ref / ms, ".2f") if ref and ms and "quantize" not in backend else ""
            err = (r.get("check") or {}).get("max_rel_err")
            fraction = r.get("peak_fraction") or r.get("hbm_fraction")
            table.append(
                [
                    backend,
                    _status(r) if r["status"] != "ok" else r.get("mode", "ok"),
                    _fmt(ms, ".3f"),
                    _fmt(r.get("tflops")) or (_fmt(r.get("gb_per_s"), ".0f") + " GB/s" if r.get("gb_per_s") else ""),
                    r.get("format", "HBM" if r.get("gb_per_s") else ""),
                    _fmt(100 * fraction if fraction else None),
                    speedup,
                    _fmt(err, ".1e"),
                    "" if r.get("timer", "cupti") == "cupti" else "wall",
                    _fmt(r["compiled_bytes"] / 2**20 if r.get("compiled_bytes") else None, ".0f"),
                ]
            )  # fmt: skip
        lines.append(f"### {shape}")
        lines.append("")
        header = ["backend", "status", "ms", "TFLOP/s", "format", "% peak", "vs ragged_dot"]
        lines += _table(header + ["max rel err", "timer", "MiB"], table)
    return lines


def _model_section(results: list[dict]) -> list[str]:
    lines = []
    train = [r for r in results if r["kind"] == "train_mfu"]
    if train:
        lines += ["## Train step (1 device)", ""]
        rows = [
            [
                r["name"].split("/", 1)[1],
                _status(r),
                r.get("backend", ""),
                _fmt(r["params"] / 1e6 if r.get("params") else None, ".1f"),
                _fmt(r.get("step_ms")),
                _fmt(r.get("tokens_per_s"), ",.0f"),
                _fmt(100 * r["mfu"] if r.get("mfu") is not None else None),
                _fmt(100 * r["roofline_best_mfu"] if r.get("roofline_best_mfu") else None),
                _fmt(r.get("compile_s")),
                _fmt(r["peak_bytes_in_use"] / GiB if r.get("peak_bytes_in_use") else None, ".2f"),
            ]
            for r in train
        ]
        header = ["config / experts", "status", "backend", "M params", "step ms", "tokens/s"]
        header += ["MFU %", "roofline best %", "compile s", "peak GiB"]
        lines += _table(header, rows)
    serving = [r for r in results if r["kind"] in ("decode", "batching")]
    if serving:
        lines += ["## Inference", ""]
        rows = [
            [
                r["name"],
                _status(r),
                _fmt(r.get("tokens_per_s"), ",.1f"),
                _fmt(r["peak_bytes_in_use"] / GiB if r.get("peak_bytes_in_use") else None, ".2f"),
            ]
            for r in serving
        ]
        lines += _table(["case", "status", "tokens/s", "peak GiB (process)"], rows)
    return lines


def render(report: dict) -> str:
    results = report["results"]
    probe = next((r for r in results if r["kind"] == "probe"), {})
    counts = collections.Counter(r["status"] for r in results)
    title = "GPU check (dry run on CPU: interpret / lowering mode, timings meaningless)"
    lines = [f"# {title if report['dry_run'] else 'GPU check'}", ""]
    lines.append(
        f"{report['started']}; device `{probe.get('device_kind', '?')}` "
        f"(spec {probe.get('spec')}), JAX {probe.get('jax', '?')}, "
        f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget."
    )
    lines += ["", "Status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    checks = [r for r in results if r["kind"] in ("pytest", "ragged_all_to_all", "train_check")]
    if checks:
        lines += ["## Checks", ""]
        rows = []
        for r in checks:
            detail = ""
            if r["kind"] == "pytest":
                passed = sum(outcome == "passed" for _, outcome in r.get("tests", []))
                detail = f"{passed}/{len(r.get('tests', []))} passed"
                detail += "; failed: " + ", ".join(r["failed"]) if r.get("failed") else ""
            elif r["kind"] == "train_check" and r.get("check"):
                c = r["check"]
                detail = f"losses {[round(x, 4) for x in c['losses']]}, first vs bf16 {c['first_loss_vs_bf16']:.2%}"
            rows.append([r["name"], _status(r), detail])
        lines += _table(["check", "status", "detail"], rows)  # fmt: skip
    gemm = [r for r in results if r["kind"] == "gemm"]
    if gemm:
        lines += _gemm_section(gemm)
    lines += _model_section(results)
    problems = [r for r in results if r["status"] in ("fail", "timeout", "crash")]
    if problems:
        lines += ["## Failures", ""]
        for r in problems:
            lines.append(f"- `{r['name']}`: {_status(r)}")
            tail = r.get("traceback") or r.get("log_tail") or r.get("output_tail")
            if tail:
                lines += ["", "```", tail.strip()[-1200:], "```", ""]
    return "\n".join(lines) + "\n"
