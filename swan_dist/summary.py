"""The start-up summary: which parameters SWAN whitens and which get the fallback rule, and why; the
warning (or, with ``strict``, the error) where SWAN would whiten what it cannot name; and :func:`log_info`,
which writes the summary (and other one-off notices) to the ``swan_dist`` logger."""

from __future__ import annotations

import logging
import warnings
from collections import Counter, defaultdict
from typing import NamedTuple

import torch
from torch import Tensor

from .functional import resolve_dtype
from .rules import whiten_config
from .selection import Rule, collapse_name

__all__ = ["LOGGER", "SummaryRow", "log_info", "summary_text", "warn_unnamed"]

# The package's logger. Its level starts at INFO (unless set before swan_dist was imported), so the
# start-up summary shows where a program configured logging at WARNING (``logging.basicConfig()``) as it
# did when it was printed; ``logging.getLogger("swan_dist").setLevel(logging.WARNING)`` silences it.
LOGGER = logging.getLogger("swan_dist")
if LOGGER.level == logging.NOTSET:
    LOGGER.setLevel(logging.INFO)


def log_info(text: str) -> None:
    """``text`` at INFO on the ``swan_dist`` logger; where no handler would receive it (a program that never
    configured logging: no handler on the logger, its parents or the root), printed to stdout instead, as
    the start-up summary always was."""
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    if LOGGER.hasHandlers():
        LOGGER.info(text)
    else:
        print(text, flush=True)


class SummaryRow(NamedTuple):
    """One logical parameter in the start-up summary."""

    name: str
    shape: tuple[int, ...]
    rule_name: str  # "SWAN" or "fallback:<rule>"
    rule: Rule


def summary_text(preset: str | None, rows_in: list[SummaryRow], param_groups: list[dict],
                 packed: dict[Tensor, tuple[bool, ...]]) -> str:
    """Which parameters get SWAN and which the fallback rule, and why (layers collapsed to ``*``)."""
    rows: Counter = Counter()
    numel: defaultdict = defaultdict(int)
    for name, shape, rule_name, rule in rows_in:
        key = (rule_name, collapse_name(name), shape, rule.reason)
        rows[key] += 1
        numel[rule_name] += int(torch.Size(shape).numel())
    n_swan = sum(c for k, c in rows.items() if k[0] == "SWAN")
    head = [
        f"swan_dist.SWAN (preset={preset}): {n_swan} matrices whitened by SWAN, "
        f"{len(rows_in) - n_swan} tensors on the fallback rule",
    ]
    for g in param_groups:
        if g["use_swan"] or any(any(packed.get(p, ())) for p in g["params"]):
            if g["params"]:
                dev = g["params"][0].device
                where = f"dtype={str(resolve_dtype(whiten_config(g), dev)).replace('torch.', '')} on {dev.type}"
            else:  # DeepSpeed ZeRO-3 empties the groups it partitions: the device is not known here
                where = f"dtype={g['whiten_dtype']} (parameters partitioned by the framework)"
            head.append(
                f"  SWAN group: {g['whitening']} steps={g['ns_steps']} beta={g['beta']} "
                f"grad_norm={g['grad_norm']} {where}, lr={g['lr']} x alpha={g['alpha']}"
            )
    head += [f"  {rule}: {n:,} parameters" for rule, n in sorted(numel.items())]
    width = max((len(k[1]) for k in rows), default=10)
    body = [
        f"  {r:<16} {n:<{width}} x{c:<3} {str(list(s)):<14} {why}"
        for (r, n, s, why), c in sorted(rows.items(), key=lambda kv: (kv[0][0] != "SWAN", kv[0][1]))
    ]
    return "\n".join(head + body)


def warn_unnamed(rows: list[SummaryRow], strict: bool) -> None:
    """No silent whitening of what SWAN cannot name, nor a model with nothing whitened: decided from
    shapes and names every rank sees alike, before any collective."""
    unnamed = [r.name for r in rows if r.rule.use_swan and r.rule.reason.startswith("2-D tensor, name unknown")]
    chosen = ("param group", "matches exclude", "matches include")  # the user's own choice: no warning
    matrices = [r for r in rows if len(r.shape) == 2 and not r.rule.reason.startswith(chosen)]
    msg = None
    if unnamed:
        msg = (f"swan_dist.SWAN was given {len(unnamed)} 2-D tensors without names (e.g. {unnamed[:3]}) and whitens "
               "them all, embeddings and output head included. Pass the model, SWAN(model), or "
               "model.named_parameters(), or call swan_dist.tag_model(model) first")
    elif matrices and not any(r.rule.use_swan for r in matrices):
        msg = (f"swan_dist.SWAN whitens none of the {len(matrices)} 2-D tensors it was given (e.g. "
               f"{[(r.name, list(r.shape), r.rule.reason) for r in matrices[:3]]}); pass the model that owns them, SWAN(model)")
    if msg is None:
        return
    if strict:
        raise ValueError(msg + " (strict=True)")
    warnings.warn(msg + "; strict=True makes this an error", UserWarning, stacklevel=3)

