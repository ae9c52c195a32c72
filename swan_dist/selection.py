"""Which parameters SWAN whitens, and why; everything else takes the fallback rule.

Default scope (the paper, following GaLore): the weight matrices of linear projections. Embeddings,
the output head, norms and biases take the fallback rule. The decision for each parameter comes with
a reason, shown in the optimizer's start-up summary, so nothing falls back silently.

Precedence, first match wins:
 1. a param group's explicit ``use_swan`` key;
 2. user ``exclude`` patterns, then user ``include`` patterns (regular expressions searched in the name);
 3. a tag left on the parameter by :func:`tag_model` (module types known), which survives frameworks
    that hand the optimizer bare parameters (DeepSpeed, DDP);
 4. the built-in name rules (embedding/head names), then the tensor's dimensionality.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .adapter import Form, Member, form_of, members_of, prepare_model

__all__ = ["Rule", "DEFAULT_EXCLUDE", "classify", "rule_of", "tag_model", "param_groups", "collapse_name",
           "tagged_name", "tagged_form", "TAG_ATTRS"]

# Module-path components that name an embedding or an output head (LLaMA, HF, GPT-2, Megatron, ...).
DEFAULT_EXCLUDE = (
    r"(^|\.)[^.]*embed[^.]*\.",
    r"(^|\.)(wte|wpe|lm_head|output|output_layer|head|classifier|score)\.",
)

_TAG = "_swan_rule"
_NAME_TAG = "_swan_name"
_FORM_TAG = "_swan_form"  # a Form: orientation / fused split / expert stack recognised from the module type
TAG_ATTRS = (_TAG, _NAME_TAG, _FORM_TAG)  # every attribute tag_model leaves on a tensor (carried when it is swapped)


@dataclass(frozen=True)
class Rule:
    use_swan: bool
    reason: str


def _search(patterns: Sequence[str] | None, name: str | None) -> str | None:
    if name is None:
        return None
    for p in patterns or ():
        if re.search(p, name):
            return p
    return None


def classify(
    name: str | None,
    param: torch.Tensor | Member,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> Rule:
    """Rule for one parameter from its name and tensor (steps 2-4 of the precedence above). ``param``
    may also be a :class:`~swan_dist.adapter.Member` (a logical parameter an adapter reports, e.g. one
    original of an FSDP1 FlatParameter): its full shape and its holder's tag are read."""
    member = param if isinstance(param, Member) else members_of(param, name)[0]
    ndim = len(member.shape)
    param = member.holder
    if (p := _search(exclude, name)) is not None:
        return Rule(False, f"matches exclude pattern {p!r}")
    if (p := _search(include, name)) is not None:
        if ndim < 2:
            return Rule(False, f"matches include pattern {p!r} but is {ndim}-D, not a matrix")
        return Rule(True, f"matches include pattern {p!r}")
    tag = getattr(param, _TAG, None)
    if isinstance(tag, Rule):
        return tag
    if ndim < 2:
        return Rule(False, f"{ndim}-D tensor (bias/norm), not a matrix")
    if (p := _search(DEFAULT_EXCLUDE, name)) is not None:
        return Rule(False, "embedding or output head (name)")
    if ndim > 2:
        return Rule(False, f"{ndim}-D tensor: include it by name to whiten it as a stack of matrices")
    if name is None:
        return Rule(True, "2-D tensor, name unknown (pass named_parameters() or tag_model(model))")
    return Rule(True, "2-D weight matrix")


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def rule_of(name: str | None, member: Member, forced: bool | None, split_fused: bool,
            include: Sequence[str], exclude: Sequence[str]) -> tuple[Rule, Form | None]:
    """The rule of one logical parameter and why: its group's ``use_swan`` where given (``forced``; a
    matrix only), else :func:`classify`; its fused parts and stored form described in the reason. Also
    the form the optimizer keeps for a SWAN matrix stored otherwise than one plain matrix (transposed,
    fused, stacked), else ``None``."""
    shape = member.shape
    if forced is not None:
        rule = Rule(bool(forced), f"param group use_swan={bool(forced)}")
        if rule.use_swan and len(shape) < 2:
            raise ValueError(f"param group use_swan=True but {name or 'a parameter'} is {len(shape)}-D")
    else:
        rule = classify(name, member, include, exclude)
    if rule.use_swan and member.parts:
        rule = Rule(True, f"{rule.reason}; " + (f"whitened as {member.parts}" if split_fused else
                                                 f"fused {member.parts} whitened whole (split_fused=False)"))
    form = tagged_form(member)
    if not rule.use_swan or form is None:
        return rule, None
    words = form.describe(split_fused)
    if words:
        rule = Rule(True, words if rule.reason == form.what else f"{rule.reason}; {words}")
    return rule, form if (form.transposed or form.split or form.stack) else None


