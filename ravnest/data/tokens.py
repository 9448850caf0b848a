"""Tokenized corpora: `ravnest data prepare` turns text into one token file that a volunteer offers
(`ravnest-node join --dataset NAME=FILE`) and a job trains on (dataset `tokens`).

The file is self-describing, so offering it, proving it is held and reading it need nothing beside it:

    b"RAVNTOK1"  8 bytes
    header size  8 bytes, little-endian
    header       JSON: dtype (uint16 or uint32), tokens, vocab_size, eos_id, documents (each one's first
                 token), tokenizer (its tokenizer.json, as text) and tokenizer_sha256
    padding      to a multiple of 8 bytes
    token ids    `tokens` of `dtype`, little-endian; documents one after another, each ended by eos_id

Training reads windows of it on demand (datasets.Windows): a node's memory does not grow with the
corpus. Sequences are packed across document ends (the end-of-text token between them tells the
model where one ends), the file's tail is the held-out set, replicas take interleaved shares.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ravnest.errors import RavnestError

MAGIC = b"RAVNTOK1"
EOS = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".parquet")


class TokenFileError(RavnestError, ValueError):
    """Not a token file, or one that cannot be made from these inputs; the message says why."""


@dataclass(frozen=True)
class Header:
    dtype: np.dtype
    tokens: int
    vocab_size: int
    eos_id: int
    documents: list[int]
    tokenizer: str
    tokenizer_sha256: str
    offset: int  # where the token ids start, in bytes


def read_header(path: str | os.PathLike, label: str | None = None) -> Header:
    """The file's header; `label` names the file in errors (a node says "dataset 'corpus'", not its path)."""
    name = label or str(path)
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise TokenFileError(f"{name} is not a token file (make one with `ravnest data prepare`)")
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 64 << 20:
            raise TokenFileError(f"{name}: its header claims {size} bytes")
        try:
            meta = json.loads(f.read(size))
            header = Header(np.dtype(meta["dtype"]).newbyteorder("<"), int(meta["tokens"]), int(meta["vocab_size"]),
                            int(meta["eos_id"]), list(meta["documents"]), str(meta["tokenizer"]),
                            str(meta["tokenizer_sha256"]), _aligned(16 + size))
        except (ValueError, KeyError, TypeError) as e:
            raise TokenFileError(f"{name}: unreadable header ({type(e).__name__}: {e})") from None
    if header.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
        raise TokenFileError(f"{name}: token ids of {header.dtype} (uint16 or uint32 expected)")
    if os.path.getsize(path) < header.offset + header.tokens * header.dtype.itemsize:
        raise TokenFileError(f"{name} is shorter than its header says: was it cut off?")
    return header


def vocab_size_of(path: str | os.PathLike) -> int | None:
    """A token file's vocabulary (its header's vocab_size); None for any other file, or an unreadable one."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
        return read_header(path).vocab_size
    except (OSError, TokenFileError):
        return None


def tokenizer_json(path: str | os.PathLike) -> str:
    """The tokenizer (Hugging Face tokenizer.json text) in a token file's header, or in a tokenizer.json."""
    with open(path, "rb") as f:
        is_token_file = f.read(len(MAGIC)) == MAGIC
    return read_header(path).tokenizer if is_token_file else Path(path).read_text()


def _aligned(size: int) -> int:
    return (size + 7) // 8 * 8


def documents_of(inputs: Iterable[Path], pattern: str | None = None) -> Iterator[str]:
    """Each document's text: a text file is one; a JSONL file's lines and a Parquet file's rows are one
    each (their "text" field). Folders are walked in name order, keeping `pattern` (a glob) or the
    text suffixes."""
    for source in inputs:
        if source.is_dir():
            found = sorted(p for p in source.rglob(pattern or "*") if p.is_file()
                           and (pattern is not None or p.suffix in TEXT_SUFFIXES))
            yield from documents_of(found)
        elif source.suffix == ".jsonl":
            with source.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (ValueError, KeyError, TypeError):
                            raise TokenFileError(f"{source}:{number}: expected a JSON object with a "
                                                 f"\"text\" field") from None
        elif source.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise TokenFileError(f"{source}: reading Parquet needs pyarrow (pip install pyarrow)") from None
            for batch in pq.ParquetFile(source).iter_batches(columns=["text"]):
                yield from (text for text in batch.column(0).to_pylist() if text)
        elif source.is_file():
            yield source.read_text(encoding="utf-8", errors="replace")
        else:
            raise TokenFileError(f"{source}: no such file or folder")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (any text encodes, no unknown token) with the end-of-text token as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def prepare(inputs: list[Path], output: Path, *, tokenizer_file: Path | None = None, vocab_size: int = 4096,
            pattern: str | None = None, batch: int = 256) -> Header:
    """Tokenize `inputs` into the token file `output`, with the tokenizer in `tokenizer_file` (a
    Hugging Face tokenizer.json) or one trained here on the same documents."""
    from tokenizers import Tokenizer

    if tokenizer_file is not None:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    else:
        tokenizer = train_tokenizer(documents_of(inputs, pattern), vocab_size)
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise TokenFileError(f"the tokenizer has no {EOS} token to end documents with")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype("<u2") if size <= 1 << 16 else np.dtype("<u4")
    documents, count = [], 0
    with tempfile.TemporaryFile(dir=output.parent) as body:
        pending: list[str] = []

        def flush() -> None:
            nonlocal count
            for encoding in tokenizer.encode_batch(pending):
                documents.append(count)
                ids = np.asarray([*encoding.ids, eos], dtype=dtype)
                body.write(ids.tobytes())
                count += len(ids)
            pending.clear()

        for text in documents_of(inputs, pattern):
            pending.append(text)
            if len(pending) == batch:
                flush()
        flush()
        if count == 0:
            raise TokenFileError(f"no text found in {', '.join(map(str, inputs))}")
        serialized = tokenizer.to_str()
        body.seek(0)
        return write_token_file(output, body, dtype=dtype, tokens=count, vocab_size=size, eos_id=eos,
                                documents=documents, tokenizer=serialized)


def write_token_file(output: Path, body: BinaryIO, *, dtype: np.dtype, tokens: int, vocab_size: int, eos_id: int,
                     documents: list[int], tokenizer: str) -> Header:
    """The header, then `body`'s token ids copied after it; the file appears whole or not at all."""
    meta = json.dumps({"dtype": dtype.name, "tokens": tokens, "vocab_size": vocab_size, "eos_id": eos_id,
                       "documents": documents, "tokenizer": tokenizer,
                       "tokenizer_sha256": hashlib.sha256(tokenizer.encode()).hexdigest()}).encode()
    partial = output.with_name(output.name + ".part")
    with partial.open("wb") as out:
        out.write(MAGIC + len(meta).to_bytes(8, "little") + meta)
        out.write(bytes(_aligned(16 + len(meta)) - 16 - len(meta)))
        shutil.copyfileobj(body, out, 1 << 20)
    partial.replace(output)
    return read_header(output)
