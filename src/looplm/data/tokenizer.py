"""Tokenizers: a byte-level tokenizer and a byte-level BPE wrapper around HF ``tokenizers``.

Both expose the same small interface (:class:`Tokenizer`) so the rest of the library
never depends on which one is in use.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from looplm.errors import UserError

EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
CONFIG_FILE = "tokenizer_config.json"
BPE_FILE = "tokenizer.json"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the
    other 68 for chr(256), chr(257), ... in byte order."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer(ABC):
    """Common tokenizer interface used by the data pipeline and the model."""

    name: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id of the end-of-document token."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Id of the padding token."""

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-text token the model saw at the start of every document, or None (looplm's
        own tokenizers; a released model's whose tokenizer adds none)."""
        return None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Encode ``text`` without adding any special token."""

    def encode_prompt(self, text: str) -> list[int]:
        """Encode the start of a document, as a prompt: the BOS token first when the tokenizer has one."""
        ids = self.encode(text)
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts (subclasses may parallelise)."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids, skipping special tokens; invalid UTF-8 becomes U+FFFD."""

    @abstractmethod
    def token_piece(self, token_id: int) -> bytes | str:
        """One token on its own: the bytes it adds to decoded text (a byte token may hold part of a
        UTF-8 character, which `decode` would turn into U+FFFD), or the name of a special token,
        which decodes to nothing."""

    @abstractmethod
    def canonical_description(self) -> str:
        """A string that fully determines the tokenizer's behaviour."""

    def fingerprint(self) -> str:
        """sha256 hex digest of :meth:`canonical_description` (used as a cache key)."""
        return hashlib.sha256(self.canonical_description().encode("utf-8")).hexdigest()

    def summary(self) -> str:
        """Name, vocabulary size and hash (the fingerprint's start): what tells two tokenizers apart in a message."""
        return f"{self.name}, vocabulary {self.vocab_size}, hash {self.fingerprint()[:12]}"

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the tokenizer to ``directory`` so :func:`load_tokenizer` can read it."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is ``<eos>``, 257 is ``<pad>``."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_id(self) -> int:
        return 256

    @property
    def pad_id(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_piece(self, token_id: int) -> bytes | str:
        if not 0 <= token_id < 258:
            raise ValueError(f"token id {token_id} is outside the byte vocabulary 0..257")
        return bytes([token_id]) if token_id < 256 else (EOS_TOKEN, PAD_TOKEN)[token_id - 256]

    def canonical_description(self) -> str:
        return "byte-v1"

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps({"type": "byte"}) + "\n")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer(Tokenizer):
    """Byte-level BPE (HF ``tokenizers``) with ``<eos>`` and ``<pad>`` special tokens.

    A tokenizer made elsewhere may name its end-of-document and padding tokens differently: pass
    their names as ``eos_token``/``pad_token``, and ``bos_token`` when its model saw a beginning-of-text
    token at the start of every document (``save`` records them in tokenizer_config.json).
    """

    name = "bpe"

    def __init__(
        self, backend: HFTokenizer, eos_token: str = EOS_TOKEN, pad_token: str = PAD_TOKEN, bos_token: str | None = None
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; prefer :meth:`train` or :meth:`from_file`."""
        named = (eos_token, pad_token) + ((bos_token,) if bos_token is not None else ())
        missing = [t for t in dict.fromkeys(named) if backend.token_to_id(t) is None]
        if missing:
            raise UserError(
                f"BPE tokenizer lacks required special token(s) {missing}; "
                f"it must define {' and '.join(map(repr, dict.fromkeys(named)))}"
            )
        self._names = (eos_token, pad_token)
        self._bos_name = bos_token
        self._bos = None if bos_token is None else int(backend.token_to_id(bos_token))
        # looplm packs whole documents itself: a file saved with truncation or padding on would cut each
        # document at its max_length and pad short ones with supervised pad ids
        backend.no_truncation()
        backend.no_padding()
        # Serialise before changing runtime flags so the fingerprint is the file content (as looplm reads it).
        self._json: str = backend.to_str()
        # A tokenizer made elsewhere may add its end/padding/BOS tokens as ordinary ones: they are special
        # here all the same (same ids), so that their names in text stay text and `decode` skips them.
        ordinary = [t for t in backend.get_added_tokens_decoder().values() if t.content in named and not t.special]
        self._promoted = sorted(t.content for t in ordinary)  # in the fingerprint: they encode unlike the file says
        if ordinary:
            keep = ("single_word", "lstrip", "rstrip", "normalized")
            backend.add_special_tokens(
                [AddedToken(t.content, special=True, **{k: getattr(t, k) for k in keep}) for t in ordinary]
            )
        # Literal "<eos>" in corpus text must stay text, never become the special id.
        backend.encode_special_tokens = True
        self._tok = backend
        self._eos = int(backend.token_to_id(eos_token))
        self._pad = int(backend.token_to_id(pad_token))
        self._vocab = int(backend.get_vocab_size(with_added_tokens=True))
        self._added = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
        # Byte-level BPE (GPT-2's alphabet) spells each byte as one character; checked on a probe
        # rather than read from the decoder, which a foreign tokenizer may wrap in a sequence.
        probe = " héllo wörld 日本 🙂"
        pieces = [backend.id_to_token(i) for i in backend.encode(probe, add_special_tokens=False).ids]
        self._byte_level = (
            all(c in BYTE_LEVEL for p in pieces for c in p)
            and b"".join(bytes(BYTE_LEVEL[c] for c in p) for p in pieces) == probe.encode()
        )

    def __reduce__(self):
        # rebuilt through __init__: `encode_special_tokens` is a runtime flag of the backend that
        # pickling (a broadcast to other ranks, a deepcopy) does not carry
        return (_rebuild_bpe, (self._json, *self._names, self._bos_name))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train a byte-level BPE of (at most) ``vocab_size`` ids in memory."""
        if vocab_size < 258:
            raise UserError(f"BPE vocab_size must be >= 258 (256 bytes + 2 specials), got {vocab_size}")
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN, PAD_TOKEN],
            # Full byte alphabet so any text is encodable, even bytes unseen in training.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    @classmethod
    def from_file(
        cls, path: str | Path, eos_token: str = EOS_TOKEN, pad_token: str = PAD_TOKEN, bos_token: str | None = None
    ) -> BPETokenizer:
        """Load a ``tokenizer.json``; it must define ``eos_token`` and ``pad_token`` (default ``<eos>``, ``<pad>``)
        and ``bos_token`` when given."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"tokenizer file not found: {path}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise UserError(f"cannot read tokenizer file {path}: {exc}") from exc
        try:
            return cls(backend, eos_token, pad_token, bos_token)
        except ValueError as exc:
            raise UserError(f"{path}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def bos_token(self) -> str | None:
        return self._bos_name

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def token_piece(self, token_id: int) -> bytes | str:
        if token_id in self._added:
            content, special = self._added[token_id]
            return content if special or token_id in (self._eos, self._pad) else content.encode()
        name = self._tok.id_to_token(token_id)
        if name is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{self._vocab - 1}")
        if self._byte_level:
            return bytes(BYTE_LEVEL[c] for c in name)
        if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):  # a byte-fallback piece
            return bytes([int(name[3:5], 16)])
        alone = self.decode([token_id])
        context = self._piece_context()
        if context is None:
            return alone.encode()
        # decoded after an ordinary token, as in running text: a SentencePiece `▁word` adds " word"
        # (decoded alone, the decoder strips a text's first space); what the context's text leaves
        before, after = self.decode(context), self.decode([*context, token_id])
        return (after[len(before) :] if after.startswith(before) else alone).encode()

    def _piece_context(self) -> list[int] | None:
        """The ids of a short ordinary text that `token_piece` decodes a token after (None: none found)."""
        if not hasattr(self, "_context"):  # found once, on first use
            self._context = next(
                (
                    ids
                    for ids in map(self.encode, ("a", "e", "x", "0", "."))
                    if ids
                    and not any(i in self._added for i in ids)
                    and (text := self.decode(ids))
                    and "\ufffd" not in text
                ),
                None,
            )
        return self._context

    @property
    def backend_json(self) -> str:
        """The ``tokenizer.json`` content of the wrapped HF tokenizer."""
        return self._json

    def _special_names(self) -> dict:
        """The eos/pad (and bos) names when they are not looplm's own (empty otherwise, keeping old fingerprints)."""
        if self._names == (EOS_TOKEN, PAD_TOKEN) and self._bos_name is None:
            return {}
        bos = {"bos_token": self._bos_name} if self._bos_name is not None else {}
        return {"eos_token": self._names[0], "pad_token": self._names[1], **bos}

    def canonical_description(self) -> str:
        """The file content, the eos/pad/bos names unless they are looplm's own, and the named tokens the file
        adds as ordinary ones: they are special here, so their names in text encode as text, as they did not
        before looplm made them special; caches keyed by the content alone are not reused for them."""
        names = self._special_names()
        if self._promoted:
            names = {**names, "made_special": self._promoted}
        return self._json + ("\n" + json.dumps(names, sort_keys=True) if names else "")

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / BPE_FILE).write_text(self._json)
        (directory / CONFIG_FILE).write_text(json.dumps({"type": "bpe", **self._special_names()}) + "\n")

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self._vocab})"


