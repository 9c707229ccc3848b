r"""Trains the small byte-level BPE tokenizer shipped as `code_bpe_2k` and reports bytes per token.

  python experiments/train_bpe.py [--vocab_size=2048] [--out=composer_jax/data/tokenizers/code_bpe_2k]

Training text, all of it built in (nothing is downloaded): the training split of the standard
library corpus (what `launch.pretrain` reads) and the SFT examples of the built-in coding tasks
(the prompts and oracle turns the RL main job warm-starts on, same seed as its SFT phase). The
tokenizer is `tokenizers`' BPE over GPT-2 byte-level pre-tokenization, so every byte sequence
encodes, with pad / bos / eos as special tokens. Bytes per token are measured on text it was not
trained on: the held-out split of the corpus and fresh held-out task instances.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_VOCAB = flags.DEFINE_integer("vocab_size", 2048, "Vocabulary size (special tokens included).")
_OUT = flags.DEFINE_string(
    "out", os.path.join(ROOT, "composer_jax", "data", "tokenizers", "code_bpe_2k"), "Folder."
)
_TASKS = flags.DEFINE_integer("tasks", 2000, "Built-in SFT examples in the training text.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the task examples (the RL main job's SFT seed).")
_MAX_OPS = flags.DEFINE_integer("max_ops", 1, "Task transforms (the main job uses 1).")

SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>")


def training_text(tasks: int, seed: int, max_ops: int):
    from composer_jax import envs
    from composer_jax.data.corpus import CodeCorpus

    corpus = CodeCorpus(split="train")
    for i in range(len(corpus)):
        yield corpus[i]
    for task in envs.builtin_tasks(tasks, seed=seed, max_ops=max_ops):
        prompt, turn = envs.sft_example(task)
        yield prompt + turn


def heldout_text(max_ops: int) -> dict[str, list[str]]:
    from composer_jax import envs
    from composer_jax.data.corpus import CodeCorpus

    corpus = CodeCorpus(split="eval")
    tasks = envs.builtin_tasks(200, "train", seed=2, max_ops=max_ops)  # the held-out instances
    episodes = ["".join(envs.sft_example(task)) for task in tasks]
    return {"stdlib eval split": [corpus[i] for i in range(len(corpus))], "task episodes": episodes}


def train(vocab_size: int, tasks: int, seed: int, max_ops: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL],
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(tasks, seed, max_ops), trainer)
    return tokenizer


def main(argv):
    del argv
    from composer_jax.data.tokenizer import ByteTokenizer, load_tokenizer

    start = time.perf_counter()
    tokenizer = train(_VOCAB.value, _TASKS.value, _SEED.value, _MAX_OPS.value)
    os.makedirs(_OUT.value, exist_ok=True)
    tokenizer.save(os.path.join(_OUT.value, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(_OUT.value, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"trained in {time.perf_counter() - start:.0f} s -> {_OUT.value}")
    ours, byte = load_tokenizer(_OUT.value), ByteTokenizer()
    size = sum(os.path.getsize(p) for p in ours.files())
    print(f"vocab {ours.vocab_size} ids, files {size / 1024:.0f} KiB")
    print("| text | bytes | byte tokens | BPE tokens | bytes / BPE token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, texts in heldout_text(_MAX_OPS.value).items():
        n_bytes = sum(byte.count_tokens(t) for t in texts)
        n_tokens = sum(ours.count_tokens(t) for t in texts)
        print(f"| {name} | {n_bytes} | {n_bytes} | {n_tokens} | {n_bytes / n_tokens:.2f} |")


if __name__ == "__main__":
    app.run(main)
