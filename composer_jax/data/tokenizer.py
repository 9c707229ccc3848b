"""Tokenizers behind one small interface: byte (the embedded default), HF `tokenizer.json`, tiktoken.

`load_tokenizer("byte")`, `load_tokenizer(name)` for a tokenizer shipped in
`composer_jax/data/tokenizers/<name>/`, or `load_tokenizer(folder)` for a checkpoint's folder:
`tokenizer.json` goes through the `tokenizers` package (DeepSeek-V3 and most HF checkpoints),
`tiktoken.model` through `tiktoken` (the Kimi-K2 family). Nothing is downloaded: every file is read
from the folder.

Every tokenizer encodes text without adding special tokens (special-token strings inside the text
do map to their ids, as in the libraries and their HF wrappers, so a rendered chat template
tokenizes right), decodes without special tokens, and names its bos / eos / pad ids, vocabulary
size and special tokens. `token_texts` splits a decoding over the tokens that produced it, which
is how turn text is attributed to tokens for the length penalty, whatever the tokenizer. This
module imports no JAX, so environment hosts can count tokens with it.
"""

from __future__ import annotations

import ast
import base64
import codecs
import functools
import hashlib
import json
import os
import shutil

import numpy as np

BYTE = "byte"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tiktoken.model",
)
# Kimi-K2 reserves this many ids after the rank table for special tokens (tokenization_kimi.py).
DEFAULT_RESERVED_SPECIAL_TOKENS = 256
# `token_texts`: at most this many tokens in a row end inside one UTF-8 character, and at most
# this many tokens before a token are decoded with it as context.
_MAX_PENDING = 8
_MAX_CONTEXT = 16


# Settings of a tokenizer folder that only say how transformers frames an encoding.
# What the fingerprint hashes: the vocabulary and its settings, and the chat template.
_FINGERPRINTED = (
    "tokenizer.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
)
SERVING_ONLY = {
    "tokenizer.json": ("post_processor",),
    "tokenizer_config.json": ("add_bos_token", "add_eos_token"),
}


class TokenizerError(ValueError):
    """A tokenizer folder is incomplete or inconsistent; the message names the file and field."""


