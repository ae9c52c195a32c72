"""Hugging Face Transformers' ``Trainer`` (and, through it, Accelerate): how SWAN always gets the model.

SWAN classifies parameters by module type and name (embeddings and the output head take the fallback
rule), so it must see the model, not bare tensors. The documented entry point is :class:`SWANFactory`,
an optimizer *factory* in Transformers' sense (``transformers.trainer_optimizer.is_optimizer_factory``:
anything that is not an ``Optimizer`` subclass; ``Trainer.create_optimizer`` calls
``factory()(model, **kwargs)``)::

    Trainer(model=model, args=args, train_dataset=ds,
            optimizer_cls_and_kwargs=(swan_dist.SWANFactory, {"preset": "swan_ddagger", "lr": 0.02}))

``Trainer.create_optimizer`` hands the factory the model it would have grouped: the plain model under
DDP and FSDP2 (the optimizer is built before ``accelerator.prepare``, which swaps in the sharded
DTensors; SWAN adopts them, :func:`swan_dist.adapter.adopt`), the FSDP1-wrapped model under FSDP1.

The bare form ``optimizer_cls_and_kwargs=(swan_dist.SWAN, kwargs)`` makes the Trainer pass two
unnamed weight-decay groups. :class:`HuggingFaceAdapter` finds the Trainer that is building the
optimizer (a caller up the stack, as DeepSpeed's engine is found for ``"type": "SWAN"``) and the model
whose ``named_parameters`` produced those groups, so SWAN tags that model and the bare tensors keep
their names and rules. It claims no tensor: the tensors are the DDP / DTensor / FSDP1 adapters'.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from torch import Tensor, nn

from swan_dist.adapter import Adapter

__all__ = ["SWANFactory", "HuggingFaceAdapter", "trainer_model", "trainer_args", "calling_trainer"]


# ``adamw_lr`` values that take the Trainer's learning_rate as AdamW's lr. In a DeepSpeed JSON under the Trainer
# only "learning_rate" can be written: Accelerate fills the "auto" values it knows and refuses any other.
TRAINER_LR = ("auto", "learning_rate")


class SWANFactory:
    """``Trainer(optimizer_cls_and_kwargs=(swan_dist.SWANFactory, {...}))``: SWAN built on the Trainer's
    model, with the keyword arguments of :class:`swan_dist.SWAN` (``preset``, ``lr``, ``fallback``, ...).

    ``TrainingArguments.learning_rate`` and ``weight_decay`` do not reach a custom optimizer (as for any
    ``optimizer_cls_and_kwargs``), except through ``{"adamw_lr": "auto"}``: the Trainer's ``learning_rate`` is
    then AdamW's lr, converted by the lr convention (:func:`swan_dist.from_adamw`), with its ``weight_decay``
    (AdamW's, converted), ``adam_beta1``/``adam_beta2`` and ``adam_epsilon`` (the fallback's) where the kwargs
    do not set them (``"learning_rate"`` says the same as ``"auto"``). ``{"adamw_lr": η}`` converts η, with the same
    betas, eps and weight decay from the Trainer's arguments; ``{"lr": ...}`` is SWAN's own lr. The Trainer's scheduler
    (``lr_scheduler_type``, ``warmup_steps``) scales the lr of every SWAN group; the preset's own warm-up
    and cosine schedule belong to the reference trainer and are not applied.
    """

    def __call__(self, model: nn.Module, **kwargs: Any):
        from swan_dist.optimizer import SWAN

        if not isinstance(model, nn.Module):
            raise TypeError(
                f"swan_dist.SWANFactory expects the model from Trainer.create_optimizer, got {type(model).__name__}; "
                "pass it as Trainer(optimizer_cls_and_kwargs=(swan_dist.SWANFactory, {...})), or build "
                "swan_dist.SWAN(model, ...) yourself"
            )
        if kwargs.get("adamw_lr") in TRAINER_LR and (args := trainer_args()) is not None:
            kwargs = {"weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2),
                      "eps": args.adam_epsilon, **kwargs, "adamw_lr": args.learning_rate}
        return SWAN(model, **kwargs)


def calling_trainer():
    """The ``transformers.Trainer`` up the call stack (building the optimizer: ``create_optimizer``, or DeepSpeed's
    engine inside ``train``), or ``None``."""
    if "transformers.trainer" not in sys.modules:  # no Trainer can exist
        return None
    from transformers.trainer import Trainer

    for frame in _trainer_frames(Trainer):
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
    return None


def _trainer_frames(trainer: type) -> list:
    """The frames up the call stack that run a method of ``trainer`` or of a subclass (a user's Trainer), innermost
    first: only these are asked for their locals, since reading a frame's ``f_locals`` leaves a snapshot of them on
    the frame while it runs (asking every caller's would hold what it had, a model deleted since, alive)."""
    codes, todo = set(), [trainer]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        codes |= {f.__code__ for f in vars(cls).values() if hasattr(f, "__code__")}
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            frames.append(frame)
        frame = frame.f_back
    return frames


def trainer_args():
    """The ``TrainingArguments`` of the Trainer up the call stack, or ``None``: ``adamw_lr="auto"`` takes its
    ``learning_rate``."""
    trainer = calling_trainer()
    return None if trainer is None else trainer.args


def trainer_model(params: Sequence[Tensor]) -> nn.Module | None:
    """The model a ``transformers.Trainer`` up the call stack is building an optimizer for, if these bare
    tensors are its parameters (``create_optimizer``'s ``opt_model``, else the Trainer's models)."""
    if "transformers.trainer" not in sys.modules:  # no Trainer can exist
        return None
    from transformers.trainer import Trainer

    ids = {id(p) for p in params}
    for frame in _trainer_frames(Trainer):
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            for model in (frame.f_locals.get("opt_model"), getattr(owner, "model_wrapped", None),
                          getattr(owner, "model", None)):
                if isinstance(model, nn.Module) and ids <= {id(p) for p in model.parameters()}:
                    return model
    return None


class HuggingFaceAdapter(Adapter):
    """Names for the bare groups ``Trainer.create_optimizer`` passes to ``SWAN`` (``optimizer_cls_and_kwargs=
    (swan_dist.SWAN, ...)``); no tensor is this adapter's."""

    name = "huggingface"

    def claims(self, tensor: Tensor) -> bool:
        return False

    def name_bare(self, params: Sequence[Tensor]) -> nn.Module | None:
        return trainer_model(params)
