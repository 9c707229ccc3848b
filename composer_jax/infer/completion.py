"""What one turn of a request produced (`Completion`) and when a turn ends: a stop token
sequence, a stop string in the decoded text, or the token budget. Shared by the continuous-
batching engine and speculative decoding."""

from __future__ import annotations

import dataclasses

import numpy as np

from composer_jax.infer.sampling import SamplingParams


@dataclasses.dataclass
class Completion:
    """One turn of one request, with everything RL needs per generated token."""

    request_id: int
    prompt: list[int]  # tokens prefilled for this turn (a continuation: the appended tokens)
    start_position: int  # sequence position of prompt[0]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampling distribution
    raw_logprobs: list[float] = dataclasses.field(default_factory=list)  # log_softmax(logits)
    versions: list[int] = dataclasses.field(default_factory=list)  # policy version per token
    # Routed experts [moe_layers, k] of the position whose logits produced each token.
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    # Routed experts of every prefilled position of this turn, [positions, moe_layers, k]; for a
    # continuation the first row is the previous turn's last token.
    prompt_experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "max_len"

    def record(self, token: int, logprob: float, raw: float, version: int, experts_LK) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.raw_logprobs.append(raw)
        self.versions.append(version)
        self.experts.append(np.asarray(experts_LK))

    def extend(self, tokens, logprobs, raws, version: int, experts_NLK) -> None:
        """`record` for the N tokens a decode chunk sampled, as arrays."""
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.raw_logprobs.extend(raws)
        self.versions.extend([version] * len(tokens))
        self.experts.extend(np.asarray(experts_NLK))


# Tokens decoded beyond a stop string's byte length when looking for it at the end of a turn (a
# token adds at least one byte; the slack covers tokens that end inside a character).
_STOP_SLACK = 8


def ends_with_stop_string(tokens: list[int], params: SamplingParams, decode) -> bool:
    """Whether the text (`decode`) of `tokens` now contains a stop string. Asked after every
    token, so a stop string can only first appear in the text of the last few tokens, which is all
    that is decoded."""
    if not params.stop_strings:
        return False
    longest = max(len(s.encode("utf-8")) for s in params.stop_strings)
    tail = decode(tokens[-(longest + _STOP_SLACK) :])
    return any(s in tail for s in params.stop_strings)


def finish_reason(tokens: list[int], params: SamplingParams, decode=None) -> str | None:
    """ "stop" when `tokens` end with a stop sequence or their text now contains a stop string,
    "length" at the token budget, else None."""
    if any(len(tokens) >= len(s) and tokens[-len(s) :] == list(s) for s in params.stop_sequences):
        return "stop"
    if ends_with_stop_string(tokens, params, decode):
        return "stop"
    if len(tokens) >= params.max_new_tokens:
        return "length"
    return None
