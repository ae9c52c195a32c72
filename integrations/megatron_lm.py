"""Megatron-LM's ``--optimizer swan``, for an unmodified ``pretrain_gpt.py`` (or any Megatron-LM script).

Megatron-LM's ``--optimizer`` has fixed choices and its scripts hard-code their argument provider, so
the flag needs hooks installed before the script parses its arguments:

    torchrun --nproc-per-node 8 -m swan_dist.integrations.megatron_lm PATH/pretrain_gpt.py --optimizer swan ...

runs the script with them; a user who edits the script adds one line at its top instead::

    import swan_dist.integrations.megatron_lm as swan; swan.install()

:func:`install` adds ``swan`` to ``--optimizer``'s choices and the ``--swan-*`` options below to
Megatron's parser, and routes the optimizer build of ``megatron.training.training`` to
:func:`swan_dist.integrations.megatron_factory.get_swan_optimizer` when ``--optimizer swan`` is given (any other
optimizer is built by Megatron as before). ``--lr`` and ``--min-lr`` are SWAN's global lr and
``--weight-decay`` SWAN's, unless ``--swan-from-adamw`` says they are a tuned AdamW's (converted by the lr
convention, :func:`swan_dist.from_adamw`); ``--adam-beta1/2``, ``--adam-eps`` (the AdamW fallback's),
schedulers, clipping, loss scaling, logging and checkpoint flags keep their Megatron meaning.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

# flag -> (SWAN option, type, help); defaults come from the preset (None: the preset's value)
FLAGS = {
    "--swan-preset": ("preset", str, "swan_0 | swan_dagger | swan_ddagger (default) | a YAML path"),
    "--swan-alpha": ("alpha", float, "scale on --lr for whitened matrices"),
    "--swan-whitening": ("whitening", str, "nsds | ns | none"),
    "--swan-ns-steps": ("ns_steps", int, "Newton-Schulz steps"),
    "--swan-beta": ("beta", float, "Newton-Schulz beta"),
    "--swan-grad-norm": ("grad_norm", str, "rms | mean | none"),
    "--swan-whiten-dtype": ("whiten_dtype", str, "auto | float32 | bfloat16 | float64"),
    "--swan-fallback": ("fallback", str, "rule for tensors SWAN does not whiten: adamw | sign | sgd"),
    "--swan-mode": ("mode", str, "auto | owner | replicated | local"),
    "--swan-bucket-mb": ("bucket_mb", float, "bound of one exchange bucket, MB of full fp32 matrices"),
}
SWITCHES = {  # store_false flags: SWAN whitens fused matrices as their parts unless told otherwise
    "--swan-fused-qkv": ("split_qkv", "whiten linear_qkv as one matrix instead of separate Q, K, V"),
    "--swan-fused-glu": ("split_glu", "whiten a gated linear_fc1 as one matrix instead of separate gate, up"),
}
ON_SWITCHES = {  # store_true flags
    "--swan-from-adamw": ("from_adamw", "--lr, --min-lr and --weight-decay are a tuned AdamW's: converted by the lr "
                          "convention (swan_dist.from_adamw: SWAN's lr 4x them, weight decay 5x)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``swan`` among ``--optimizer``'s choices and the ``--swan-*`` options."""
    for action in parser._actions:
        if "--optimizer" in action.option_strings and action.choices is not None and "swan" not in action.choices:
            action.choices = [*action.choices, "swan"]
    group = parser.add_argument_group("swan", "SWAN optimizer (swan_dist), with --optimizer swan")
    for flag, (key, kind, text) in FLAGS.items():
        group.add_argument(flag, dest=f"swan_{key}", type=kind, default=None, help=text)
    for flag, (key, text) in SWITCHES.items():
        group.add_argument(flag, dest=f"swan_{key}", action="store_false", help=text)
    for flag, (key, text) in ON_SWITCHES.items():
        group.add_argument(flag, dest=f"swan_{key}", action="store_true", help=text)
    return parser


def optimizer_config(args, base):
    """Megatron's Adam config built from ``args`` (SWAN takes lr, weight decay, the fallback's betas
    and eps from it), marked ``optimizer='swan'`` and carrying the ``--swan-*`` values."""
    from swan_dist.integrations.megatron_checkpoint import LEGACY_DIST_OPT_CHECKPOINT

    optim_io = (args.save and not args.no_save_optim) or (args.load and not args.no_load_optim)
    if args.use_distributed_optimizer and optim_io and getattr(args, "ckpt_format", "torch_dist") == "torch":
        raise ValueError(LEGACY_DIST_OPT_CHECKPOINT)  # at start-up, not at the first save hours later
    saved = args.optimizer
    args.optimizer = "adam"
    try:
        config, overrides = base(args)
    finally:
        args.optimizer = saved
    config.optimizer = "swan"
    for key, value in vars(args).items():
        if key.startswith("swan_") and value is not None:
            setattr(config, key, value)
    return config, overrides


def install() -> None:
    """Install the hooks in ``megatron.training`` (idempotent). Call before the script parses arguments."""
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    if getattr(arguments, "_swan_installed", False):
        return
    add_training_args, build_config, build_optimizer = (
        arguments._add_training_args, training.get_megatron_optimizer_config, training.get_megatron_optimizer)

    def _add_training_args(parser):
        return add_arguments(add_training_args(parser))

    def get_megatron_optimizer_config(args):
        if args.optimizer == "swan":
            return optimizer_config(args, build_config)
        return build_config(args)

    def get_megatron_optimizer(config, model_chunks, *rest, **kwargs):
        if getattr(config, "optimizer", None) == "swan":
            return get_swan_optimizer(config, model_chunks, *rest, **kwargs)
        return build_optimizer(config, model_chunks, *rest, **kwargs)

    arguments._add_training_args = _add_training_args
    training.get_megatron_optimizer_config = get_megatron_optimizer_config
    training.get_megatron_optimizer = get_megatron_optimizer
    arguments._swan_installed = True


def main(argv: list[str] | None = None) -> None:
    """``python -m swan_dist.integrations.megatron_lm SCRIPT [args...]``: run a Megatron-LM script with
    :func:`install`'s hooks, as ``python SCRIPT args...`` would (its directory first on ``sys.path``,
    so ``megatron`` is the checkout's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m swan_dist.integrations.megatron_lm PATH/pretrain_gpt.py --optimizer swan [...]")
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *argv[1:]]
    install()
    runpy.run_path(script, run_name="__main__")


__all__ = ["install", "main", "add_arguments", "optimizer_config", "FLAGS", "SWITCHES", "ON_SWITCHES"]

if __name__ == "__main__":
    main()
