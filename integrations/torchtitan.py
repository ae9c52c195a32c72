"""SWAN in torchtitan (0.3.x): an optimizers container selected by one entry of a torchtitan job config.

torchtitan builds its optimizers from ``Trainer.Config.optimizer`` (an ``OptimizersContainer.Config``) with
``config.optimizer.build(model_parts=...)``. Replacing that one entry with :class:`SwanOptimizersContainer`'s
``Config`` moves a job from AdamW or DistMuon to SWAN; nothing else in the job changes::

    from swan_dist.integrations.torchtitan import SwanOptimizersContainer
    config.optimizer = SwanOptimizersContainer.Config(adamw_lr=8e-4)  # the job's default_adamw(lr=8e-4)

**Learning rate.** ``adamw_lr`` is the lr the job's AdamW had, converted by the lr convention
(:func:`swan_dist.from_adamw`: matrices at 0.2x it, the fallback at 4x); with neither ``adamw_lr`` nor ``lr``
the config converts torchtitan's own AdamW default (``default_adamw``: lr 8e-4). ``betas``, ``eps`` and
``weight_decay`` left unset are torchtitan's AdamW's ((0.9, 0.95), 1e-8, 0.1; the weight decay converted to
SWAN's 0.5). ``lr`` is SWAN's own global lr instead (and ``weight_decay``, given with it, SWAN's own).

What the container does with torchtitan's machinery:

- **Parameters.** Without ``param_groups`` every trainable parameter goes to SWAN, which classifies them
  itself (module types and names: linear and expert matrices whitened; embeddings, the output head, norms,
  biases on the fallback rule). ``param_groups`` in torchtitan's own form (``ParamGroupConfig``) still work:
  entries naming ``"SWAN"`` go to SWAN with their kwargs (``use_swan`` forces a rule), any other name to
  torchtitan's own optimizer of that name.
- **Pipeline parallelism.** The SWAN groups of every model part on a rank form ONE ``SWAN`` optimizer, so a
  step is one agreement and the same collectives on every rank, however many parts an interleaved schedule
  puts on the rank. SWAN's process group is the rank's non-PP mesh: the ranks holding the same parameter
  names (the FSDP/HSDP/TP/EP ranks of its stage), found once at construction.
- **lr scheduler.** torchtitan's ``LRSchedulersContainer`` builds one ``LambdaLR`` per optimizer of the
  container; SWAN's matrix and fallback groups both carry ``lr`` (``fallback_lr`` sets the fallback's apart).
- **Checkpoints (DCP).** ``state_dict``/``load_state_dict`` are torchtitan's flat, FQN-keyed form; the
  fallback's state is created by :meth:`swan_dist.SWAN.init_state` (no step, no collective) instead of
  torchtitan's zero-gradient ``lr = 0`` step; SWAN matrices keep no state. Every group key (``fused`` and
  ``foreach`` that torchtitan injects included) is saved and loaded. A zero-``lr`` step on an optimizer with
  no state yet (torchtitan's ``init_optim_state``) only creates the state, on every rank alike.
- **MoE.** torchtitan's load-balancing step pre-hook is registered on the container and runs before SWAN's
  step; its grouped experts (``w1_EFD``, ``w2_EDF``, ``w3_EFD``: ``(E, out, in)``) are whitened per expert.

Refused at construction, on every rank alike (the configuration is the same on every rank):
``implementation="fused_opt_states_bf16"`` (bf16 Adam moments; SWAN's AdamW fallback keeps fp32 moments) and
a ``SWAN`` param group given ``step_in_backward`` (torchtitan clips the global gradient norm after backward).

This module imports torchtitan at import time: import it only where torchtitan is installed.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)

from swan_dist import SWAN
from swan_dist.lr import MATRIX_RATIO
from swan_dist.selection import tag_model

__all__ = ["SwanOptimizersContainer", "TitanSWAN", "build_swan", "swan_config", "non_pp_group", "titan_adamw"]

SWAN_NAME = "SWAN"
# torchtitan 0.3's GroupedExperts name their stacks by layout: w1_EFD, w3_EFD (E, ffn, dim) and w2_EDF (E, dim, ffn),
# each expert stored (out, in): whitened per expert as stored
EXPERT_STACKS = (r"\.w[13]_EFD$", r"\.w2_EDF$")


def titan_adamw() -> dict[str, Any]:
    """torchtitan's own AdamW settings (``default_adamw()``: lr, betas, eps, weight_decay; in 0.3.0 8e-4,
    (0.9, 0.95), 1e-8, 0.1), read from torchtitan itself."""
    from torchtitan.components.optimizer import default_adamw

    kwargs = default_adamw().param_groups[0].optimizer_kwargs
    return {k: kwargs[k] for k in ("lr", "betas", "eps", "weight_decay")}


class TitanSWAN(SWAN):
    """:class:`swan_dist.SWAN` as torchtitan's checkpoint helpers meet it: a step at ``lr = 0`` everywhere on
    an optimizer with no state yet (``init_optim_state``'s zero-gradient step) creates the fallback's state
    and changes nothing else, with no collective; every other step is SWAN's."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self.state and all(float(g["lr"]) == 0.0 for g in self.param_groups):
            self.init_state()
            return None
        return super().step(closure)


def non_pp_group(model_parts: list[nn.Module]) -> dist.ProcessGroup | None:
    """The ranks holding the same parameters as this one (its non-PP mesh: FSDP, HSDP, TP and EP ranks of its
    pipeline stage) as a process group; ``None`` (the world) when that is every rank or there is no world.
    Collective over the world: every rank calls it once, at construction."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    names = tuple(sorted(n for m in model_parts for n, p in m.named_parameters() if p.requires_grad))
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for m in model_parts for p in m.parameters()
              if isinstance(p, DTensor)}
    key = hashlib.sha256("\n".join(names).encode()).hexdigest()  # the same in every process
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (key, sorted(meshes)))  # every rank sees every rank's meshes: all refuse alike
    for rank, (k, rank_meshes) in enumerate(gathered):
        ranks = [r for r, (h, _) in enumerate(gathered) if h == k]
        for mesh in rank_meshes:  # a DTensor's mesh cannot reach beyond the ranks holding the same names
            if not set(mesh) <= set(ranks):
                raise ValueError(
                    f"swan_dist: rank {rank} holds a parameter on mesh {list(mesh)}, which spans ranks holding other "
                    f"parameters (ranks {ranks} hold rank {rank}'s); SWAN cannot tell its process group: give the "
                    "ranks of one pipeline stage the same parameters")
    if all(h == key for h, _ in gathered):
        return None
    # every rank builds every group, in one order (new_subgroups_by_enumeration requires it)
    keys = [h for h, _ in gathered]
    groups = sorted({tuple(r for r, h in enumerate(keys) if h == k) for k in keys})
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine


def build_swan(param_groups: list[dict[str, Any]], *, process_group: dist.ProcessGroup | None = None,
               **kwargs: Any) -> TitanSWAN:
    """torchtitan's optimizer factory signature (``factory(param_groups, **factory_kwargs)``) for SWAN."""
    for g in param_groups:
        if g.get("step_in_backward"):
            raise ValueError("swan_dist: step_in_backward cannot run in torchtitan: its train_step clips the global "
                             "gradient norm after backward; drop step_in_backward from the param group")
    return TitanSWAN(param_groups, process_group=process_group, **kwargs)


class SwanOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with ``"SWAN"`` among its optimizer names; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        adamw_lr: float | None = None
        """A tuned AdamW's lr, converted by the lr convention (:func:`swan_dist.from_adamw`: matrices at
        ``lr * alpha = 0.2 adamw_lr``, the fallback at ``4 adamw_lr``). With neither this nor ``lr``: torchtitan's
        AdamW default (``default_adamw``'s lr, 8e-4)."""

        lr: float | None = None
        """SWAN's own global learning rate instead: matrices step at ``lr * alpha``, the fallback at ``lr`` (or
        ``fallback_lr``)."""

        preset: str | None = "swan_ddagger"
        """``swan_0`` | ``swan_dagger`` | ``swan_ddagger`` | a YAML path | ``None``."""

        fallback: str | None = None
        """Rule of the parameters SWAN does not whiten: ``adamw`` | ``sign`` | ``sgd`` (default: the preset's)."""

        fallback_lr: float | None = None
        """Starting lr of the fallback groups, set apart from ``lr`` (the scheduler scales both)."""

        weight_decay: float | None = None
        """AdamW's (converted: SWAN applies 5x it) unless ``lr`` is given, then SWAN's own; unset: torchtitan's
        AdamW's (0.1), converted (0.5)."""

        alpha: float | None = None
        betas: tuple[float, float] | None = None
        """Of the AdamW fallback; unset: torchtitan's AdamW's, (0.9, 0.95)."""

        eps: float | None = None
        """Of the AdamW fallback; unset: torchtitan's AdamW's, 1e-8."""

        whiten_dtype: str | None = None
        """``auto`` | ``float32`` | ``bfloat16`` | ``float64``."""

        mode: str = "auto"
        """Where matrices are whitened: ``auto``/``owner`` (each once, on one rank) | ``replicated`` | ``local``."""

        bucket_mb: float = 256.0
        include: list[str] = field(default_factory=list)
        """Regular expressions on FQNs forcing SWAN (over the built-in rules)."""

        exclude: list[str] = field(default_factory=list)
        """Regular expressions on FQNs forcing the fallback rule."""

        whiten_experts: bool = True
        """Whiten torchtitan's grouped MoE experts (``w1_EFD``, ``w2_EDF``, ``w3_EFD``) per expert; ``False``: the
        fallback rule."""

        implementation: str = "for-loop"  # type: ignore[assignment]
        """As torchtitan's; kept in every group (and in checkpoints); SWAN does not read it."""

        def includes(self) -> list[str]:
            return [*self.include, *(EXPERT_STACKS if self.whiten_experts else ())]

        def swan_kwargs(self) -> dict[str, Any]:
            """The keyword arguments of :class:`swan_dist.SWAN` this config sets: ``adamw_lr`` (this config's, or
            torchtitan's AdamW default) and AdamW's weight decay, or ``lr`` and SWAN's own; the fallback's betas
            and eps, torchtitan's AdamW's where unset."""
            if self.lr is not None and self.adamw_lr is not None:
                raise ValueError(f"swan_dist: SwanOptimizersContainer.Config got adamw_lr={self.adamw_lr!r} and "
                                 f"lr={self.lr!r}: adamw_lr is a tuned AdamW's lr, from which SWAN's lr follows "
                                 "(swan_dist.from_adamw); give adamw_lr or lr, not both")
            adamw = titan_adamw()
            kw = dict(preset=self.preset, fallback=self.fallback, fallback_lr=self.fallback_lr, alpha=self.alpha,
                      betas=adamw["betas"] if self.betas is None else self.betas,
                      eps=adamw["eps"] if self.eps is None else self.eps,
                      whiten_dtype=self.whiten_dtype, mode=self.mode, bucket_mb=self.bucket_mb)
            if self.lr is not None:  # SWAN's own lr; an unset weight decay is torchtitan's AdamW's, converted
                kw.update(lr=self.lr, weight_decay=adamw["weight_decay"] / MATRIX_RATIO
                          if self.weight_decay is None else self.weight_decay)
            else:  # SWAN converts the AdamW lr and weight decay (swan_dist.from_adamw)
                kw.update(adamw_lr=adamw["lr"] if self.adamw_lr is None else self.adamw_lr,
                          weight_decay=adamw["weight_decay"] if self.weight_decay is None else self.weight_decay)
            return {k: v for k, v in kw.items() if v is not None or k == "preset"}

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name == SWAN_NAME:
            return build_swan
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError(
                "swan_dist: implementation='fused_opt_states_bf16' keeps bf16 Adam moments through a torch "
                "Adam/AdamW hook; SWAN's AdamW fallback keeps fp32 moments: set implementation='for-loop' "
                "(or 'foreach') with the SWAN optimizer container")
        impl_kwargs = self._build_impl_kwargs(config)
        group_configs = config.param_groups or [ParamGroupConfig(pattern=r".*", optimizer_name=SWAN_NAME)]
        self.optimizers = []
        self.model_parts = model_parts
        self.swan_config = config
        all_params: list[nn.Parameter] = []
        swan_groups: list[dict[str, Any]] = []
        for part_idx, model in enumerate(model_parts):
            tag_model(model, config.includes(), config.exclude)  # module types: expert stacks, heads, embeddings
            groups_by_name, patterns_by_name = self._build_param_groups(model, group_configs, impl_kwargs)
            for name, groups in groups_by_name.items():
                for g in groups:
                    all_params.extend(g["params"])
                if name == SWAN_NAME:  # one SWAN over every part of this rank: one agreement per step
                    swan_groups.extend(groups)
                    continue
                opt = self._resolve_optimizer_factory(name)(
                    groups, **config.optimizer_factory_kwargs_by_name.get(name, {}))
                self.optimizers.append(opt)
                self._log_optimizer(opt, part_idx, patterns_by_name[name])
        group = non_pp_group(model_parts)  # collective: every rank, even one without SWAN parameters
        if swan_groups:
            kwargs = {**config.swan_kwargs(), "include": config.includes(), "exclude": config.exclude,
                      "verbose": False, **config.optimizer_factory_kwargs_by_name.get(SWAN_NAME, {})}
            swan = build_swan(swan_groups, process_group=group, **kwargs)
            self.optimizers.insert(0, swan)
            from torchtitan.tools.logging import logger
            logger.info("swan_dist SWAN over %d model part(s):\n%s", len(model_parts), swan.summary())
        self._validate_params(all_params)
        self._post_init(all_params)

    @property
    def swan(self) -> TitanSWAN | None:
        """The container's SWAN optimizer (``None`` when no parameter group names SWAN)."""
        return next((o for o in self.optimizers if isinstance(o, SWAN)), None)

    def _materialize(self, optim: torch.optim.Optimizer) -> None:
        if isinstance(optim, SWAN):
            if not optim.state:
                optim.init_state()  # the fallback's moments; no step, no collective
        else:
            init_optim_state(optim)

    def state_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for optim in self.optimizers:
            self._materialize(optim)
            result.update(get_flat_optim_state_dict(optim))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optim in self.optimizers:
            self._materialize(optim)
            load_flat_optim_state_dict(optim, state_dict)


def swan_config(lr: float | None = None, **kwargs: Any) -> SwanOptimizersContainer.Config:
    """The counterpart of torchtitan's ``default_adamw(lr=...)``, with the same meaning of ``lr`` (AdamW's; unset:
    torchtitan's default, 8e-4): ``SwanOptimizersContainer.Config(adamw_lr=lr, **kwargs)``."""
    return SwanOptimizersContainer.Config(adamw_lr=lr, **kwargs)
