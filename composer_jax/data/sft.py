"""Supervised fine-tuning data: examples packed like pretraining rows, the loss on the answers.

An example is a (prompt, completion) pair of texts, rendered by the tokenizer's chat format
(`composer_jax.data.chat`): in the generic format [bos] + prompt + completion + [eos], with a
chat template the rendered user message and generation prompt, then the completion and the
template's end of turn; `loss_mask` marks the completion and what closes it, so the model learns
to answer, not to repeat prompts. Or it is already tokens: {"tokens", "loss_mask"} (a whole
agent episode as the RL workflow renders it, the loss on the agent's turns). The caller supplies
the examples (`composer_jax.agent.sft`); one longer than a row is left out, never cut.
"""

import logging

import grain
import numpy as np

from composer_jax.data.chat import chat_format_for
from composer_jax.data.pipeline import DEFAULT_PACKING_BINS, PackedRowFields

log = logging.getLogger(__name__)


def _tokenized(chat, example) -> dict[str, np.ndarray]:
    """An example's tokens and loss mask."""
    if isinstance(example, dict):
        tokens = np.asarray(example["tokens"], np.int32)
        mask = np.asarray(example["loss_mask"], np.int32)
    else:
        head, tail = chat.sft_example(*example)
        tokens = np.asarray([*head, *tail], np.int32)
        mask = np.concatenate([np.zeros(len(head), np.int32), np.ones(len(tail), np.int32)])
    return {"tokens": tokens, "loss_mask": mask}


def _fitting(tokenized: list[dict], seq_len: int) -> list[dict]:
    """The examples a row holds whole. One cut to seq_len would train an answer that never
    reaches its end of turn (or, its prompt alone too long, fill a row and train nothing), so
    the others are left out, with a warning; none fitting is an error."""
    lengths = [len(t["tokens"]) for t in tokenized]
    fitting = [t for t, n in zip(tokenized, lengths) if n <= seq_len]
    if not fitting:
        raise ValueError(
            f"no SFT example fits a row of seq_len={seq_len} tokens (the shortest has "
            f"{min(lengths)}): raise the phase's seq_len"
        )
    if len(fitting) < len(tokenized):
        log.warning(
            "%d of %d SFT examples are longer than seq_len=%d (the longest %d tokens) and are "
            "left out: raise the phase's seq_len to train on them",
            len(tokenized) - len(fitting),
            len(tokenized),
            seq_len,
            max(lengths),
        )
    return fitting


def make_sft_iterator(
    examples: list,
    tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.DatasetIterator:
    """Endless, reshuffled-per-epoch batches of packed examples: `tokens`, `segment_ids`,
    `positions`, `loss_mask`, each int32 [batch_size, seq_len]; checkpointable like pretraining
    iterators (`iterator_state_to_json`)."""
    if not examples:
        raise ValueError("no SFT examples")
    chat = chat_format_for(tokenizer)
    examples = _fitting([_tokenized(chat, example) for example in examples], seq_len)
    source = grain.MapDataset.source(examples)[shard_index::shard_count]
    rows = grain.experimental.FirstFitPackIterDataset(
        source.shuffle(seed=seed).repeat(None).to_iter_dataset(),
        length_struct={"tokens": seq_len, "loss_mask": seq_len},
        num_packing_bins=DEFAULT_PACKING_BINS,
        seed=seed,
    )
    return iter(
        rows.map(PackedRowFields(tokenizer.pad_id, ("loss_mask",))).batch(
            batch_size, drop_remainder=True
        )
    )
