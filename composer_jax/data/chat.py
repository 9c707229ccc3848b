"""How an agent conversation becomes token ids: the checkpoint's chat template, or the generic format.

The agent's turns are the protocol text of `composer_jax.envs.grading.protocol` (<think>, <call>, <final>);
the chat format only decides what surrounds them. Two formats, chosen by `chat_format_for`:

Generic format (no chat template; the byte tokenizer and the shipped BPE tokenizers):
    prompt          encode(task)                      (SFT examples: [bos] + encode(task))
    assistant turn  the model's text; generation stops at a protocol marker or eos
                    (SFT completions: encode(turn) + [eos])
    tool output     encode("\n" + output + "\n")
    notes           encode(note + assistant prefix), e.g. a summary request
This is exactly the layout every run used before chat templates existed, so byte-level runs are
unchanged.

Template format (the tokenizer folder has a Jinja `chat_template`, rendered the way HF renders it:
sandboxed Jinja with trim_blocks / lstrip_blocks, `tojson`, `raise_exception`, the special-token
strings as variables):
    prompt          render([system?, user(task)], add_generation_prompt=True)
    assistant turn  the model's text; the template's end-of-turn token and eos also stop it
    tool output     the text the template puts between an assistant turn and the next one
                    around a `tool` message (a `user` message if the template has no tool role)
The text around a tool output is found once by rendering a conversation with placeholder contents
and cutting at the placeholders, so a rollout appends it after each turn without re-rendering the
whole history (the KV cache keeps the prefix). Templates whose rendering of earlier turns changes
as the conversation grows (e.g. ones that drop past reasoning) are not prefix-stable and are
refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json

from composer_jax.data.tokenizer import Tokenizer

PROMPT, OBSERVATION = "prompt", "observation"  # segment roles: context scaffolding / tool output


class ChatTemplateError(ValueError):
    """The checkpoint's chat template cannot render the agent's conversations."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """Token ids appended to a conversation, with their role (PROMPT or OBSERVATION)."""

    ids: list[int]
    role: str


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (HF marks assistant spans with it): renders
        its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = False,
    **variables,
) -> str:
    """The template's text for `messages` ({"role", "content"} dicts), as HF renders it."""
    import jinja2

    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


class ChatFormat:
    """Renders the agent's conversation pieces into token ids for one tokenizer."""

    name: str

    def __init__(self, tokenizer: Tokenizer, system: str | None = None):
        self.tokenizer, self.system = tokenizer, system

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Single tokens that end an assistant turn."""
        return (self.tokenizer.eos_id,)

    def prompt(self, task: str) -> list[int]:
        """Everything before the assistant's first turn."""
        raise NotImplementedError

    def sft_example(self, task: str, turn: str) -> tuple[list[int], list[int]]:
        """(context ids, target ids) of a supervised first turn: the target closes the turn."""
        raise NotImplementedError

    def after_turn(
        self, observation: str, generated: list[int], note: str = "", assistant_prefix: str = ""
    ) -> list[Segment]:
        """What follows a generated turn: the tool output, then (optionally) a note to the model
        and the start of its next turn, e.g. a summary request and "<summary>"."""
        raise NotImplementedError


class GenericChatFormat(ChatFormat):
    """The plain format described in the module docstring."""

    name = "generic"

    def prompt(self, task: str) -> list[int]:
        text = task if self.system is None else f"{self.system}\n{task}"
        return self.tokenizer.encode(text)

    def sft_example(self, task, turn):
        return [*self._bos(), *self.prompt(task)], self.tokenizer.encode(turn, add_eos=True)

    def _bos(self) -> list[int]:
        return [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]

    def after_turn(self, observation, generated, note="", assistant_prefix=""):
        segments = [
            Segment(self.tokenizer.encode(f"\n{observation}\n", special=False), OBSERVATION)
        ]
        if note or assistant_prefix:
            segments.append(Segment(self.tokenizer.encode(note + assistant_prefix), PROMPT))
        return segments