class Tokenizer:
    """The interface every tokenizer implements.

    `spec` is what `load_tokenizer` takes to build the same tokenizer again (the name or the
    folder), so a tokenizer can be named in configs and sampling parameters.
    """

    spec: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (special tokens included): the model needs at least this."""
        raise NotImplementedError

    @property
    def special_tokens(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def template_tokens(self) -> dict[str, str]:
        """`bos_token`, `eos_token`, ... as strings, the variables a chat template reads."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        by_id = {i: s for s, i in self.special_tokens.items()}
        return {key: by_id[i] for key, i in names.items() if i in by_id}

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of `ids` with special tokens dropped; a cut UTF-8 character becomes U+FFFD."""
        raise NotImplementedError

    def files(self) -> list[str]:
        """The files that define this tokenizer (copied into runs and exports)."""
        return []

    def encode(
        self, text: str, add_bos: bool = False, add_eos: bool = False, special: bool = True
    ) -> list[int]:
        """Token ids of `text`, optionally framed by bos (when the tokenizer has one) and eos.
        `special=False` for text nobody vouches for (tool output, a corpus document): a special
        token's string in it stays text instead of becoming that token (an `<|eos|>` printed by
        the code under test would end the context's turn)."""
        ids = self._encode(text) if special else self._encode_plain(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self._encode(text))

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` read as text only (special-token strings are not parsed)."""
        return self._encode(text)

    def num_bytes(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def token_id(self, token: str) -> int:
        """The id of a named special token (e.g. "<|im_end|>")."""
        special = self.special_tokens
        if token not in special:
            shown = ", ".join(sorted(special)[:12])
            raise KeyError(f"{self.spec!r} has no special token {token!r} (it has: {shown} ...)")
        return special[token]

    def token_texts(self, ids) -> list[str]:
        """The text each token adds to `decode(ids)`; they join to the decoding. A token that ends
        inside a character adds "" and the token completing the character carries it."""
        ids = _as_id_list(ids)
        pieces: list[str] = []
        start = 0  # ids[:start] are attributed; ids[start:i+1] are being resolved
        for i in range(len(ids)):
            # Decode from a few tokens back, as far as needed for the context to show some text:
            # decoders render a decoding's first token differently (sentencepiece drops its
            # leading space), so that token must be one already attributed.
            context, known = start, ""
            while context > 0 and not known and start - context < _MAX_CONTEXT:
                context -= 1
                known = self.decode(ids[context:start])
            text = self.decode(ids[context : i + 1])
            pending = i + 1 - start
            if text.endswith("\ufffd") and i + 1 < len(ids) and pending < _MAX_PENDING:
                pieces.append("")
                continue
            pieces.append(text[len(os.path.commonprefix([known, text])) :])
            start = i + 1
        return pieces

    def fingerprint(self) -> str:
        """A hash of the defining files, the chat template included (it decides how every prompt
        is tokenized): the same tokenizer in two folders has one fingerprint.
        JSON files are hashed as their content without `SERVING_ONLY` settings, which this project
        never applies (it encodes without the tokenizer's own special-token framing and adds bos
        itself), so an export that sets them for transformers keeps the fingerprint."""
        digest = hashlib.sha256()
        for path in sorted(self.files(), key=os.path.basename):
            name = os.path.basename(path)
            if name not in _FINGERPRINTED:
                continue
            digest.update(name.encode())
            with open(path, "rb") as f:
                data = f.read()
            if name in SERVING_ONLY:
                content = json.loads(data)
                for key in SERVING_ONLY[name]:
                    content.pop(key, None)
                data = json.dumps(content, sort_keys=True).encode()
            digest.update(data)
        return digest.hexdigest()

    def save(self, directory: str) -> None:
        """Copies the defining files into `directory`."""
        os.makedirs(directory, exist_ok=True)
        for path in self.files():
            target = os.path.join(directory, os.path.basename(path))
            if os.path.abspath(path) != os.path.abspath(target):
                shutil.copyfile(path, target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size})"


def _as_id_list(ids) -> list[int]:
    return [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]


def _texts_from_bytes(token_bytes: list[bytes]) -> list[str]:
    """Per-token texts of a byte-level decoding (invalid UTF-8 becomes U+FFFD, as in decode)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [decoder.decode(b) for b in token_bytes]
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer over UTF-8: ids 0..255 are bytes, then pad / bos / eos.

    It needs no vocabulary file, so pretraining and evaluation run fully offline and bits per
    byte compare across runs. Special-token strings in text stay bytes here.
    """

    spec = BYTE
    pad_id = 256
    bos_id = 257
    eos_id = 258
    SPECIAL = {"<|pad|>": 256, "<|bos|>": 257, "<|eos|>": 258}

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.SPECIAL)

    def fingerprint(self) -> str:
        return BYTE

    def _encode(self, text: str) -> list[int]:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).tolist()

    def count_tokens(self, text: str) -> int:
        return len(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        byte_ids = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
        return byte_ids.tobytes().decode("utf-8", errors="replace")

    def token_texts(self, ids) -> list[str]:
        return _texts_from_bytes([bytes([i]) if 0 <= i < 256 else b"" for i in _as_id_list(ids)])

    def hf_tokenizer_json(self) -> str:
        """The same tokenizer as a `tokenizers` JSON (bytes as a merge-free byte-level BPE), so an
        exported byte model loads in `transformers` with the ids it was trained on."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFCore

        by_byte = _byte_level_chars()
        core = HFCore(models.BPE(vocab={by_byte[b]: b for b in range(256)}, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.decoder = decoders.ByteLevel()
        core.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in self.SPECIAL]
        )
        return core.to_str()

    def save(self, directory: str) -> None:
        """Writes tokenizer.json / tokenizer_config.json equivalents (for HF export)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            f.write(self.hf_tokenizer_json())
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
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)


@functools.cache
def _byte_level_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _token_string(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: str, config: dict) -> str | None:
    """The folder's chat template: `chat_template.jinja`, else tokenizer_config's `chat_template`
    (a string, or a list of named templates of which "default" is used)."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


class _FolderTokenizer(Tokenizer):
    """What HF and tiktoken folders share: tokenizer_config.json, config.json fallbacks."""

    def __init__(self, folder: str, spec: str | None = None):
        self.folder = os.path.abspath(folder)
        self.spec = spec or self.folder
        self.config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        self.model_config = _read_json(os.path.join(folder, "config.json"))
        self.chat_template = _chat_template(folder, self.config)

    def _named_id(self, key: str) -> int | None:
        """The id of `bos_token` / `eos_token` / `pad_token`: tokenizer_config.json names the
        token, config.json may give `<key>_id`."""
        token = _token_string(self.config.get(key))
        if token is not None:
            special = self.special_tokens
            if token in special:
                return special[token]
            found = self._plain_token_id(token)
            if found is None:
                raise TokenizerError(
                    f"{self.folder}/tokenizer_config.json: {key} {token!r} is not in the vocabulary"
                )
            return found
        value = self.model_config.get(f"{key}_id")
        if isinstance(value, list):
            value = value[0] if value else None
        return int(value) if value is not None else None

    def _plain_token_id(self, token: str) -> int | None:
        return None

    def _resolve_special_ids(self) -> None:
        self.bos_id = self._named_id("bos_token")
        eos = self._named_id("eos_token")
        if eos is None:
            raise TokenizerError(
                f"{self.folder}: no eos token (tokenizer_config.json `eos_token` or config.json "
                "`eos_token_id`)"
            )
        self.eos_id = eos
        pad = self._named_id("pad_token")
        self.pad_id = eos if pad is None else pad

    def files(self) -> list[str]:
        names = list(TOKENIZER_FILES) + [
            n for n in os.listdir(self.folder) if n.startswith("tokenization") and n.endswith(".py")
        ]
        return [
            os.path.join(self.folder, n)
            for n in names
            if os.path.exists(os.path.join(self.folder, n))
        ]


class HFTokenizer(_FolderTokenizer):
    """A Hugging Face `tokenizer.json` through the `tokenizers` package."""

    def __init__(self, folder: str, spec: str | None = None):
        from tokenizers import Tokenizer as HFCore

        super().__init__(folder, spec)
        path = os.path.join(folder, "tokenizer.json")
        try:
            self.core = HFCore.from_file(path)
        except Exception as e:  # noqa: BLE001 -- the library raises plain Exceptions
            raise TokenizerError(f"{path}: cannot be read by `tokenizers` ({e})") from None
        added = self.core.get_added_tokens_decoder()
        # Every added token is looked up by name; `decode` drops those marked special.
        self._special = {t.content: int(i) for i, t in added.items()}
        self._vocab_size = max(self.core.get_vocab(with_added_tokens=True).values()) + 1
        self._resolve_special_ids()

    def _plain_token_id(self, token: str) -> int | None:
        return self.core.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def _encode(self, text: str) -> list[int]:
        return self.core.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain_core(self):
        """A copy of the core that encodes special-token strings as text."""
        from tokenizers import Tokenizer as HFCore

        core = HFCore.from_str(self.core.to_str())
        core.encode_special_tokens = True
        return core

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain_core.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.core.decode(_as_id_list(ids), skip_special_tokens=True)


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The rank table of a `tiktoken.model` file (one "base64-token rank" per line), read straight
    from disk: tiktoken's own loader caches by path in a temp folder, which could serve a stale
    table for a rewritten file."""
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise TokenizerError(f"{path}:{number}: expected 'base64-token rank'") from None
    return ranks


def _literal_strings(node: ast.AST) -> str | None:
    """The value of a string literal, or of `"sep".join([literal, ...])`; None otherwise."""
    try:
        value = ast.literal_eval(node)
        return value if isinstance(value, str) else None
    except (ValueError, TypeError, SyntaxError):
        pass
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and not node.keywords
    ):
        try:
            sep, parts = ast.literal_eval(node.func.value), ast.literal_eval(node.args[0])
        except (ValueError, TypeError, SyntaxError):
            return None
        if isinstance(sep, str) and all(isinstance(p, str) for p in parts):
            return sep.join(parts)
    return None


def tokenization_constants(folder: str) -> dict:
    """`pat_str` and `num_reserved_special_tokens` as assigned in the folder's `tokenization*.py`
    (Kimi-K2 ships its pre-tokenization pattern there). The file is parsed, never executed."""
    found = {}
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("tokenization") and name.endswith(".py")):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=name)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                key = getattr(target, "id", None)
                if key == "pat_str" and "pat_str" not in found:
                    value = _literal_strings(node.value)
                    if value is not None:
                        found["pat_str"] = value
                elif key == "num_reserved_special_tokens":
                    try:
                        found.setdefault(key, int(ast.literal_eval(node.value)))
                    except (ValueError, TypeError, SyntaxError):
                        pass
    return found


class TiktokenTokenizer(_FolderTokenizer):
    """A tiktoken BPE (`tiktoken.model`) with the pattern and special tokens of the folder's files,
    laid out as Kimi-K2 does: special ids follow the rank table (`num_reserved_special_tokens` of
    them), named by tokenizer_config.json's `added_tokens_decoder`, `<|reserved_token_{id}|>`
    otherwise. The pattern is `pat_str` from tokenizer_config.json or the folder's
    `tokenization*.py`."""

    def __init__(self, folder: str, spec: str | None = None):
        import tiktoken

        super().__init__(folder, spec)
        ranks = read_tiktoken_ranks(os.path.join(folder, "tiktoken.model"))
        constants = tokenization_constants(folder)
        pattern = self.config.get("pat_str") or constants.get("pat_str")
        if not pattern:
            raise TokenizerError(
                f"{folder}: no pre-tokenization pattern (`pat_str` in tokenizer_config.json or "
                "in a tokenization*.py file)"
            )
        reserved = int(
            self.config.get(
                "num_reserved_special_tokens",
                constants.get("num_reserved_special_tokens", DEFAULT_RESERVED_SPECIAL_TOKENS),
            )
        )
        named = {
            int(i): entry["content"]
            for i, entry in self.config.get("added_tokens_decoder", {}).items()
            if isinstance(entry, dict) and "content" in entry
        }
        base = len(ranks)
        if sorted(ranks.values()) != list(range(base)):
            raise TokenizerError(f"{folder}/tiktoken.model: ranks must be 0..{base - 1}")
        below = sorted(i for i in named if i < base)
        if below:
            raise TokenizerError(
                f"{folder}/tokenizer_config.json: added tokens {below[:4]} collide with ranks"
            )
        last = max([base + reserved - 1, *named])
        self._special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, last + 1)}
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(self.folder) or "tiktoken",
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=self._special,
        )
        self._special_ids = frozenset(self._special.values())
        self._resolve_special_ids()

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def _encode_plain(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def _plain(self, ids) -> list[int]:
        return [i for i in _as_id_list(ids) if i not in self._special_ids]

    def decode(self, ids) -> str:
        return self.encoding.decode(self._plain(ids), errors="replace")

    def token_texts(self, ids) -> list[str]:
        return _texts_from_bytes(
            [
                b"" if i in self._special_ids else self.encoding.decode_single_token_bytes(i)
                for i in _as_id_list(ids)
            ]
        )


def resolve_tokenizer_folder(path_or_name: str) -> str | None:
    """The folder a spec names: a shipped tokenizer's, the path itself, or None for "byte"."""
    if path_or_name == BYTE:
        return None
    shipped = os.path.join(SHIPPED_DIR, path_or_name)
    if os.sep not in path_or_name and os.path.isdir(shipped):
        return shipped
    return path_or_name


def available_shipped() -> list[str]:
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(n for n in os.listdir(SHIPPED_DIR) if os.path.isdir(os.path.join(SHIPPED_DIR, n)))


def load_tokenizer(path_or_name: str) -> Tokenizer:
    """ "byte", a shipped tokenizer's name, or a folder holding `tokenizer.json` (HF) or
    `tiktoken.model` (with its tokenizer_config.json)."""
    folder = resolve_tokenizer_folder(path_or_name)
    if folder is None:
        return ByteTokenizer()
    if not os.path.isdir(folder):
        raise TokenizerError(
            f"unknown tokenizer {path_or_name!r}: not 'byte', not a shipped tokenizer "
            f"({', '.join(available_shipped()) or 'none'}) and not a folder"
        )
    spec = path_or_name if folder.startswith(SHIPPED_DIR) else os.path.abspath(folder)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder, spec)
    if os.path.exists(os.path.join(folder, "tiktoken.model")):
        return TiktokenTokenizer(folder, spec)
    raise TokenizerError(f"{folder}: has neither tokenizer.json nor tiktoken.model")


@functools.lru_cache(maxsize=8)
def cached_tokenizer(path_or_name: str) -> Tokenizer:
    """`load_tokenizer`, built once per process (for code that only holds a tokenizer's spec)."""
    return load_tokenizer(path_or_name)


def get_tokenizer(name: str) -> Tokenizer:
    """Same as `load_tokenizer` (the name configs have always used)."""
    return load_tokenizer(name)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int, where: str = "model.vocab_size"):
    """A model must have an embedding row for every id the tokenizer can produce."""
    if model_vocab_size < tokenizer.vocab_size:
        raise TokenizerError(
            f"{where}: {model_vocab_size} is smaller than the vocabulary of tokenizer "
            f"{tokenizer.spec!r} ({tokenizer.vocab_size} ids); use a model with at least that "
            "many embedding rows or the tokenizer it was trained with"
        )
