"""The start-up summary: which parameters SWAN whitens and which get the fallback rule, and why; the
warning (or, with ``strict``, the error) where SWAN would whiten what it cannot name; :func:`log_info`,
which writes the summary (and other one-off notices) to the ``swan_dist`` logger; and the per-step
:class:`StepRecord` (``SWAN.last_step``) a training loop can log."""

from __future__ import annotations

import logging
import warnings
from collections import Counter, defaultdict
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .functional import resolve_dtype
from .rules import whiten_config
from .selection import Rule, collapse_name

__all__ = ["LOGGER", "SummaryRow", "StepRecord", "StepLog", "log_info", "summary_text", "warn_unnamed"]

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


def _value(option) -> object:
    """An option as the summary shows it: a tensor's value (``capturable=True``; read when the summary is made)."""
    return float(option) if isinstance(option, torch.Tensor) else option


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
                f"grad_norm={g['grad_norm']} {where}, lr={_value(g['lr'])} x alpha={_value(g['alpha'])}"
            )
    head += [f"  {rule}: {n:,} parameters" for rule, n in sorted(numel.items())]
    width = max((len(k[1]) for k in rows), default=10)
    body = [
        f"  {r:<16} {n:<{width}} x{c:<3} {str(list(s)):<14} {why}"
        for (r, n, s, why), c in sorted(rows.items(), key=lambda kv: (kv[0][0] != "SWAN", kv[0][1]))
    ]
    return "\n".join(head + body)


def warn_unnamed(rows: list[SummaryRow], strict: bool, model_given: bool = False) -> None:
    """No silent whitening of what SWAN cannot name, nor a model with nothing whitened: decided from
    shapes and names every rank sees alike, before any collective. ``model_given``: SWAN was given
    ``model=`` (then unnamed tensors are not that model's parameters)."""
    unnamed = [r.name for r in rows if r.rule.use_swan and r.rule.reason.startswith("2-D tensor, name unknown")]
    chosen = ("param group", "matches exclude", "matches include")  # the user's own choice: no warning
    matrices = [r for r in rows if len(r.shape) == 2 and not r.rule.reason.startswith(chosen)]
    msg = None
    if unnamed and model_given:
        msg = (f"swan_dist.SWAN was given {len(unnamed)} 2-D tensors without names (e.g. {unnamed[:3]}) that are not "
               "parameters of the model given as model=, and whitens them all, as if none were an embedding or an "
               "output head. Pass the model these parameters belong to as model=, or SWAN(model), or "
               "model.named_parameters()")
    elif unnamed:
        msg = (f"swan_dist.SWAN was given {len(unnamed)} 2-D tensors without names (e.g. {unnamed[:3]}) and whitens "
               "them all, embeddings and output head included. Pass the model they belong to as model= "
               "(SWAN(param_groups, model=model): embeddings and head then take the fallback rule), or SWAN(model), "
               "or model.named_parameters(), or call swan_dist.tag_model(model) first")
    elif matrices and not any(r.rule.use_swan for r in matrices):
        msg = (f"swan_dist.SWAN whitens none of the {len(matrices)} 2-D tensors it was given (e.g. "
               f"{[(r.name, list(r.shape), r.rule.reason) for r in matrices[:3]]}); pass the model that owns them, SWAN(model)")
    if msg is None:
        return
    if strict:
        raise ValueError(msg + " (strict=True)")
    warnings.warn(msg + "; strict=True makes this an error", UserWarning, stacklevel=3)


class StepRecord(NamedTuple):
    """What the last ``SWAN.step()`` did, for a logger (``SWAN.last_step``; ``record._asdict()`` is a plain
    dict). Every field is known on the host without reading a tensor, except the names, which in one
    process arrive with the step's counts (reading the record waits for them)."""

    step: int  # step() calls so far, this one included
    whitened: int  # matrices this rank whitened in it (updates made during backward included; one then
    # skipped for NaN/Inf counts: the decision is made on the device, after the work)
    skipped: tuple[str, ...]  # parameters left untouched for a NaN/Inf gradient
    nonfinite: tuple[str, ...]  # matrices whose whitened update came out non-finite (not applied)
    update_rms: float | None  # RMS of each applied matrix update: lr x alpha (over several SWAN groups, their
    # mean weighted by their matrices); None where SWAN holds no matrix
    fallback_lr: tuple[float, ...]  # the lr of each fallback group, in param_groups order


class StepLog:
    """One optimizer step's engine steps (``step()``'s own, and with ``step_in_backward`` those made during
    backward), gathered without reading the device: the matrices whitened, the names already known, and
    the one-process reports whose names arrive later (each resolved by ``SWAN.poll_reports``, which leaves
    its names in ``report.outcome``)."""

    def __init__(self) -> None:
        self.whitened = 0
        self.skipped: list[str] = []
        self.nonfinite: list[str] = []
        self.reports: list = []

    def add(self, whitened: int, skipped: Sequence[str] = (), nonfinite: Sequence[str] = (), report=None) -> None:
        self.whitened += whitened
        self.skipped += skipped
        self.nonfinite += nonfinite
        if report is not None:
            self.reports.append(report)

    def pending(self) -> bool:
        """Some report's names have not reached the host yet."""
        return any(not hasattr(r, "outcome") for r in self.reports)

    def record(self, step: int, rates: Sequence[tuple[object, object, int, bool]]) -> StepRecord:
        """The :class:`StepRecord` of step ``step``, every report resolved; ``rates``: per param group its
        (lr, alpha, SWAN matrices, use_swan) as they were when the step ran."""
        skipped, nonfinite = list(self.skipped), list(self.nonfinite)
        for r in self.reports:
            skipped += r.outcome[0]
            nonfinite += r.outcome[1]
        swan = [(float(lr) * float(alpha), n) for lr, alpha, n, _ in rates if n]
        total = sum(n for _, n in swan)
        update_rms = sum(v * n for v, n in swan) / total if total else None
        if update_rms is not None and len({v for v, _ in swan}) == 1:
            update_rms = swan[0][0]  # exactly lr x alpha, not a sum divided back
        return StepRecord(step, self.whitened, tuple(dict.fromkeys(skipped)), tuple(dict.fromkeys(nonfinite)),
                          update_rms, tuple(float(lr) for lr, _, _, use_swan in rates if not use_swan))
