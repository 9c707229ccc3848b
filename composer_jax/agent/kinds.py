"""What each token of an agent episode is, and where a turn ends.

A turn's text follows the protocol of `composer_jax.envs.grading.protocol`: generation stops once the text
holds a closing marker (a tool call, or the final message) or at the chat format's end of turn.
Every token gets a `SegmentKind` (thinking, tool call, final message; tool output and prompt for
the context), which the length penalty weighs and the trainer masks by, whatever the tokenizer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from composer_jax.data.chat import OBSERVATION, ChatFormat, Segment
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs.grading import protocol
from composer_jax.infer import SamplingParams
from composer_jax.rl.batch import SegmentKind

# A turn ends after a tool call (the environment must answer it) or the final message.
TURN_END_MARKERS = (protocol.CALL_CLOSE, protocol.FINAL_CLOSE)
_SPANS = (
    (protocol.THINK_OPEN, protocol.THINK_CLOSE, SegmentKind.THINKING),
    (protocol.CALL_OPEN, protocol.CALL_CLOSE, SegmentKind.TOOL_CALL),
    (protocol.FINAL_OPEN, protocol.FINAL_CLOSE, SegmentKind.FINAL_MESSAGE),
)


def turn_sampling(
    params: SamplingParams, chat: ChatFormat, markers: tuple[str, ...] = TURN_END_MARKERS
) -> SamplingParams:
    """`params` that end a turn at the protocol's closing markers (by text, so any tokenization
    of them stops) and at the chat format's end-of-turn tokens."""
    return dataclasses.replace(
        params,
        stop_sequences=tuple((i,) for i in chat.stop_token_ids),
        stop_strings=markers,
        tokenizer=chat.tokenizer.spec,
    )


def segment_kind(segment: Segment) -> SegmentKind:
    """Tool output counts as such for the length penalty; the chat scaffolding is prompt."""
    return SegmentKind.TOOL_OUTPUT if segment.role == OBSERVATION else SegmentKind.PROMPT


def text_kinds(text: str) -> np.ndarray:
    """SegmentKind per character of an agent turn. Untagged text counts as thinking, as the
    environment's counts do; an unclosed tag runs to the end."""
    kinds = np.full(len(text), SegmentKind.THINKING, np.int32)
    pos = 0
    while pos < len(text):
        found = [(text.find(o, pos), o, c, k) for o, c, k in _SPANS]
        found = [f for f in found if f[0] >= 0]
        if not found:
            break
        start, _, close, kind = min(found)
        end = text.find(close, start)
        end = len(text) if end < 0 else end + len(close)
        kinds[start:end] = kind
        pos = end
    return kinds


def token_kinds(tokens: list[int], tokenizer: Tokenizer) -> np.ndarray:
    """Kinds of generated tokens: each token takes the kind of the first character it adds to
    the turn's text (`Tokenizer.token_texts`; a token that adds nothing, e.g. the first bytes of
    a character or a special token, takes the kind of the text at its place)."""
    pieces = tokenizer.token_texts(tokens)
    kinds = text_kinds("".join(pieces))
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    if len(kinds) == 0:
        return np.full(len(tokens), SegmentKind.THINKING, np.int32)
    return kinds[np.minimum(starts, len(kinds) - 1)].astype(np.int32)
