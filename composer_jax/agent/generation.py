"""One generation's token buffers, as the sampler produced them, and its trainable `Sequence`.

A generation is the context the policy saw and the tokens it wrote, in the engine's order: the
prompt, each turn, the tool outputs between them. A chain of generations joined by summaries is
one sample. Flagged turns get a teacher context with the feedback hint inserted before them
(`teacher_sequence`), which text-feedback distillation trains toward.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from composer_jax.infer import Completion
from composer_jax.model.moe import UNROUTED
from composer_jax.rl.batch import SegmentKind, Sequence


@dataclasses.dataclass(kw_only=True, eq=False)
class Generation:
    """One generation's growing token buffers, in the engine's token order."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    kinds: list[int] = dataclasses.field(default_factory=list)
    policy: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # [moe_layers, k] each

    def add_context(self, tokens, kind: SegmentKind) -> None:
        self.tokens += [int(t) for t in tokens]
        self.kinds += [int(kind)] * len(tokens)
        self.policy += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [0] * len(tokens)

    def add_turn(self, completion: Completion, kinds) -> None:
        """Generated tokens, and the routes of the positions prefilled for this turn. The engine
        reports token i's experts at the position that produced it (i - 1); the turn's last token
        is routed when the next turn prefills it, so it appears in that turn's prompt_experts."""
        self.routes += [np.asarray(e) for e in completion.prompt_experts]
        self.routes += [np.asarray(e) for e in completion.experts[1:]]
        self.tokens += completion.tokens
        self.kinds += [int(k) for k in kinds]
        self.policy += [True] * len(completion.tokens)
        self.logprobs += completion.logprobs
        self.versions += completion.versions

    def clear(self) -> None:
        self.tokens, self.kinds, self.policy, self.logprobs = [], [], [], []
        self.versions, self.routes = [], []

    def to_sequence(self, sample_index: int, num_moe_layers: int, k: int, flagged=()) -> Sequence:
        """The generation as a Sequence. Every position but the last is routed; the last token
        predicts nothing and is `UNROUTED`, as the packer gives padding. `flagged`: turns
        (start, end, hint tokens) whose hinted teacher context is attached."""
        if len(self.routes) != len(self.tokens) - 1:
            raise RuntimeError(f"{len(self.routes)} routes for {len(self.tokens)} tokens")
        filler = np.full((num_moe_layers, k), UNROUTED, np.int32)
        tokens = np.asarray(self.tokens, np.int32)
        teacher_tokens = teacher_index = None
        if flagged:
            teacher_tokens, teacher_index = teacher_sequence(tokens, list(flagged))
        return Sequence(
            sample_index=sample_index,
            tokens=tokens,
            kinds=np.asarray(self.kinds, np.int32),
            policy_mask=np.asarray(self.policy, bool),
            sampler_logprobs=np.asarray(self.logprobs, np.float32),
            policy_versions=np.asarray(self.versions, np.int32),
            router_indices=np.stack(self.routes + [filler], axis=1).astype(np.int32),
            teacher_tokens=teacher_tokens,
            teacher_target_index=teacher_index,
        )


def teacher_sequence(
    tokens: np.ndarray, flagged: list[tuple[int, int, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Inserts each hint before its flagged turn.

    `flagged` holds sorted, non-overlapping (turn_start, turn_end, hint_tokens) spans of token
    positions. Returns the teacher tokens (int32 [L + sum of hint lengths]) and, per token, the
    index of the same token in them on flagged spans, -1 elsewhere (int32 [L]).
    """
    tokens = np.asarray(tokens, np.int32)
    target = np.full(len(tokens), -1, np.int32)
    pieces, cursor, previous_end, shift = [], 0, 0, 0
    for start, end, hint in flagged:
        if not previous_end <= start < end <= len(tokens):
            raise ValueError(
                f"flagged span [{start}, {end}) is empty, out of [0, {len(tokens)}), "
                f"unsorted or overlaps the previous one (ending at {previous_end})"
            )
        hint = np.asarray(hint, np.int32).reshape(-1)
        pieces += [tokens[cursor:start], hint]
        shift += len(hint)
        target[start:end] = np.arange(start, end) + shift
        cursor, previous_end = start, end
    pieces.append(tokens[cursor:])
    return np.concatenate(pieces).astype(np.int32), target


def hinted_turns(
    tokens: np.ndarray, teacher_tokens: np.ndarray, target_index: np.ndarray
) -> list[tuple[int, int, np.ndarray]]:
    """The (turn_start, turn_end, hint_tokens) spans `teacher_sequence` built `teacher_tokens`
    and `target_index` from: each flagged turn is a run of non-negative `target_index`, its hint
    the tokens the index shifted past (adjacent turns part where the shift grows). Raises
    ValueError when they do not rebuild the teacher."""
    target_index = np.asarray(target_index)
    flagged = np.flatnonzero(target_index >= 0)
    if flagged.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(flagged) > 1) | (np.diff(target_index[flagged]) > 1))
    starts = flagged[np.concatenate([[0], breaks + 1])]
    ends = flagged[np.concatenate([breaks, [flagged.size - 1]])] + 1
    spans, shift = [], 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        new_shift = int(target_index[start]) - start
        hint = np.asarray(teacher_tokens[start + shift : start + new_shift], np.int32)
        spans.append((start, end, hint))
        shift = new_shift
    rebuilt, _ = teacher_sequence(tokens, spans)
    if not np.array_equal(rebuilt, teacher_tokens):
        raise ValueError("the teacher tokens are not the sequence with hints inserted")
    return spans
