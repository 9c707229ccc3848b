"""Text in, text out: the inference engine behind one call, for notebooks and quick checks.

    model, tokenizer = run.model, run.tokenizer          # train.load_run(workdir)
    infer.generate(model, tokenizer, ["def fib(n):"], max_new_tokens=64)

Prompts are encoded with bos (when the tokenizer has one), or rendered as a user message by the
checkpoint's chat template with `chat=True`. Generation stops at eos (and the template's end of
turn), at one of `stop` (the returned text ends before it), or after `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses

from composer_jax.data.chat import chat_format_for
from composer_jax.data.tokenizer import Tokenizer, check_vocab
from composer_jax.infer.engine import InferenceEngine
from composer_jax.infer.sampling import SamplingParams
from composer_jax.model.transformer import Transformer

PREFILL_BUCKETS = (16, 64, 256, 1024)
LENGTH_MULTIPLE = 64  # engines built here round max_len up (and slots to a power of two) so
# calls of similar size reuse compiled shapes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def generate(
    model: Transformer | InferenceEngine,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    *,
    top_p: float = 1.0,
    seed: int = 0,
    stop: tuple[str, ...] = (),
    chat: bool = False,
    add_bos: bool = True,
) -> list[str]:
    """The text generated after each prompt (greedy at temperature 0). `model` may be an
    `InferenceEngine` to reuse (its compiled shapes and slots); else one is built to fit."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings")
    stops = tuple(stop)
    if chat:
        chat_format = chat_format_for(tokenizer)
        encoded = [chat_format.prompt(p) for p in prompts]
        stop_ids = chat_format.stop_token_ids
    else:
        encoded = [tokenizer.encode(p, add_bos=add_bos) for p in prompts]
        stop_ids = (tokenizer.eos_id,)
    if isinstance(model, InferenceEngine):
        engine = model
        check_vocab(tokenizer, engine.cfg.vocab_size)
    else:
        check_vocab(tokenizer, model.cfg.vocab_size)
        longest = max((len(ids) for ids in encoded), default=1)
        max_len = _round_up(longest + max_new_tokens + 1, LENGTH_MULTIPLE)
        engine = InferenceEngine(
            model,
            num_slots=1 << max(len(prompts) - 1, 0).bit_length(),
            max_len=max_len,
            prefill_buckets=tuple(b for b in PREFILL_BUCKETS if b < max_len) + (max_len,),
            tokenizer=tokenizer,
        )
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        stop_sequences=tuple((i,) for i in stop_ids),
        stop_strings=stops,
        tokenizer=tokenizer.spec,
    )
    ids = [
        engine.submit(prompt, dataclasses.replace(params, seed=seed + i))
        for i, prompt in enumerate(encoded)
    ]
    engine.run()
    completions = [engine.completions.pop(i) for i in ids]
    return [_cut_at_stop(tokenizer.decode(c.tokens), stops) for c in completions]