def _name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def bos_policy(backend: HFTokenizer, config: dict, special_tokens: dict | None = None) -> str | None:
    """The beginning-of-text token a released tokenizer puts before every text it encodes with its special
    tokens (how its model saw documents start), or None. `config` is its tokenizer_config.json and
    `special_tokens` its special_tokens_map.json: an explicit `add_bos_token` decides (naming `bos_token`);
    otherwise the tokenizer's own post-processor is asked, by encoding a probe with and without special tokens."""
    add = config.get("add_bos_token")
    if isinstance(add, bool):
        if not add:
            return None
        name = _name(config.get("bos_token")) or _name((special_tokens or {}).get("bos_token"))
        if name is None or backend.token_to_id(name) is None:
            raise UserError(f"the tokenizer sets add_bos_token but its bos_token {name!r} is not one of its tokens")
        return name
    probe = "looplm probe"
    plain = backend.encode(probe, add_special_tokens=False).ids
    full = backend.encode(probe, add_special_tokens=True).ids
    # "<s> $A" and "<s> $A </s>" alike: one token before the text (what follows it is not a BOS)
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return backend.id_to_token(full[0])
    return None


def _rebuild_bpe(json_text: str, eos_token: str, pad_token: str, bos_token: str | None) -> BPETokenizer:
    return BPETokenizer(HFTokenizer.from_str(json_text), eos_token, pad_token, bos_token)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load a tokenizer written by :meth:`Tokenizer.save`."""
    directory = Path(directory)
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        # A bare tokenizer.json (e.g. from another tool) is still loadable.
        if (directory / BPE_FILE).is_file():
            return BPETokenizer.from_file(directory / BPE_FILE)
        raise UserError(f"no {CONFIG_FILE} or {BPE_FILE} in {directory}")
    cfg = json.loads(cfg_path.read_text())
    kind = cfg.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":  # no bos_token: none (also every tokenizer saved before BOS policies were recorded)
        names = cfg.get("eos_token", EOS_TOKEN), cfg.get("pad_token", PAD_TOKEN), cfg.get("bos_token")
        return BPETokenizer.from_file(directory / BPE_FILE, *names)
    raise UserError(f"{cfg_path}: unknown tokenizer type {kind!r} (expected 'byte' or 'bpe')")


def build_tokenizer(
    spec: str,
    corpus_texts: Callable[[], Iterable[str]] | None,
    vocab_size: int,
) -> Tokenizer:
    """Make a tokenizer from ``spec``: ``"byte"``, ``"bpe"`` (trained on ``corpus_texts()``),
    a path to a ``tokenizer.json``, or a directory written by :meth:`Tokenizer.save`."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if corpus_texts is None:
            raise UserError("tokenizer 'bpe' needs a corpus to train on")
        return BPETokenizer.train(corpus_texts(), vocab_size)
    path = Path(spec)
    if path.is_dir():
        return load_tokenizer(path)
    if path.is_file():
        return BPETokenizer.from_file(path)
    raise UserError(f"unknown tokenizer spec {spec!r}: expected 'byte', 'bpe' or a path to a tokenizer.json")
