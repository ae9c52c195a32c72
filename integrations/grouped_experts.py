"""torchtitan-style grouped MoE experts: a module named ``GroupedExperts`` holding ``w1``, ``w2``, ``w3`` of
shape ``(E, ., .)`` (gate, down, up of a SwiGLU per expert), beside a router whose ``gate`` is an
``nn.Linear(dim, E)`` (torchtitan's ``MoE``: ``self.router.gate``, ``self.experts``).

Which way the experts are stored changed between torchtitan versions (``(E, hidden, dim)`` used as
``x @ w1[e].T``, earlier ``(E, dim, hidden)`` used as ``x @ w1[e]``), and the experts module does not record
``dim``. The router's input width does: ``w1``/``w3`` read ``dim``, ``w2`` writes it. Each expert is then
whitened in the paper's orientation ``(out, in)``; where the shapes cannot tell (``hidden == dim``, or a
shape that fits neither) the three tensors take the fallback rule, the summary saying why.
"""

from __future__ import annotations

from torch import nn

from torch import Tensor

from swan_dist.adapter import Adapter, Form, adapter_for

FORMS = "_swan_grouped_forms"  # on a GroupedExperts module: {"w1"|"w2"|"w3": (stored shape, Form)}


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(adapter_for(t).shape(t))  # full logical shape, also of a shard (FSDP1, DTensor)


def _forms(experts: nn.Module, dim: int) -> dict[str, tuple[tuple[int, ...], Form]]:
    shapes = {k: _shape(getattr(experts, k)) for k in ("w1", "w2", "w3")}
    w1, w2, w3 = shapes["w1"], shapes["w2"], shapes["w3"]
    e = w1[0]
    ok = len(w1) == 3 and w3 == w1 and w2 == (e, w1[2], w1[1])
    if ok and w1[2] == dim and w1[1] != dim:
        transposed = False  # (E, hidden, dim): (out, in) per expert
    elif ok and w1[1] == dim and w1[2] != dim:
        transposed = True  # (E, dim, hidden): (in, out) per expert
    else:
        why = (f"GroupedExperts w1 {list(w1)}, w2 {list(w2)}, w3 {list(w3)} with router width {dim}: "
               "orientation not determined, include them by name to whiten as stored")
        return {k: (s, Form(what=why, whiten=False)) for k, s in shapes.items()}
    how = "(E, in, out): whitened per expert, transposed" if transposed else "(E, out, in): whitened per expert"
    roles = {"w1": "gate", "w2": "down", "w3": "up"}
    return {k: (s, Form(transposed=transposed, whiten=True,
                        what=f"MoE experts (GroupedExperts {roles[k]}, E={e}), stored {how}"))
            for k, s in shapes.items()}


class GroupedExpertsLayouts(Adapter):
    """Claims no tensor: recognises torchtitan-style grouped experts (module docstring)."""

    name = "grouped-experts"

    def claims(self, tensor) -> bool:
        return False

    def prepare(self, model: nn.Module) -> None:
        for parent in model.modules():
            experts, router = getattr(parent, "experts", None), getattr(parent, "router", None)
            if not isinstance(experts, nn.Module) or type(experts).__name__ != "GroupedExperts":
                continue
            if not all(isinstance(getattr(experts, k, None), nn.Parameter) for k in ("w1", "w2", "w3")):
                continue
            gate = getattr(router, "gate", None)
            w1 = _shape(experts.w1)
            e = w1[0] if len(w1) == 3 else None
            if isinstance(gate, nn.Linear) and gate.out_features == e:
                found = _forms(experts, gate.in_features)
            else:
                why = "GroupedExperts without a router.gate nn.Linear(dim, E) beside it: orientation not determined"
                found = {k: (_shape(getattr(experts, k)), Form(what=why, whiten=False)) for k in ("w1", "w2", "w3")}
            object.__setattr__(experts, FORMS, found)

    def form(self, module: nn.Module, param_name: str, shape: tuple[int, ...]) -> Form | None:
        rec = getattr(module, FORMS, None)
        if not rec or param_name not in rec:
            return None
        stored, form = rec[param_name]
        return form if tuple(stored) == tuple(shape) else None