# Placeholders the template renders in place of contents (no whitespace, so trimming keeps them).
_TASK, _TURN, _OUTPUT, _NEXT = "TASK7f3a9c", "TURN7f3a9c", "OUTPUT7f3a9c", "NEXT7f3a9c"


class TemplateChatFormat(ChatFormat):
    """The checkpoint's Jinja chat template (see the module docstring)."""

    name = "template"

    def __init__(self, tokenizer: Tokenizer, system: str | None = None):
        super().__init__(tokenizer, system)
        if tokenizer.chat_template is None:
            raise ChatTemplateError(f"tokenizer {tokenizer.spec!r} has no chat template")
        self.template = tokenizer.chat_template
        self._variables = tokenizer.template_tokens
        self.tool_role, self._before_output, self._after_output = self._tool_pieces()
        closed = self.render([*self._head(_TASK), {"role": "assistant", "content": _TURN}])
        self.turn_close = closed[closed.index(_TURN) + len(_TURN) :]
        close_ids = tokenizer.encode(self.turn_close) if self.turn_close else []
        specials = set(tokenizer.special_tokens.values())
        self._close_id = close_ids[0] if close_ids and close_ids[0] in specials else None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render_chat_template(
            self.template, messages, add_generation_prompt, **self._variables
        )

    def _head(self, task: str) -> list[dict]:
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, {"role": "user", "content": task}]

    def _tool_pieces(self) -> tuple[str, str, str]:
        """(tool role, text before a tool output, text after it up to the next turn's content)."""
        prompt = self.render(self._head(_TASK), add_generation_prompt=True)
        errors = []
        for role in ("tool", "user"):
            conversation = [
                *self._head(_TASK),
                {"role": "assistant", "content": _TURN},
                {"role": role, "content": _OUTPUT},
                {"role": "assistant", "content": _NEXT},
            ]
            try:
                text = self.render(conversation)
            except ChatTemplateError as e:
                errors.append(f"{role}: {e}")
                continue
            if not all(p in text for p in (_TURN, _OUTPUT, _NEXT)):
                errors.append(f"{role}: a message's content is not rendered verbatim")
                continue
            if text[: text.index(_TURN)] != prompt:
                raise ChatTemplateError(
                    "chat template is not prefix-stable: the text before the assistant's first "
                    "turn differs from its generation prompt"
                )
            between = text[text.index(_TURN) + len(_TURN) : text.index(_NEXT)]
            cut = between.index(_OUTPUT)
            return role, between[:cut], between[cut + len(_OUTPUT) :]
        raise ChatTemplateError("chat template cannot render tool outputs: " + "; ".join(errors))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids = [self.tokenizer.eos_id]
        if self._close_id is not None and self._close_id not in ids:
            ids.append(self._close_id)
        return tuple(ids)

    def prompt(self, task: str) -> list[int]:
        return self.tokenizer.encode(self.render(self._head(task), add_generation_prompt=True))

    def sft_example(self, task, turn):
        return self.prompt(task), self.tokenizer.encode(turn + self.turn_close)

    def after_turn(self, observation, generated, note="", assistant_prefix=""):
        before = self.tokenizer.encode(self._before_output)
        if generated and self._close_id is not None and generated[-1] == self._close_id:
            if before[:1] == [self._close_id]:  # the model closed its turn itself
                before = before[1:]
        segments = [
            Segment(before, PROMPT),
            Segment(self.tokenizer.encode(observation, special=False), OBSERVATION),
            Segment(self.tokenizer.encode(note), PROMPT),
            Segment(self.tokenizer.encode(self._after_output + assistant_prefix), PROMPT),
        ]
        return [s for s in segments if s.ids]


def chat_format_for(tokenizer: Tokenizer, system: str | None = None) -> ChatFormat:
    """The template format when the tokenizer's folder has a chat template, else the generic one."""
    if tokenizer.chat_template:
        return TemplateChatFormat(tokenizer, system)
    return GenericChatFormat(tokenizer, system)
