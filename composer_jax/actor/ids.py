"""Typed ids of the actor loop: a group is one prompt's samples (a retry when an earlier group of
the prompt was dropped), a sample one index of a group on one attempt (a failed environment starts
it over). They become strings only where they are stored: the ledger, the environment pools and
the in-flight records."""

from __future__ import annotations

import dataclasses
import re

_PROMPT = re.compile(r"^[A-Za-z0-9_.]+$")
_GROUP = re.compile(r"^(?P<prompt>[A-Za-z0-9_.]+)(?:-r(?P<retry>\d+))?$")


@dataclasses.dataclass(frozen=True, order=True)
class GroupId:
    prompt: str  # the prompt's id, e.g. "p00012" (a hard prompt's fresh variant: "p00012v3")
    retry: int = 0  # 0: the first group of the prompt; n: the n-th after dropped ones

    def __post_init__(self):
        if not _PROMPT.match(self.prompt):
            raise ValueError(f"prompt id {self.prompt!r} must match {_PROMPT.pattern}")
        if self.retry < 0:
            raise ValueError(f"retry must be >= 0, got {self.retry}")

    def __str__(self) -> str:
        return self.prompt if not self.retry else f"{self.prompt}-r{self.retry}"

    @classmethod
    def parse(cls, text: str) -> GroupId:
        match = _GROUP.match(text)
        if match is None:
            raise ValueError(f"not a group id: {text!r}")
        return cls(match["prompt"], int(match["retry"] or 0))


@dataclasses.dataclass(frozen=True, order=True)
class SampleId:
    group: GroupId
    index: int
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.group}-s{self.index}-a{self.attempt}"
