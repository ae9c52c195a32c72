"""What a reference run writes: the metrics log (``metrics.jsonl``, :class:`MetricsLog`), and at the end
``model.pt``, ``loss_curve.png`` and ``summary.json`` (:func:`write_outputs`); :func:`weights_digest`
fingerprints the weights for the summary."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig


class MetricsLog:
    """Metric rows, kept on every rank; rank 0 also appends them to ``metrics.jsonl`` as they come.
    A resumed run starts from the checkpoint's rows: the file is rewritten with those (dropping rows
    logged after the checkpoint, which the resumed run logs again) and continues from there."""

    def __init__(self, path: Path | None, rows: Sequence[dict[str, Any]] = ()) -> None:
        self.rows: list[dict[str, Any]] = []
        self._file = open(path, "w") if path is not None else None
        for row in rows:
            self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha1 over the exact bytes of every tensor of a state dict (replicas must agree bit for bit)."""
    h = hashlib.sha1()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def plot_losses(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # object API + Agg canvas: no pyplot, no global backend

    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.subplots()
    train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def write_outputs(cfg: TrainConfig, summary: dict[str, Any], full: dict[str, torch.Tensor],
                  rows: list[dict[str, Any]]) -> None:  # fmt: skip
    """Rank 0's outputs: model.pt (with save_model), loss_curve.png, summary.json, and the final losses."""
    out_dir = Path(cfg.out_dir)
    if cfg.save_model:
        torch.save(full, out_dir / "model.pt")
    label = summary["preset"] or cfg.optimizer
    title = f"{cfg.model.get('size', 'tiny')} / {label} / world {summary['world_size']}"
    plot_losses(rows, out_dir / "loss_curve.png", title)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("initial_val_loss", "final_val_loss", "final_train_loss", "time_s")}))
