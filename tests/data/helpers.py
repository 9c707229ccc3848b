"""Tokenizer folders built locally for tests (no downloads): a `tokenizers`-trained BPE in the HF
layout, and a tiktoken rank table with Kimi-K2-style special tokens and tokenization file."""

from __future__ import annotations

import base64
import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Mixed scripts, whitespace runs and code: what the equality tests throw at every tokenizer.
TRICKY_TEXTS = (
    "",
    " ",
    "hello world",
    "  leading and trailing  ",
    "tabs\t\tand\n\n\nnewlines\r\n",
    "    def f(x):\n        return x  # done\n\n\n",
    "héllo wörld, ça va? naïve café",
    "中文字符测试，混合English和数字123456789",
    "emoji 😀🐍 and combining e\u0301 marks",
    '<call tool="write_file"><arg name="path">a.py</arg></call>',
    "x" * 300 + " " * 40 + "y",
    "日本語のテキスト and ß ẞ Ωmega",
)

TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n",
    '<think>let me write it</think>\n<call tool="write_file"><arg name="path">a.py</arg>',
    '<arg name="content">\nimport os\nprint(os.getcwd())\n</arg></call>\n<final>Done.</final>',
    "The quick brown fox jumps over the lazy dog. Ça va très bien, merci.",
    "中文字符测试 日本語のテキスト 한국어 텍스트",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i)\n",
] * 20

# The ChatML-style template many HF checkpoints ship (written here, not copied).
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe(
    vocab_size: int = 400, special=("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(s, special=True) for s in special],
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def make_hf_folder(folder, chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 400):
    """tokenizer.json + tokenizer_config.json (bos/eos/pad, chat template) in `folder`."""
    os.makedirs(folder, exist_ok=True)
    tokenizer = train_bpe(vocab_size)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # what transformers builds from the folder
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return tokenizer


# Kimi-K2's pre-tokenization pattern, piece by piece (Han runs, cased words with contractions,
# 1-3 digit groups, punctuation runs, newline runs, whitespace).
KIMI_PATTERN_PARTS = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]
KIMI_NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    15: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def kimi_ranks() -> dict[bytes, int]:
    """A small valid BPE rank table: the 256 bytes, then the merges of a trained byte-level BPE."""
    bpe = json.loads(train_bpe(600).to_str())["model"]
    byte_of = {c: b for b, c in _byte_chars().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in bpe["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def _byte_chars() -> dict[int, str]:
    from composer_jax.data.tokenizer import _byte_level_chars

    return _byte_level_chars()


def make_tiktoken_folder(folder, chat_template: str | None = KIMI_TEMPLATE, reserved: int = 256):
    """tiktoken.model + tokenizer_config.json + tokenization_kimi.py the way Kimi-K2 ships them;
    returns (ranks, pattern, special tokens) to build the reference `tiktoken.Encoding`."""
    os.makedirs(folder, exist_ok=True)
    ranks = kimi_ranks()
    with open(os.path.join(folder, "tiktoken.model"), "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    base = len(ranks)
    config = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "added_tokens_decoder": {
            str(base + offset): {"content": name, "special": True}
            for offset, name in KIMI_NAMED.items()
        },
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    parts = ",\n".join(f'            r"""{p}"""' for p in KIMI_PATTERN_PARTS)
    with open(os.path.join(folder, "tokenization_kimi.py"), "w") as f:
        f.write(
            "import tiktoken\n\n\nclass TikTokenTokenizer:\n"
            f"    num_reserved_special_tokens = {reserved}\n"
            f'    pat_str = "|".join(\n        [\n{parts},\n        ]\n    )\n'
        )
    special = {
        KIMI_NAMED.get(i - base, f"<|reserved_token_{i}|>"): i for i in range(base, base + reserved)
    }
    return ranks, "|".join(KIMI_PATTERN_PARTS), special
