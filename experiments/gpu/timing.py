"""Device timing and memory figures for the GPU check.

Kernel times come from CUPTI through `jax.experimental.mosaic.gpu.profiler.measure` (JAX 0.11 and
0.12: it records every kernel a call launches, on the device's clock, so host dispatch and Python
never count). Where CUPTI is unavailable (CPU dry runs, a driver without it) the fallback is the
wall clock around `block_until_ready`, and the result says which timer produced it.
"""

from __future__ import annotations

import statistics
import time


def _median_wall_ms(fn, args, iterations: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def device_time_ms(fn, args, iterations: int = 10) -> dict:
    """{"ms": median per call, "timer": "cupti" | "wall (why)", "kernels": [(name, ms)]}.

    `kernels` lists the kernels of the median call, longest first (CUPTI only).
    """
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_call = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
        if not per_call:
            raise RuntimeError("no kernels were recorded")
        if per_call and isinstance(per_call[0], tuple):  # a single call's list
            per_call = [per_call]
        totals = [sum(ms for _, ms in call) for call in per_call]
        median = statistics.median(totals)
        call = per_call[totals.index(min(totals, key=lambda t: abs(t - median)))]
        kernels = sorted(((name[:80], ms) for name, ms in call), key=lambda x: -x[1])
        return {"ms": median, "timer": "cupti", "kernels": kernels[:4]}
    except Exception as err:  # noqa: BLE001 -- any profiler failure falls back to the wall clock
        why = f"{type(err).__name__}: {err}"[:120]
    return {"ms": _median_wall_ms(fn, args, iterations), "timer": f"wall ({why})", "kernels": []}


def compiled_bytes(compiled) -> int | None:
    """Device bytes one call of a compiled function holds: arguments, outputs, temporaries."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- optional figure; some backends have no analysis
        return None
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def peak_bytes_in_use() -> int | None:
    """The process's peak device memory so far (None where the backend keeps no statistics)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None
