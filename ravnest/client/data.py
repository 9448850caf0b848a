"""`ravnest data prepare`: text, JSONL or Parquet into a token file that volunteers offer
(ravnest/data/tokens.py). Runs where the text is; talks to no coordinator."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ravnest.client.typer_app import app, err

data = typer.Typer(help="Datasets: prepare a token file from text.", no_args_is_help=True)
app.add_typer(data, name="data")


@data.command("prepare")
def prepare(inputs: list[Path] = typer.Argument(..., help="text files, .jsonl or .parquet files (their \"text\" "
                                                          "field), or folders of them"),
            output: Path = typer.Option(..., "-o", "--output", help="the token file to write"),
            tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="a Hugging Face tokenizer.json "
                                                     "(default: train a byte-level BPE on the inputs)"),
            vocab_size: int = typer.Option(4096, "--vocab-size", min=260, max=1 << 20,
                                           help="for the trained tokenizer"),
            pattern: Optional[str] = typer.Option(None, "--glob", help="in folders, only files matching this "
                                                  "(e.g. '*.py'); default: .txt .md .py .rst .jsonl .parquet")
            ) -> None:
    """Tokenize INPUTS into one file; offer it with `ravnest-node join --dataset NAME=FILE` and train on it
    with a job's dataset {"name": "tokens", "source": NAME}."""
    from ravnest.data.tokens import TokenFileError
    from ravnest.data.tokens import prepare as make

    try:
        header = make(inputs, output, tokenizer_file=tokenizer, vocab_size=vocab_size, pattern=pattern)
    except (TokenFileError, OSError) as e:
        err.print(f"ravnest: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(f"wrote {output}: {header.tokens:,} tokens of {len(header.documents):,} documents, vocabulary "
              f"{header.vocab_size:,} ({header.dtype.name}); model vocab_size must be at least {header.vocab_size}",
              highlight=False)

