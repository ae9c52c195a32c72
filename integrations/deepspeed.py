"""DeepSpeed: ``"optimizer": {"type": "SWAN", "params": {...}}`` in the JSON config.

DeepSpeed resolves an unknown optimizer type as ``getattr(torch.optim, type)(model_parameters,
**params)``, so ``import swan_dist`` makes ``torch.optim.SWAN`` exist, and ZeRO's list of tested
optimizers gets SWAN appended when a SWAN is built with DeepSpeed loaded (no
``zero_allow_untested_optimizer`` needed).

Where the pieces live (ZeRO-1/2, and bf16 at any stage): DeepSpeed replaces each param group's
parameters by one flat fp32 partition of the group; every original (low-precision) parameter ``lp``
links to its part of it through ``lp._hp_mapping`` (``None`` where this rank holds none of it):
``lp_fragment_address`` is the contiguous range of the flattened parameter, ``hp_fragment_address``
where it sits in the partition. SWAN splits its groups into SWAN and fallback groups, so a SWAN
group's partition holds matrices only; the fallback rule runs elementwise on the fallback partition.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from swan_dist.routing import Piece


def register_type(cls: type) -> None:
    """Make ``"type": "SWAN"`` resolve (DeepSpeed looks the name up in ``torch.optim``)."""
    if getattr(torch.optim, cls.__name__, None) is not cls:
        setattr(torch.optim, cls.__name__, cls)


def allow_in_zero(cls: type) -> None:
    """Add ``cls`` to ZeRO's supported optimizers, if DeepSpeed is loaded."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed.runtime.zero import utils

    if cls not in utils.ZERO_SUPPORTED_OPTIMIZERS:
        utils.ZERO_SUPPORTED_OPTIMIZERS.append(cls)


def refuse_zero3(originals: list[tuple[str, Tensor]]) -> None:
    """ZeRO-3 partitions each parameter alone (``ds_id``, ``ds_shape``) and steps once per sub-group
    with the other groups emptied: not mapped yet, so refuse it clearly (same on every rank)."""
    if any(hasattr(p, "ds_id") for _, p in originals):
        raise NotImplementedError(
            "swan_dist: DeepSpeed ZeRO-3 partitioned parameters are not supported yet; use ZeRO stage 0, 1 or 2"
        )


def partition_pieces(originals: list[tuple[str, Tensor]], flat: Tensor) -> list[tuple[str, Piece]]:
    """This rank's piece of each original parameter inside the flat fp32 partition ``flat``."""
    out = []
    for name, lp in originals:
        mapping = getattr(lp, "_hp_mapping", "missing")
        if mapping == "missing":
            raise ValueError(
                f"swan_dist: parameter {name!r} was replaced by a flat partition but carries no DeepSpeed "
                "_hp_mapping; this framework layout is not supported"
            )
        shape = tuple(getattr(lp, "ds_shape", lp.shape))
        if mapping is None:
            out.append((name, Piece(shape, 0, 0, flat[:0], None)))
            continue
        lo, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        start = mapping.hp_fragment_address.start
        grad = None if flat.grad is None else flat.grad.narrow(0, start, n)
        out.append((name, Piece(shape, lo, lo + n, flat.narrow(0, start, n), grad)))
    return out