def clean_name(name: str) -> str:
    """A parameter name without the wrapper components FSDP1, activation checkpointing and
    torch.compile insert (``_fsdp_wrapped_module.layers.0...`` → ``layers.0...``)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tag_model(
    model: nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> dict[str, Rule]:
    """Decide each parameter's rule from module types and names, and leave the decision on the
    parameter itself so that optimizers built from bare parameters (DeepSpeed, DDP) still know it.

    ``nn.Linear`` weights get SWAN unless named like an output head or shared with an embedding;
    ``nn.Embedding`` weights, norms and biases take the fallback rule. Where an adapter recognises the
    module type (:meth:`~swan_dist.adapter.Adapter.form`: a weight stored ``(in, out)``, fused Q/K/V or
    gate/up projections, stacked MoE experts) the :class:`~swan_dist.adapter.Form` is left on the
    parameter too, and a recognised 3-D expert stack is whitened per expert. Returns ``{name: Rule}``.
    """
    return _tag(model, include, exclude)[0]


def _tag(model: nn.Module, include: Sequence[str] | None, exclude: Sequence[str] | None
         ) -> tuple[dict[str, Rule], list[tuple[str, torch.Tensor]]]:
    """:func:`tag_model`, and the tensors outside ``model.named_parameters()`` that adapters reported as
    standing for ``model``'s parameters (an enclosing FSDP1 unit's FlatParameter)."""
    # adapters record what they need on a wrapped model (FSDP1's flat views) and report tensors held outside it
    outside = prepare_model(model)
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    by_id: dict[int, tuple[nn.Module, str]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            by_id.setdefault(id(p), (mod, pname))
    aliases: dict[int, list[str]] = {}  # every name of a parameter shared between modules (tied weights)
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(clean_name(name))
    rules: dict[str, Rule] = {}
    for name, p in [*model.named_parameters(), *outside]:
        members = members_of(p, clean_name(name))
        if len(members) == 1 and members[0].holder is p:  # the tensor is the parameter: its module is known
            mod, pname = by_id[id(p)]
            members = [Member(clean_name(name), members[0].shape, p, mod, pname, id(p) in embed_ids, members[0].parts,
                              members[0].form)]
        for t in members:
            name, mod, pname = t.name, t.module, t.param_name
            form = t.form
            if form is None and mod is not None and pname is not None and not t.embedding:
                form = form_of(mod, pname, t.shape)
            rule = classify(name, t, include, exclude)
            user_matched = _search(exclude, name) or _search(include, name)
            if not user_matched:
                if t.embedding:
                    tied = [a for a in aliases.get(id(t.holder), ()) if a != name]
                    rule = Rule(False, "nn.Embedding weight" + (f" (tied with {', '.join(tied)})" if tied else ""))
                elif form is not None and form.whiten is not None and not _search(DEFAULT_EXCLUDE, name):
                    rule = Rule(form.whiten, form.what)
                elif form is not None and form.what and len(t.shape) == 2 and rule.use_swan:
                    rule = Rule(True, form.what)  # e.g. "Conv1D weight (in, out): whitened transposed"
                elif isinstance(mod, nn.Linear) and pname == "weight" and rule.use_swan:
                    rule = Rule(True, "nn.Linear weight")
                elif len(t.shape) == 2 and rule.use_swan:
                    rule = Rule(True, f"2-D weight of {type(mod).__name__}")
            setattr(t.holder, _TAG, rule)
            setattr(t.holder, _NAME_TAG, name)
            setattr(t.holder, _FORM_TAG, form)
            rules[name] = rule
    return rules, outside


def param_groups(
    model: nn.Module,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    **group_options,
) -> list[dict]:
    """Tag ``model``'s parameters (:func:`tag_model`) and return one named param group for SWAN.
    Extra keyword arguments become group options (``fallback="sign"``, ``weight_decay=0.1``, ...)."""
    _, outside = _tag(model, include, exclude)
    named = [(clean_name(n), p) for n, p in [*model.named_parameters(), *outside] if p.requires_grad]
    return [{"params": [p for _, p in named], "param_names": [n for n, _ in named], **group_options}]


def tagged_name(param: torch.Tensor) -> str | None:
    """The name :func:`tag_model` recorded on a parameter, if any."""
    return getattr(param, _NAME_TAG, None)


def tagged_form(member: Member) -> Form | None:
    """The :class:`~swan_dist.adapter.Form` of a logical parameter: its own, or the one :func:`tag_model`
    left on its holder."""
    return member.form if member.form is not None else getattr(member.holder, _FORM_TAG, None)


def collapse_name(name: str) -> str:
    """``layers.0.attention.wq.weight`` → ``layers.*.attention.wq.weight`` for compact summaries."""
    return re.sub(r"(^|\.)\d+(?=\.)", r"\1*", name)
