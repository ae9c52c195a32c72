"""The fallback rules (``adamw``, ``sign``, ``sgd``) as module-level kernels over lists of pieces (the
optimizer holds groups and state and calls them, as ``torch/optim/adam.py`` does).

Each rule updates its pieces' targets from their target gradients, with state where the piece's adapter
put it (``Piece.slot``): whole tensors of the target's shape, or a span of a packed tensor's compact
state. torch's foreach kernels run a rule over every piece of a kind at once (tensors on one device and
dtype, as their adapter's ``local`` gives them: a DTensor's local shard, so that no DTensor dispatch runs
per op), and on the CPU torch's fused AdamW.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.adam import adam as _adam

# torch's functional AdamW: ``adam(..., decoupled_weight_decay=True)`` from torch 2.7 (whose ``adamw``
# then calls it), ``adamw(...)`` before (torch 2.6 has no such keyword)
if "decoupled_weight_decay" in inspect.signature(_adam).parameters:
    def _adamw_functional(*args, **kwargs) -> None:
        _adam(*args, decoupled_weight_decay=True, **kwargs)
else:  # pragma: no cover - older torch, run by launch/compat.sh
    from torch.optim.adamw import adamw as _adamw_functional

from ..adapter import PLAIN, Piece, local_of
from ..collectives import pick
from .apply import _decay, _decay_masked, _scale_add

__all__ = ["run_fallback", "run_fallbacks"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _kinds(pieces: list[Piece]) -> list[list[Piece]]:
    """Pieces in lists a foreach kernel takes at once: same target type, device and dtype, and same
    gradient dtype, in order."""
    kinds: dict[tuple, list[Piece]] = {}
    for pc in pieces:
        t, g = pc.target, pc.target_grad
        kinds.setdefault((type(t), t.device, t.dtype, type(g), g.dtype), []).append(pc)
    return list(kinds.values())


def _adamw_state(state: dict, pc: Piece) -> tuple[Tensor, Tensor, Tensor]:
    """(exp_avg, exp_avg_sq, step) of a piece, created zero on first use; the step counter lives on the
    target's device (as torch's fused and capturable AdamW keep it: no host value in the step), moved
    there once from a checkpoint that kept it on the CPU."""
    s = pc.slot
    st = state[s.key]
    dev = pc.target.device
    if s.index is None:
        if not st:
            st["step"] = torch.tensor(0.0, device=dev)
            st["exp_avg"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
        elif st["step"].device != dev:
            st["step"] = st["step"].to(dev, torch.float32)
        return st["exp_avg"], st["exp_avg_sq"], st["step"]
    if not st:
        st.update(step=torch.zeros(s.counts, device=s.key.device), exp_avg=s.key.new_zeros(s.size),
                  exp_avg_sq=s.key.new_zeros(s.size))
    elif st["step"].device != s.key.device:
        st["step"] = st["step"].to(s.key.device, torch.float32)
    return st["exp_avg"][s.a:s.b], st["exp_avg_sq"][s.a:s.b], st["step"][s.index]


def _fusable(targets: list[Tensor], grads: list[Tensor], *states: list[Tensor]) -> bool:
    """torch's fused AdamW takes these: plain contiguous tensors of one floating dtype on one device,
    gradients and moments of that dtype, fp32 step counters on that device."""
    t0 = targets[0]
    plain = PLAIN + (FakeTensor,)  # a trace (FakeTensorMode) runs the kernel the real step runs
    if type(t0) not in plain or t0.dtype not in _FUSED_DTYPES:
        return False
    dtype, dev = t0.dtype, t0.device
    for t, g, m, v, s in zip(targets, grads, *states):
        if (type(g) not in plain or g.dtype != dtype or m.dtype != dtype or v.dtype != dtype
                or not isinstance(s, Tensor) or s.device != dev or s.dtype != torch.float32 or g.device != dev
                or not (t.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous())):
            return False
    return True


def _adamw(state: dict, group: dict, pieces: list[Piece], skip: Tensor | None) -> None:
    """torch's AdamW over the pieces; ``skip`` (float, 1.0 where a piece is not updated this step: one
    value for all, 0-d, or one per piece) is torch's ``found_inf``: the fused kernel leaves such a piece,
    its moments and its step count bit for bit unchanged, decided on the device (GradScaler's way).
    Gradients of another dtype than their target (or not contiguous) are given to it converted; where
    the kernel still cannot run (a tensor subclass), torch's foreach AdamW runs and what ``skip`` masks
    is put back from copies. Options kept on the device (``capturable=True``), and a step torch.compile
    traces, run :func:`_adamw_on_device`."""
    b1, b2 = group["betas"]
    # options on the device, or a step traced by torch.compile (whose functionalization rejects the fused
    # kernel's in-place update with a per-piece found_inf computed in the graph): torch's foreach ops
    foreach_path = torch.compiler.is_compiling() or any(
        isinstance(x, Tensor) for x in (group["weight_decay"], group["eps"], b1, b2))
    pos = {id(pc): i for i, pc in enumerate(pieces)}  # a piece's index in ``skip``
    for kind in _kinds(pieces):
        m, v, st = zip(*(_adamw_state(state, pc) for pc in kind))
        targets, grads, m, v = local_of(kind[0].target, [pc.target for pc in kind],
                                        [pc.target_grad for pc in kind], m, v)
        st = list(st)
        if foreach_path:
            keep = None if skip is None else (skip == 0).to(targets[0].device)
            _adamw_on_device(targets, grads, m, v, st, group, keep if keep is None or keep.dim() == 0 else
                             pick(keep, [pos[id(pc)] for pc in kind]))
            continue
        if type(targets[0]) in PLAIN + (FakeTensor,) and type(grads[0]) in PLAIN + (FakeTensor,):
            grads = [g if g.dtype == t.dtype and g.is_contiguous() else g.to(t.dtype).contiguous()
                     for t, g in zip(targets, grads)]
        lr = group["lr"] if isinstance(group["lr"], Tensor) else float(group["lr"])
        kw = dict(amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=float(group["weight_decay"]),
                  eps=float(group["eps"]), maximize=False)
        if _fusable(targets, grads, m, v, st):  # a tensor lr as it is (the kernel reads it on the device)
            if skip is None or skip.dim() == 0:
                _adamw_functional(targets, grads, m, v, [], st, fused=True, found_inf=skip, **kw)
                continue
            each = skip.to(targets[0].device).unbind(0)  # (one call for every piece's flag)
            _fused_each(targets, grads, m, v, st, [each[pos[id(pc)]] for pc in kind], kw)
            continue
        saved = None if skip is None else [[x.clone() for x in xs] for xs in (targets, m, v, st)]
        if isinstance(lr, Tensor):  # torch's foreach AdamW takes a tensor lr only as capturable (not on the CPU)
            if lr.device.type == "cpu":
                kw["lr"] = float(lr)
            else:
                kw["capturable"] = True
        _adamw_functional(targets, grads, m, v, [], st, foreach=True, **kw)
        if saved is not None:
            keep = [skip if skip.dim() == 0 else skip[pos[id(pc)]] for pc in kind]
            for xs, old in zip((targets, m, v, st), saved):
                for x, o, k in zip(xs, old, keep):
                    x.copy_(torch.where(k.to(x.device) > 0, o, x))


def _adamw_on_device(targets: list[Tensor], grads: list[Tensor], m: list[Tensor], v: list[Tensor],
                     steps: list[Tensor], group: dict, keep: Tensor | None) -> None:
    """AdamW (decoupled decay, bias-corrected moments) with its options 0-d tensors on the device
    (``capturable=True``: lr, betas, eps, weight decay; a schedule fills them in place, a captured graph
    replays what they hold), in torch's foreach ops, for any tensor type. torch's fused kernel takes betas,
    eps and weight decay as numbers, and its capturable foreach AdamW runs on CUDA only without
    ``found_inf``. Where ``keep`` (bool, one for all or one per target) is off, the target, its moments and
    its step count stay bit for bit: that piece's lr and ``1 - beta``s are zero and its gradient zeros. Also
    the AdamW of a step ``torch.compile`` traces, where options may be numbers."""
    dev = targets[0].device
    lr, wd, eps, b1, b2 = (x.to(dev) if isinstance(x, Tensor) else x  # (numbers in a step torch.compile traces)
                           for x in (group["lr"], group["weight_decay"], group["eps"], *group["betas"]))
    on = None if keep is None else keep.to(torch.float32).expand(len(targets))

    def each(x: Tensor | float) -> Tensor | float | list[Tensor]:  # one option for all, or its value per target
        return x if not isinstance(x, Tensor) or x.dim() == 0 else list(x.unbind(0))
    # the rate and the moments' weights of each target: zero where it is kept as it is
    rate, k1, k2 = (x if on is None else x * on for x in (lr, 1 - b1, 1 - b2))
    if on is not None:
        grads = [torch.where(k, g, 0) for k, g in zip(keep.expand(len(targets)).unbind(0), grads)]
    torch._foreach_add_(steps, 1 if on is None else each(on))
    torch._foreach_mul_(targets, each(1 - rate * wd))
    torch._foreach_mul_(m, each(1 - k1))
    torch._foreach_add_(m, torch._foreach_mul(grads, each(k1)))
    torch._foreach_mul_(v, each(1 - k2))
    torch._foreach_addcmul_(v, torch._foreach_mul(grads, each(k2)), grads)
    t = torch.stack([s.to(dev, torch.float32) for s in steps]).clamp(min=1)  # (a piece never stepped: no 0/0)
    # t ← t − rate/(1 − β₁ᵗ) · m/(sqrt(v)/r + eps), r = sqrt(1 − β₂ᵗ): as t + m/((sqrt(v) + eps·r)/(−rate·r/(1 − β₁ᵗ)))
    r = (1 - b2 ** t).sqrt()
    denom = torch._foreach_sqrt(v)
    torch._foreach_add_(denom, list((eps * r).unbind(0)))
    torch._foreach_div_(denom, list((-rate * r / (1 - b1 ** t)).unbind(0)))
    torch._foreach_addcdiv_(targets, m, denom)


def _fused_each(targets, grads, m, v, steps, flags: list[Tensor], kw: dict) -> None:
    """torch's fused AdamW with one ``found_inf`` per tensor (a kernel each, as the flag is per call), the step
    counts advanced for all at once and put back where the flag is set, as torch's ``_fused_adam`` does for
    one flag: the kernels called directly, without the functional's per-call bookkeeping. ``flags`` are on
    the targets' device."""
    lr = kw["lr"]
    if isinstance(lr, Tensor):
        lr = lr.to(targets[0].device)
    torch._foreach_add_(steps, 1)
    for j, f in enumerate(flags):
        torch._fused_adamw_(targets[j:j + 1], grads[j:j + 1], m[j:j + 1], v[j:j + 1], [], steps[j:j + 1], lr=lr,
                            beta1=kw["beta1"], beta2=kw["beta2"], weight_decay=kw["weight_decay"], eps=kw["eps"],
                            amsgrad=False, maximize=False, grad_scale=None, found_inf=f)
    torch._foreach_sub_(steps, flags)


def _stateless(group: dict, pieces: list[Piece], sign: bool, skip: Tensor | None) -> None:
    """``t ← t·(1 − lr·wd) − lr·d`` with ``d`` the gradient's sign (``sign``) or the gradient (``sgd``);
    where ``skip`` (as :func:`_adamw`'s) is set the target is left unchanged."""
    lr, wd = group["lr"], group["weight_decay"]
    lr = lr if isinstance(lr, Tensor) else float(lr)
    decay = None if not isinstance(wd, Tensor) and wd == 0 else 1.0 - lr * wd  # a tensor where lr is one
    for kind in _kinds(pieces):
        targets, grads = local_of(kind[0].target, [pc.target for pc in kind], [pc.target_grad for pc in kind])
        keep = None
        if skip is not None:
            pos = {id(pc): i for i, pc in enumerate(pieces)}
            keep = (skip == 0).expand(len(kind)) if skip.dim() == 0 else (pick(skip, [pos[id(pc)] for pc in kind]) == 0)
            keep = keep.to(targets[0].device)
            grads = [torch.where(k, g, 0) for k, g in zip(keep.unbind(0), grads)]  # no NaN reaches a target
        if type(targets[0]) not in PLAIN or type(grads[0]) not in PLAIN:  # (a subclass: one at a time)
            for j, (t, g) in enumerate(zip(targets, grads)):
                if decay is not None:
                    if keep is None:
                        t.mul_(decay)
                    else:
                        _decay_masked([t], decay, keep[j:j + 1])
                d = g.sign() if sign else g
                if isinstance(lr, Tensor):
                    t.sub_(d * lr.to(d.device))
                else:
                    t.add_(d, alpha=-lr)
            continue
        if decay is not None:
            if keep is None:
                _decay(targets, decay)
            else:
                _decay_masked(targets, decay, keep)
        budget = _SIGN_CPU_BYTES if grads[0].device.type == "cpu" else _SIGN_BYTES
        if not sign and not isinstance(lr, Tensor):
            torch._foreach_add_(targets, grads, alpha=-lr)
            continue
        for ts, gs in _chunks(targets, grads, budget):  # signs (or lr·g) made at most ``budget`` bytes at a time
            if sign:
                _scale_add(ts, torch._foreach_sign(gs), lr)
            else:  # lr a tensor
                torch._foreach_add_(ts, torch._foreach_mul(gs, -lr.to(gs[0].device)))


# The sign rule's signs are new tensors: made and applied in chunks of at most this many bytes (the bounds
# of the whitening's stacks, swan_dist/whitening.py), a gradient larger than that in flat slices.
_SIGN_CPU_BYTES = 16 << 20
_SIGN_BYTES = 256 << 20


def _chunks(targets: list[Tensor], grads: list[Tensor], budget: int):
    """``(targets, grads)`` lists, in order, whose gradients hold at most ``budget`` bytes together (or one
    tensor that cannot be sliced); a contiguous gradient larger than ``budget`` comes as flat slices of it
    and its target. Elementwise rules give the same result per element however the tensors are cut."""
    ts: list[Tensor] = []
    gs: list[Tensor] = []
    held = 0
    for t, g in zip(targets, grads):
        size = g.numel() * g.element_size()
        if size > budget and t.shape == g.shape and t.is_contiguous() and g.is_contiguous():
            step = max(1, budget // g.element_size())
            tf, gf = t.view(-1), g.view(-1)
            parts = [(tf[a: a + step], gf[a: a + step]) for a in range(0, g.numel(), step)]
        else:
            parts = [(t, g)]
        for pt, pg in parts:
            size = pg.numel() * pg.element_size()
            if ts and held + size > budget:
                yield ts, gs
                ts, gs, held = [], [], 0
            ts.append(pt)
            gs.append(pg)
            held += size
    if ts:
        yield ts, gs


def run_fallbacks(state: dict, groups: list[dict], entries: list, skip: set[int], wanted: Tensor | None = None
                  ) -> None:
    """Every group's fallback rule over its entries that have a gradient here and are not in ``skip``;
    with ``wanted`` (a bool per entry, on the device: the step applies it) only where it is set, decided
    on the device."""
    todo: dict[int, list[int]] = {}  # fallback entries per group, in group order
    for i, e in enumerate(entries):
        if not e.record.use_swan and e.piece.target_grad is not None and i not in skip:
            todo.setdefault(id(e.group), []).append(i)
    for g in groups:
        if todo.get(id(g)):
            idx = todo[id(g)]
            mask = None if wanted is None else (~pick(wanted, idx)).float()
            run_fallback(state, g, [entries[i].piece for i in idx], mask)


def run_fallback(state: dict, group: dict, pieces: list[Piece], skip: Tensor | None = None) -> None:
    """The group's fallback rule over its pieces (each with a gradient); AdamW keeps its state in ``state``.
    ``skip``: a float per piece, 1.0 where it is left unchanged (or one 0-d value for all)."""
    rule = group["fallback"]
    if skip is not None and group["nonfinite"] != "skip":  # the whole step is skipped or not: one flag
        skip = skip.amax()
    if rule == "adamw":
        _adamw(state, group, pieces, skip)
    else:
        _stateless(group, pieces, sign=rule == "sign", skip=skip)
