"""What the actor-loop simulator (`composer_jax.actor.simulation`) is given: the costs of each
unit of work (`Costs`, measured by `experiments/loop_calibration.py`), the generation lengths
(`Lengths`) and what an episode is (`Workload`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per unit of work. The defaults are rough numbers for rl_tiny on 2 shared cores,
    read off experiments/RESULTS.md ("A timeline of the actor loop": 21.6 ms per decode step of
    32 slots, 54 s of prefill for about 107k prompt tokens, an 11.8 s train step plus a 3.9 s
    reference pass on 32 rows of 768, a 0.57 s publish, a 50 ms reload, 92 ms per environment
    call); `experiments/loop_calibration.py` measures them on the machine at hand."""

    decode_rows: tuple[int, ...] = (32,)  # rows of the decode steps timed...
    decode_s: tuple[float, ...] = (0.0216,)  # ...and the seconds of one step of each
    prefill_s_per_token: float = 5e-4
    train_s_per_token: float = 6.4e-4  # one trainer rank; the step divides by the ranks
    train_overhead_s: float = 0.0
    publish_s: float = 0.57
    rebuild_s: float = 0.05
    grading_s: float = 0.092
    # One-off start-up costs (compilation): the trainer's first step and the sampler's first
    # decode take this much longer.
    train_first_s: float = 0.0
    sampler_first_s: float = 0.0
    # A shared machine (2 cores, not an accelerator per role): a decode step takes
    # decode_train_s longer while the trainer trains and decode_env_s longer per environment
    # worker at work (a prefill in proportion); a train step that starts while a sampler
    # decodes takes train_slowdown times as long, an environment call that starts while either
    # works env_slowdown times. 0 and 1: each role has its own hardware.
    decode_train_s: float = 0.0
    decode_env_s: float = 0.0
    train_slowdown: float = 1.0
    env_slowdown: float = 1.0
    # With a pool of environment workers (SimConfig.env_workers), the calls that start and
    # close an episode's environment take these on its worker.
    env_start_s: float = 0.0
    env_close_s: float = 0.0

    def __post_init__(self):
        if len(self.decode_rows) != len(self.decode_s) or not self.decode_rows:
            raise ValueError("decode_rows and decode_s must be non-empty and of equal length")
        if list(self.decode_rows) != sorted(set(self.decode_rows)) or min(self.decode_s) <= 0:
            raise ValueError(f"decode_rows {self.decode_rows} must increase, decode_s be > 0")

    def decode_step_s(self, rows: int) -> float:
        """One decode step of `rows` rows: the table interpolated linearly; below it its first
        entry (small batches cost about the same), above it extrapolated from its last two
        entries (proportionally to the rows from a single entry)."""
        table_rows, seconds = self.decode_rows, self.decode_s
        if rows <= table_rows[-1]:
            return float(np.interp(rows, table_rows, seconds))
        if len(table_rows) == 1:
            return seconds[0] * rows / table_rows[0]
        slope = (seconds[-1] - seconds[-2]) / (table_rows[-1] - table_rows[-2])
        return seconds[-1] + slope * (rows - table_rows[-1])

    @classmethod
    def load(cls, path: str) -> Costs:
        """The costs in a JSON file written by `dump` (other keys, e.g. "context", ignored)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, data: dict) -> Costs:
        """The costs in `data` (as `dataclasses.asdict` gives them; other keys ignored)."""
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        for name in ("decode_rows", "decode_s"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    def dump(self, path: str, **context) -> None:
        """Writes the costs, with `context` (what was measured, where) kept alongside."""
        with open(path, "w") as f:
            json.dump({**dataclasses.asdict(self), "context": context}, f, indent=1)


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Generated tokens of one turn: lognormal(median, sigma) when sigma > 0 (a long tail), else
    drawn uniformly from `values` (an empirical distribution; one value: constant)."""

    values: tuple[int, ...] = (192,)
    median: float = 0.0
    sigma: float = 0.0

    @classmethod
    def from_file(cls, path: str) -> Lengths:
        """An empirical distribution: the whitespace-separated integers in `path`."""
        with open(path) as f:
            values = tuple(int(v) for v in f.read().split())
        if not values or min(values) < 1:
            raise ValueError(f"{path}: lengths must be positive integers, at least one")
        return cls(values=values)

    def draw(self, rng: np.random.Generator, count: int, cap: int) -> list[int]:
        """`count` lengths clipped to [1, cap] (the turn's token budget)."""
        if self.sigma > 0:
            drawn = self.median * np.exp(self.sigma * rng.standard_normal(count))
        else:
            drawn = rng.choice(np.asarray(self.values), size=count)
        return np.clip(np.rint(drawn), 1, cap).astype(int).tolist()


@dataclasses.dataclass(frozen=True)
class Workload:
    """What an episode is: `turns` generations, each but the last followed by `tool_s` seconds
    of tool time and `tool_output_tokens` to prefill before the next. With `share_prefixes` (the
    engine's default) a group's prompt is prefilled once per sampler and weights version, and
    its other samples copy the cache. A share `uniform_fraction` of the groups get equal rewards
    (all their samples fail, say): with dynamic sampling (rl.rollout.skip_uniform_groups) the
    trainer drops them, through the scheduler's own `next_groups`."""

    lengths: Lengths = Lengths()
    prompt_tokens: int = 280
    turns: int = 1
    tool_s: float = 0.0
    tool_output_tokens: int = 0
    share_prefixes: bool = True
    uniform_fraction: float = 0.0
