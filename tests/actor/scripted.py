"""A sampler that plays scripted turns: the coordinator's tests plant exact agent behaviour.

It keeps each request's context like the engine does (a continuation appends, a restart keeps a
prefix) and reports routes of every prefilled and generated position, so the sequences it yields
have the engine's shape. `script(prompt_text, turn_index) -> text` decides each turn (with
`seeded=True`: `script(prompt_text, turn_index, seed)`, the request's sampling seed).
`ScriptedEngine` is the same policy behind the engine's interface, for `agent.play`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from composer_jax import agent, data
from composer_jax.actor.coordinator import Coordinator
from composer_jax.actor.sampler import Sampler
from composer_jax.config import ModelConfig
from composer_jax.infer import Completion

BYTES = data.get_tokenizer("byte")


def make_coordinator(
    cfg, sampler, pool, ledger, prompts, tokenizer=BYTES, model_cfg=ModelConfig(), **kwargs
):
    """A Coordinator over the run's workflow (built from `cfg`) in its training environment."""
    environment = agent.env_config(cfg.agent)
    workflow = agent.make_workflow(
        cfg.agent,
        tokenizer,
        model_cfg,
        environment,
        max_len=cfg.rollout.context_len,
        sampling=agent.rollout_sampling(cfg.rollout, kwargs.get("seed", 0)),
        distill=cfg.objective.distill_coef > 0,
    )
    return Coordinator(cfg, sampler, pool, ledger, prompts, workflow, environment, **kwargs)


@dataclasses.dataclass
class _Request:
    context: list[int]
    params: object
    turn: int
    start: int
    prompt: list[int]


class ScriptedSampler(Sampler):
    def __init__(
        self, script, tokenizer, num_slots=8, max_len=1024, moe_layers=1, k=2, seeded=False
    ):
        self.script, self.tokenizer, self.seeded = script, tokenizer, seeded
        self.num_slots, self.max_len = num_slots, max_len
        self.moe_layers, self.k = moe_layers, k
        self._requests: dict[int, _Request] = {}
        self._running: list[int] = []
        self._next = 0
        self._version = 0
        self.generated_tokens = 0

    @property
    def version(self):
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def _new(self, context, params, turn, start, prompt) -> int:
        rid, self._next = self._next, self._next + 1
        self._requests[rid] = _Request(list(context), params, turn, start, list(prompt))
        self._running.append(rid)
        return rid

    def submit(self, prompt, params):
        return self._new(prompt, params, 0, 0, prompt)

    def continue_request(self, request_id, appended, params):
        # As the engine: the previous turn's last token is prefilled (and routed) first.
        old = self._requests.pop(request_id)
        feed = [old.context[-1], *appended]
        context = old.context + list(appended)
        return self._new(context, params, old.turn + 1, len(old.context) - 1, feed)

    def restart_request(self, request_id, keep, appended, params):
        old = self._requests.pop(request_id)
        return self._new(old.context[:keep] + list(appended), params, old.turn + 1, keep, appended)

    def release(self, request_id):
        self._requests.pop(request_id, None)

    def poll(self, max_steps: int = 8):
        done = []
        for rid in self._running:
            req = self._requests[rid]
            prompt_text = self.tokenizer.decode(req.context)
            args = (req.params.seed,) if self.seeded else ()
            text = self.script(prompt_text, req.turn, *args)
            tokens = list(self.tokenizer.encode(text))[: req.params.max_new_tokens]
            route = np.tile(np.arange(self.k, dtype=np.int32), (self.moe_layers, 1))
            c = Completion(rid, req.prompt, req.start)
            c.prompt_experts = [route] * len(req.prompt)
            for t in tokens:
                c.record(t, -0.5, -0.5, self._version, route)
            c.finish_reason = "stop"
            req.context += tokens
            done.append(c)
            self.generated_tokens += len(tokens)
        self._running = []
        return done

    def sync_weights(self, wait_for=None, timeout_s=600.0):
        return self._version

    def stats(self):
        return {"generated_tokens": self.generated_tokens}


class ScriptedEngine(ScriptedSampler):
    """The scripted policy behind the InferenceEngine interface that `agent.play` drives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions: dict[int, Completion] = {}

    def step(self) -> list[int]:
        done = self.poll()
        self.completions.update({c.request_id: c for c in done})
        return [c.request_id for c in done]
