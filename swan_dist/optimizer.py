"""``swan_dist.SWAN``: the SWAN optimizer as a ``torch.optim.Optimizer``.

Weight matrices chosen by :mod:`swan_dist.selection` are updated with the stateless SWAN direction
(:func:`swan_dist.functional.swan_update`) at lr·α; every other parameter takes the fallback rule at
lr: ``adamw`` (the paper's choice, two state tensors per parameter), or the stateless ``sign``
(Adam with β₁ = β₂ = 0) or ``sgd``, so a whole run can keep zero optimizer state.

Param groups are split on construction into SWAN groups (``use_swan=True``) and fallback groups
(``use_swan=False``) carrying the caller's options; torch lr schedulers scale ``lr`` in all of them.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.adam import adam as _adam_functional

from .functional import WhitenConfig, resolve_dtype, swan_update
from .presets import OPTIMIZER_KEYS, load_preset
from .selection import Rule, classify, collapse_name, param_groups, tagged_name

__all__ = ["SWAN", "FALLBACKS"]

FALLBACKS = ("adamw", "sign", "sgd")
NONFINITE = ("skip", "raise")

# Hyper-parameters with a meaning independent of any preset. lr has no default without a preset.
_BASE = dict(
    alpha=1.0, whitening="nsds", ns_steps=2, beta=0.4, grad_norm="rms", whiten_dtype="auto",
    weight_decay=0.0, fallback="adamw", betas=(0.9, 0.999), eps=1e-8, nonfinite="skip",
)
assert set(_BASE) | {"lr"} == OPTIMIZER_KEYS

# Largest stack of same-shape gradients whitened in one batched call (bounds transient memory).
_MAX_BATCH_BYTES = 256 << 20


def _whiten_config(group: dict) -> WhitenConfig:
    return WhitenConfig(
        method=group["whitening"], steps=int(group["ns_steps"]), beta=float(group["beta"]),
        grad_norm=group["grad_norm"], dtype=group["whiten_dtype"],
    )


def _check_group(group: dict) -> None:
    _whiten_config(group)  # raises ValueError naming the bad value
    if group["fallback"] not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {group['fallback']!r}")
    if group["nonfinite"] not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {group['nonfinite']!r}")
    for key in ("lr", "alpha", "weight_decay", "eps"):
        if float(group[key]) < 0:
            raise ValueError(f"{key} must be >= 0, got {group[key]}")
    b1, b2 = group["betas"]
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {group['betas']}")


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class SWAN(torch.optim.Optimizer):
    """SWAN: SGD with Whitening And Normalization (arXiv 2412.13148).

    Args:
        params: an ``nn.Module`` (parameters classified by module type and name), ``named_parameters()``,
            bare tensors, or param-group dicts. A group may set ``use_swan`` to force its rule and any
            hyper-parameter below.
        lr: global learning rate; SWAN matrices use ``lr * alpha``, fallback parameters ``lr``.
        preset: ``swan_0``, ``swan_dagger``, ``swan_ddagger`` (default) or a YAML path; ``None`` for
            no preset (then ``lr`` is required). Explicit arguments override the preset.
        alpha: scale on the lr of SWAN-managed matrices.
        whitening: ``nsds`` | ``ns`` | ``none``; ``ns_steps`` and ``beta`` as in the paper's Alg. 2.
        grad_norm: ``rms`` (paper eq. 1) | ``mean`` (mean-centred) | ``none``.
        whiten_dtype: ``auto`` (bf16 NSDS on CUDA, fp32 otherwise) | ``float32`` | ``bfloat16`` | ``float64``.
        weight_decay: decoupled, ``p ← p·(1 − lr_eff·wd)`` for every parameter.
        fallback: rule for parameters SWAN does not whiten: ``adamw`` | ``sign`` | ``sgd``.
        betas, eps: of the ``adamw`` fallback.
        nonfinite: ``skip`` (a parameter whose gradient has NaN/Inf is left untouched this step,
            fallback state included, and a warning names it) or ``raise`` (``FloatingPointError``
            naming the parameters, raised before anything is modified).
        include, exclude: regular expressions on parameter names forcing SWAN / the fallback.
        verbose: print the start-up summary (rank 0 only).
    """

    def __init__(
        self,
        params: Iterable[Any] | nn.Module,
        lr: float | None = None,
        preset: str | None = "swan_ddagger",
        *,
        alpha: float | None = None,
        whitening: str | None = None,
        ns_steps: int | None = None,
        beta: float | None = None,
        grad_norm: str | None = None,
        whiten_dtype: str | None = None,
        weight_decay: float | None = None,
        fallback: str | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        nonfinite: str | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        verbose: bool = True,
    ) -> None:
        defaults: dict[str, Any] = dict(_BASE)
        self.preset = None
        if preset is not None:
            p = load_preset(preset)
            self.preset = p["name"]
            defaults.update(p["optimizer"])
        explicit = dict(
            lr=lr, alpha=alpha, whitening=whitening, ns_steps=ns_steps, beta=beta, grad_norm=grad_norm,
            whiten_dtype=whiten_dtype, weight_decay=weight_decay, fallback=fallback, betas=betas,
            eps=eps, nonfinite=nonfinite,
        )
        defaults.update({k: v for k, v in explicit.items() if v is not None})
        if "lr" not in defaults:
            raise ValueError("SWAN: lr is required when no preset is given")
        defaults["betas"] = tuple(defaults["betas"])
        _check_group(defaults)
        self._include, self._exclude = list(include or ()), list(exclude or ())
        self._rows: list[tuple[str, tuple[int, ...], str, Rule]] = []  # for the summary, not state
        self.nonfinite_skips: Counter[str] = Counter()
        self.whitened_matrices = 0  # matrices whitened so far (SWAN work done, for accounting)
        if isinstance(params, nn.Module):
            params = param_groups(params, self._include, self._exclude)
        super().__init__(params, defaults)
        if verbose and _rank0():
            print(self.summary(), flush=True)

    # ------------------------------------------------------------------ groups and summary
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Classify each parameter and add one SWAN and/or one fallback group with the same options."""
        group = dict(param_group)
        raw = group.pop("params")
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        names = group.pop("param_names", None)
        if raw and isinstance(raw[0], tuple):
            names, raw = [n for n, _ in raw], [p for _, p in raw]
        forced = group.pop("use_swan", None)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        group["betas"] = tuple(group["betas"])
        _check_group(group)
        split: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
        for i, p in enumerate(raw):
            name = names[i] if names is not None else tagged_name(p)
            if forced is not None:
                rule = Rule(bool(forced), f"param group use_swan={bool(forced)}")
                if rule.use_swan and p.dim() < 2:
                    raise ValueError(f"param group use_swan=True but {name or 'a parameter'} is {p.dim()}-D")
            else:
                rule = classify(name, p, self._include, self._exclude)
            label = name if name is not None else f"<unnamed {len(self._rows)}>"
            rule_name = "SWAN" if rule.use_swan else f"fallback:{group['fallback']}"
            self._rows.append((label, tuple(p.shape), rule_name, rule))
            split[rule.use_swan][0].append(p)
            split[rule.use_swan][1].append(label)
        for use in (True, False):
            ps, ns = split[use]
            if ps or (not raw and use):
                g = {**group, "params": ps, "use_swan": use}
                if names is not None:
                    g["param_names"] = ns
                super().add_param_group(g)

    def summary(self) -> str:
        """Which parameters get SWAN and which the fallback rule, and why (layers collapsed to ``*``)."""
        rows: Counter = Counter()
        numel: defaultdict = defaultdict(int)
        for name, shape, rule_name, rule in self._rows:
            key = (rule_name, collapse_name(name), shape, rule.reason)
            rows[key] += 1
            numel[rule_name] += int(torch.Size(shape).numel())
        n_swan = sum(c for k, c in rows.items() if k[0] == "SWAN")
        head = [
            f"swan_dist.SWAN (preset={self.preset}): {n_swan} matrices whitened by SWAN, "
            f"{len(self._rows) - n_swan} tensors on the fallback rule",
        ]
        for g in self.param_groups:
            if g["use_swan"] and g["params"]:
                dev = g["params"][0].device
                dt = str(resolve_dtype(_whiten_config(g), dev)).replace("torch.", "")
                head.append(
                    f"  SWAN group: {g['whitening']} steps={g['ns_steps']} beta={g['beta']} "
                    f"grad_norm={g['grad_norm']} dtype={dt} on {dev.type}, lr={g['lr']} x alpha={g['alpha']}"
                )
        head += [f"  {rule}: {n:,} parameters" for rule, n in sorted(numel.items())]
        width = max((len(k[1]) for k in rows), default=10)
        body = [
            f"  {r:<16} {n:<{width}} x{c:<3} {str(list(s)):<14} {why}"
            for (r, n, s, why), c in sorted(rows.items(), key=lambda kv: (kv[0][0] != "SWAN", kv[0][1]))
        ]
        return "\n".join(head + body)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [
            [(p, name) for p, name in self._named(g) if p.grad is not None] for g in self.param_groups
        ]
        bad = self._nonfinite([pn for w in work for pn in w])
        if bad:
            names = sorted(bad.values())
            policies = {g["nonfinite"] for g, w in zip(self.param_groups, work) if any(p in bad for p, _ in w)}
            if "raise" in policies:
                raise FloatingPointError(
                    f"SWAN: non-finite gradient in {names[:8]}{' ...' if len(names) > 8 else ''}; "
                    "no parameter was updated"
                )
            self.nonfinite_skips.update(names)
            warnings.warn(f"SWAN: non-finite gradient, update skipped for {names[:8]}", RuntimeWarning)
        for group, w in zip(self.param_groups, work):
            ps = [p for p, _ in w if p not in bad]
            if not ps:
                continue
            if group["use_swan"]:
                self._swan_step(group, ps)
            else:
                getattr(self, f"_fallback_{group['fallback']}")(group, ps)
        return loss

    @staticmethod
    def _named(group: dict) -> list[tuple[Tensor, str]]:
        names = group.get("param_names") or [
            tagged_name(p) or f"<param {i} of shape {list(p.shape)}>" for i, p in enumerate(group["params"])
        ]
        return list(zip(group["params"], names))

    @staticmethod
    def _nonfinite(named: list[tuple[Tensor, str]]) -> dict[Tensor, str]:
        """Parameters whose gradient holds NaN/Inf (one host sync for all of them)."""
        if not named:
            return {}
        by_device: defaultdict = defaultdict(list)
        for p, n in named:
            by_device[p.grad.device].append((p, n))
        bad = {}
        for group in by_device.values():
            flags = torch.stack([p.grad.isfinite().all() for p, _ in group]).tolist()
            bad.update({p: n for (p, n), ok in zip(group, flags) if not ok})
        return bad

    def _swan_step(self, group: dict, params: list[Tensor]) -> None:
        cfg = _whiten_config(group)
        lr = float(group["lr"]) * float(group["alpha"])
        wd = float(group["weight_decay"])
        by_shape: defaultdict = defaultdict(list)
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("SWAN does not support sparse gradients")
            by_shape[(tuple(p.shape), p.grad.dtype, p.device)].append(p)
        for (shape, _, _), same in by_shape.items():
            per = max(1, _MAX_BATCH_BYTES // max(1, 4 * torch.Size(shape).numel()))
            for i in range(0, len(same), per):
                chunk = same[i : i + per]
                upd, _ = swan_update(torch.stack([p.grad for p in chunk]), cfg)
                for p, u in zip(chunk, upd):
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(u.to(p.dtype), alpha=-lr)
                self.whitened_matrices += len(chunk) * max(1, torch.Size(shape[:-2]).numel())

    def _fallback_adamw(self, group: dict, params: list[Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        b1, b2 = group["betas"]
        _adam_functional(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
            decoupled_weight_decay=True, amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )

    def _fallback_sign(self, group: dict, params: list[Tensor]) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for p in params:
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(p.grad.sign(), alpha=-lr)

    def _fallback_sgd(self, group: dict, params: list[Tensor]) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for p in params:
            if wd:
                p.mul_(1.0 - lr * wd)
            p.add_(p.grad, alpha=-lr)
