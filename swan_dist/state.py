"""Optimizer state in each framework's checkpoint layout. SWAN matrices and stateless fallback rules keep
no state; the AdamW fallback keeps two moments and a step per tensor (or, for a tensor packing several
parameters, compact state per fallback member), which each adapter shows as its framework expects
(:meth:`swan_dist.adapter.Adapter.export_state` / ``import_state``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .adapter import adapter_for

__all__ = ["export_states", "import_states", "zero_states"]


def _stateful(group: dict) -> bool:
    return not group["use_swan"] and group["fallback"] == "adamw"


def export_states(sd: dict[str, Any], groups: list[dict], packed: dict[Tensor, tuple[bool, ...]]) -> dict[str, Any]:
    """torch's state dict ``sd`` with an empty entry for every parameter without state (zero bytes, but
    ``torch.distributed.checkpoint.set_state_dict`` in strict mode requires an entry for every trainable
    parameter), each entry in its adapter's layout."""
    stateful = {id(p) for g in groups if _stateful(g) for p in g["params"]}
    done = set()  # a group listed twice in param_groups (torch saves it, its tensors' indices repeated)
    for packed_group, g in zip(sd["param_groups"], groups):
        for i, p in zip(packed_group["params"], g["params"]):
            if i not in done:
                done.add(i)
                rules = packed.get(p, (g["use_swan"],))
                sd["state"][i] = adapter_for(p).export_state(p, sd["state"].get(i, {}), rules, stateful)
    return sd


def zero_states(state: dict, groups: list[dict], packed: dict[Tensor, tuple[bool, ...]]) -> None:
    """The AdamW fallback's zero state for every tensor whose rule keeps some, as a first step makes it."""
    for g in groups:
        if not _stateful(g):
            continue
        for p in g["params"]:
            st = state[p]
            if not st and p not in packed:  # a packed tensor's compact state starts at its first step
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def import_states(state: dict, groups: list[dict], packed: dict[Tensor, tuple[bool, ...]]) -> None:
    """After torch's ``load_state_dict``: each tensor's state back from its adapter's layout; stateless
    parameters keep none."""
    seen = set()
    for g in groups:
        for p in g["params"]:
            if id(p) in seen:  # a group listed twice
                continue
            seen.add(id(p))
            rules = packed.get(p)
            if rules is None and not _stateful(g):
                state.pop(p, None)
            elif state.get(p):
                st = state[p]
                if "step" in st and not isinstance(st["step"], Tensor):  # a number (older torch saved one), as
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)  # torch's Adam loads it
                state[p] = adapter_for(p).import_state(p, st, rules or (g["use_swan"],))
            else:  # an empty entry would only keep the tensor alive (e.g. after a framework replaced it)
                state.pop(p, None)
