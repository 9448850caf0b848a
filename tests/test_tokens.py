"""Token files: `ravnest data prepare` on text already on this machine (the standard library's source),
read back on demand by the `tokens` dataset, with the tokenizer inside."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ravnest.data import DatasetError, load_dataset
from ravnest.data.tokens import EOS, read_header

STDLIB = Path(json.__file__).parent  # the json package's source: a few real documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "json.tokens"
    done = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "data", "prepare", str(STDLIB),
                           "--glob", "*.py", "--vocab-size", "512", "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stderr and "model vocab_size must be at least 512" in done.stderr
    return out


def test_prepare_writes_the_corpus_its_documents_and_its_tokenizer(corpus):
    from tokenizers import Tokenizer

    header = read_header(corpus)
    files = sorted(STDLIB.rglob("*.py"))
    assert header.vocab_size == 512 and header.dtype.name == "uint16" and len(header.documents) == len(files)
    tokenizer = Tokenizer.from_str(header.tokenizer)
    assert tokenizer.token_to_id(EOS) == header.eos_id
    data = load_dataset({"name": "tokens", "source": "c", "seq_len": 64, "test_fraction": 0.1}, {"c": str(corpus)})
    assert data.vocab_size == 512
    x = data.train_x.read()
    assert torch.equal(x[:, 1:], data.train_y.read()[:, :-1])
    first = files[0].read_text()
    assert tokenizer.decode(x[0].tolist()) == first[:len(tokenizer.decode(x[0].tolist()))]  # the first file's start
    ids = torch.cat([x.flatten(), data.test_x.read().flatten()])
    assert int((ids == header.eos_id).sum()) >= len(files) - 2  # documents end with it (a few may be in gaps)


def test_jsonl_documents_and_a_given_tokenizer(corpus, tmp_path):
    from tokenizers import Tokenizer

    (tmp_path / "tokenizer.json").write_text(read_header(corpus).tokenizer)
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(50)))
    out = tmp_path / "docs.tokens"
    from ravnest.data.tokens import prepare
    header = prepare([lines], out, tokenizer_file=tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert len(header.documents) == 50 and header.tokenizer_sha256 == read_header(corpus).tokenizer_sha256
    assert header.tokens == sum(len(tokenizer.encode(json.loads(line)["text"]).ids) + 1
                                for line in lines.read_text().splitlines())


def test_files_that_are_not_token_files_say_so_without_their_path(tmp_path):
    bad = tmp_path / "secret-name.bin"
    bad.write_bytes(b"not a token file at all" * 10)
    with pytest.raises(DatasetError, match="dataset 'c' is not a token file") as refused:
        load_dataset({"name": "tokens", "source": "c"}, {"c": str(bad)})
    assert "secret-name" not in str(refused.value)
    bad.write_bytes(b"RAVNTOK1" + (10).to_bytes(8, "little") + b"{not json}")
    with pytest.raises(DatasetError, match="unreadable header"):
        load_dataset({"name": "tokens", "source": "c"}, {"c": str(bad)})


def test_a_nodes_memory_does_not_grow_with_the_corpus(corpus, tmp_path):
    """Batches from a 256 MiB token file and from the small one: the process's anonymous memory is the
    same (the file's pages stay in the page cache, not in the process; int64 in memory was 1 GiB)."""
    import numpy as np

    from ravnest.data.tokens import write_token_file

    script = """
import itertools, sys
from ravnest.data import load_dataset
data = load_dataset({"name": "tokens", "source": "c", "seq_len": 256, "test_fraction": 0.05}, {"c": sys.argv[1]})
for x, y in itertools.islice(data.shard(0, 2).batches(16, seed=0), 300):
    assert x.shape == (16, 256)
for x, y in data.test_batches(64):
    pass
print([int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")][0])
"""
    header = read_header(corpus)
    with (tmp_path / "body").open("w+b") as body:
        chunk = np.random.default_rng(0).integers(0, header.vocab_size, 1 << 24, dtype=np.uint16).tobytes()
        for _ in range(8):
            body.write(chunk)
        body.seek(0)
        write_token_file(tmp_path / "big.tokens", body, dtype=header.dtype, tokens=8 << 24,
                         vocab_size=header.vocab_size, eos_id=header.eos_id, documents=[0], tokenizer=header.tokenizer)
    rss = {}
    for path in (corpus, tmp_path / "big.tokens"):
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        assert done.returncode == 0, done.stderr
        rss[path.name] = int(done.stdout.strip())
    print(f"\nRssAnon after 300 batches: {rss} KiB")
    assert rss["big.tokens"] <= 1.1 * rss[corpus.name], rss


def test_a_node_tells_the_coordinator_each_offered_token_files_vocabulary(corpus, tmp_path):
    """What the coordinator checks a job's vocab_size against (coordinator/service/offers.py)."""
    from node.offered_files import Offers
    from node.progress import Progress
    from ravnest.data.tokens import vocab_size_of

    text = tmp_path / "plain.txt"
    text.write_text("not a token file")
    offers = Offers({"corpus": corpus, "plain": text}, Progress())
    assert offers.vocabularies() == {"corpus": read_header(corpus).vocab_size}
    assert vocab_size_of(tmp_path / "missing") is None
