"""Text from a trained language model: sampling with temperature and top-k, and the tokenizer a job's
data was made with (the token file's, or bytes for the `text` dataset)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, ids: list[int], *, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int | None = 50, context: int | None = None, seed: int | None = None) -> list[int]:
    """`ids` continued by `max_new_tokens` sampled tokens. Each step feeds the last `context` tokens
    (the model's longest sequence) and samples from softmax(logits / temperature), restricted to the
    `top_k` likeliest; temperature 0 takes the likeliest."""
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = list(ids)
    model.eval()
    for _ in range(max_new_tokens):
        window = torch.tensor([tokens[-context:] if context else tokens])
        logits = model(window)[0, -1].float()
        if temperature <= 0:
            tokens.append(int(logits.argmax()))
            continue
        if top_k is not None and top_k < logits.numel():
            threshold = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        tokens.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)))
    return tokens


class ByteTokenizer:
    """The `text` dataset's: a token is a byte of the UTF-8 text."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class FileTokenizer:
    """A Hugging Face tokenizer from a tokenizer.json, or from the header of a token file
    (`ravnest data prepare`); or, with `text`, from a tokenizer.json's text (one a job recorded)."""

    def __init__(self, path: str | Path | None = None, *, text: str | None = None):
        from tokenizers import Tokenizer

        from ravnest.data.tokens import tokenizer_json
        if text is None:
            if path is None:
                raise ValueError("FileTokenizer needs a path or a tokenizer.json's text")
            text = tokenizer_json(path)
        self.tokenizer = Tokenizer.from_str(text)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
