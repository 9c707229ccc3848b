"""SFT rows: prompts are context only, completions are learned, and the iterator resumes."""

import numpy as np
import pytest

from composer_jax import envs
from composer_jax.data import get_tokenizer, iterator_state_to_json, restore_iterator_from_json
from composer_jax.data.sft import make_sft_iterator


def task_examples(count, seed):
    return [envs.sft_example(t) for t in envs.builtin_tasks(count, seed=seed)]


def test_loss_mask_covers_exactly_the_completions():
    tokenizer = get_tokenizer("byte")
    examples = task_examples(64, seed=3)
    completions = {c for _, c in examples}
    it = make_sft_iterator(examples, tokenizer, seq_len=640, batch_size=4, seed=1)
    batch = next(it)
    seen = 0
    for row in range(4):
        tokens, seg, mask = (batch[k][row] for k in ("tokens", "segment_ids", "loss_mask"))
        for s in set(seg[seg > 0].tolist()):
            piece, piece_mask = tokens[seg == s], mask[seg == s]
            assert piece[0] == tokenizer.bos_id and piece_mask[0] == 0
            assert piece[-1] == tokenizer.eos_id and piece_mask[-1] == 1
            assert tokenizer.decode(piece[piece_mask > 0]) in completions
            prompt = tokenizer.decode(piece[piece_mask == 0])
            assert prompt.startswith("Write ") and "Tools:" in prompt
            seen += 1
        assert not mask[seg == 0].any()
    assert seen >= 4


def test_sft_iterator_resumes_exactly():
    tokenizer = get_tokenizer("byte")
    examples = task_examples(32, seed=4)
    it = make_sft_iterator(examples, tokenizer, seq_len=640, batch_size=2, seed=2)
    for _ in range(5):
        next(it)
    state = iterator_state_to_json(it)
    want = [next(it) for _ in range(3)]
    fresh = make_sft_iterator(examples, tokenizer, seq_len=640, batch_size=2, seed=2)
    restore_iterator_from_json(fresh, state)
    for batch in want:
        got = next(fresh)
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key])


def test_an_example_longer_than_a_row_is_left_out_never_cut(caplog):
    """Cut to seq_len, a 21-token answer kept its first 11 and lost its eos: the model learned
    answers that never end. Left out with a warning instead; none fitting is an error."""
    tokenizer = get_tokenizer("byte")
    short, long = ("Say hi", "hi"), ("Say a lot" * 3, "lo" * 20)
    it = make_sft_iterator([short, long], tokenizer, seq_len=32, batch_size=4, seed=0)
    batch = next(it)
    assert "1 of 2 SFT examples are longer than seq_len=32" in caplog.text
    for row in range(4):
        tokens, seg = batch["tokens"][row], batch["segment_ids"][row]
        for s in set(seg[seg > 0].tolist()):
            assert tokenizer.decode(tokens[seg == s]) == "Say hihi"
    with pytest.raises(ValueError, match="no SFT example fits a row of seq_len=8"):
        make_sft_iterator([short, long], tokenizer, seq_len=8, batch_size=4, seed=0)
