"""The engine's boundary: how a framework tells the optimizer where each rank's piece of each matrix lives.

A framework is one :class:`Adapter` subclass in one file of ``integrations/`` plus one line in
``integrations/__init__.py``'s ``ADAPTERS``. The optimizer, the planner and the exchange never import a framework:
they ask the registry (:func:`adapter_for`, :func:`adopt`, :func:`prepare_model`, ...) and work on
:class:`Piece` records. docs/engine.md walks through adding an adapter.

An adapter answers, for the tensors it claims:

- ``members``: the logical parameters a tensor stands for, for classification (name, full shape,
  module); one per tensor, except a tensor that packs several (an FSDP1 ``FlatParameter``);
- ``pieces``: this rank's :class:`Piece` of each member (at every step);
- ``adopt``: pieces for a param group whose tensors the framework replaced after the optimizer was
  built (DeepSpeed's flat fp32 partitions);
- ``export_state`` / ``import_state``: the fallback state in its framework's checkpoint layout.

and, for the module types it knows (whoever claims their tensors), ``form``: how a module's parameter
maps to matrices (:class:`Form`: stored ``(in, out)``, fused parts, experts stacked), which the
optimizer applies to any adapter's pieces.

Pieces that are a tensor itself (``tensor_piece`` of it: its whole storage flat, its gradient flat) are
reused from step to step while the tensor keeps its storage, shape, strides and dtype: only the
gradient views are re-pointed (:func:`reusable`, :func:`repoint`). An adapter whose pieces depend on
anything else sets ``reuse_pieces = False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .layout import ROW_MAJOR, Layout
from .collectives import is_fake

__all__ = ["Adapter", "Form", "Member", "Piece", "StateSlot", "adapter_for", "members_of", "adopt", "prepare_model",
           "form_of", "flat_piece",
           "name_bare_params", "optimizer_built", "reusable", "repoint", "registry_token", "tensor_key"]


@dataclass(frozen=True)
class StateSlot:
    """Where a fallback piece keeps its state: ``optimizer.state[key]``.

    ``index=None``: whole state tensors shaped like the piece's ``target`` and one ``step``. Otherwise
    the piece shares ``key``'s state with others: elements ``[a, b)`` of flat state tensors of ``size``
    elements, and step counter ``index`` of ``counts`` (each piece skipped or stepped alone).
    """

    key: Tensor
    index: int | None = None
    a: int = 0
    b: int = 0
    size: int = 0
    counts: int = 0


@dataclass
class Piece:
    """This rank's piece of one logical parameter.

    Engine side: elements ``[lo, hi)`` of the parameter of full ``shape`` numbered in ``layout``'s
    canonical order (plain row-major unless a tensor-parallel split says otherwise), with flat views
    ``param`` and ``grad`` (``None``: no gradient on this rank) of those elements. ``split``: the
    matrix fuses several (Megatron's QKV, a SwiGLU ``fc1``), whitened as separate parts.
    Fallback side: the rule updates ``target`` from ``target_grad`` with its state at ``slot``
    (the framework's own tensor, e.g. a DTensor, so that its state has the framework's type).
    """

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    param: Tensor
    grad: Tensor | None
    target: Tensor
    target_grad: Tensor | None
    slot: StateSlot
    layout: Layout = ROW_MAJOR
    split: tuple[int, ...] = ()  # a fused matrix's row pattern: its parts are whitened apart (layout.split_rows)
    staged: Tensor | None = None  # a non-contiguous tensor ``param`` copies: written back after SWAN's update

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == math.prod(self.shape)


def _address(t: Tensor):
    """Where ``t``'s data starts: its data pointer; for a fake tensor (no data,
    :func:`~swan_dist.collectives.is_fake`) its storage's identity and offset."""
    if is_fake(t):
        return t.untyped_storage()._cdata, t.storage_offset() * t.element_size()
    return t.data_ptr()


def tensor_piece(name: str, p: Tensor, shape: tuple[int, ...] | None = None, lo: int = 0,
                 local: Tensor | None = None, grad: Tensor | None = None, layout: Layout = ROW_MAJOR,
                 split: tuple[int, ...] = ()) -> Piece:
    """A piece whose fallback target is the tensor ``p`` itself (state in ``optimizer.state[p]``); the
    engine sees ``local`` (default ``p``) flattened as elements ``[lo, lo + numel)`` of ``shape``."""
    local = p if local is None else local
    flat = local.detach().reshape(-1)
    # a non-contiguous tensor (a transpose, a strided slice) has no flat view: the engine works on a
    # contiguous copy, made anew each step (such a piece is never reused), written back after SWAN's update;
    # the fallback rule updates the tensor itself (``target``)
    staged = local.detach() if flat.numel() and _address(flat) != _address(local.detach()) else None
    g = None if grad is None else grad.reshape(-1)
    return Piece(name, tuple(p.shape) if shape is None else tuple(shape), lo, lo + flat.numel(), flat, g,
                 p, p.grad, StateSlot(p), layout, tuple(split), staged)


def flat_piece(name: str, shape: Sequence[int], lo: int, flat: Tensor, start: int = 0, n: int | None = None,
               slot: StateSlot | None = None, layout: Layout = ROW_MAJOR, split: Sequence[int] = ()) -> Piece:
    """Elements ``[lo, lo + n)`` of a parameter of full ``shape`` held contiguously at ``[start, start + n)``
    of the 1-D buffer ``flat`` (``n`` default: the rest of it), a framework's flat partition or shard.

    The piece is a view of that range, for the engine and the fallback rule alike, and its gradient the
    same range of ``flat.grad``, so updates land in the framework's own buffer. Its state defaults to
    the buffer's (``optimizer.state[flat]``); ``slot`` places it elsewhere (a span of a packed buffer's
    compact state). ``n = 0`` is the piece of a rank that holds none of the parameter."""
    n = flat.numel() - start if n is None else n
    view = flat.detach().narrow(0, start, n)
    grad = None if flat.grad is None else flat.grad.narrow(0, start, n)
    return Piece(name, tuple(shape), lo, lo + n, view, grad, view, grad, StateSlot(flat) if slot is None else slot,
                 layout, tuple(split))


@dataclass(frozen=True)
class Form:
    """How a stored parameter maps to the matrices SWAN whitens, recognised from its module's type by an
    adapter (:meth:`Adapter.form`) and shown in the optimizer's summary.

    ``transposed``: stored ``(..., in, out)`` (Transformers' ``Conv1D``, transposed MoE experts): the
    matrix in the paper's orientation ``(..., out, in)`` is its transpose (``Layout.transposed``).
    ``split``: row pattern of that matrix's parts (``layout.split_rows``; fused Q, K, V or gate, up),
    each whitened apart unless the group says ``split_fused=False``; ``parts`` names them.
    ``what``: the layout recognised and why (or why a fused layout is whitened whole).
    ``whiten``: ``None`` leaves the rule to the usual classification; ``True`` makes a recognised stack
    (3-D experts, each expert a matrix) SWAN's; ``False`` puts it on the fallback (``what`` says why).
    ``stack``: a 2-D tensor ``(E·r, c)`` stacking ``E`` matrices along its rows (DBRX's experts) is
    whitened as the stack ``(E, r, c)`` (the same elements in the same order), each matrix alone.
    """

    transposed: bool = False
    split: tuple[int, ...] = ()
    stack: int = 0
    parts: str = ""
    what: str = ""
    whiten: bool | None = None

    def describe(self, split_fused: bool = True) -> str:
        """The summary's words for this form (orientation, then split)."""
        if not (self.split and self.parts):
            return self.what
        part = f"as {self.parts}" if split_fused else f"fused {self.parts} whitened whole (split_fused=False)"
        return f"{self.what}, {part}" if self.what else f"whitened {part}" if split_fused else part


@dataclass
class Member:
    """A logical parameter as the classifier sees it. ``holder`` carries the rule tag
    (:func:`swan_dist.tag_model`): the tensor itself, or a record standing for a packed original."""

    name: str | None
    shape: tuple[int, ...]
    holder: Any
    module: nn.Module | None = None
    param_name: str | None = None
    embedding: bool = False
    parts: str = ""  # a fused matrix whitened as parts: what they are, for the summary ("Q, K, V per query group")
    form: Form | None = None  # orientation and split recognised from the module type (Adapter.form)


class Adapter:
    """One framework's answers. Override :meth:`claims` and :meth:`pieces`; the rest have defaults that
    suit a framework whose tensors are the parameters themselves."""

    name = "adapter"
    # Whether a piece that is this adapter's tensor itself (see :func:`reusable`) may be reused at later
    # steps while the tensor keeps its storage, shape, strides and dtype, its gradient views re-pointed.
    # True suits adapters whose ``pieces`` depend only on the tensor, its gradient and metadata fixed when
    # the model was wrapped (every in-tree adapter); set False otherwise.
    reuse_pieces = True

    def prepare(self, model: nn.Module) -> Sequence[tuple[str, Tensor]] | None:
        """Record on a wrapped model's parameters what :meth:`pieces` needs (called by ``tag_model``).
        Returns the (name, tensor) pairs, if any, that stand for parameters of ``model`` but are not among
        ``model.named_parameters()`` (an enclosing FSDP1 unit's FlatParameter packing originals of
        ``model`` only): the optimizer built from ``model`` manages them too."""
        return None

    def name_bare(self, params: Sequence[Tensor]) -> nn.Module | None:
        """For bare, untagged tensors given to the optimizer: the module that owns them, if this
        framework knows it (DeepSpeed's engine building the optimizer from its JSON)."""
        return None

    def optimizer_built(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once per optimizer after construction (register the class with the framework)."""

    def step_key(self, params: Sequence[Tensor]) -> tuple | None:
        """Where this framework steps a model's parts in turn (ZeRO-3's sub-groups, one ``step()`` each):
        a name of the part ``params`` (the optimizer's tensors at this step) stand for, alike on every rank,
        so that each part keeps its own agreement and plans; ``None`` otherwise."""
        return None

    def claims(self, tensor: Tensor) -> bool:
        raise NotImplementedError

    def members(self, tensor: Tensor, name: str | None) -> list[Member]:
        return [Member(name, self.shape(tensor), tensor)]

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        """The full logical shape of ``tensor``, whatever piece of it this rank holds."""
        return tuple(tensor.shape)

    def form(self, module: nn.Module, param_name: str, shape: tuple[int, ...]) -> Form | None:
        """How parameter ``param_name`` (full ``shape``, as stored) of ``module`` maps to matrices, if this
        framework knows the module type (orientation, fused parts, stacked experts); ``None`` otherwise.
        Asked by ``tag_model`` for every parameter whose module it knows; must be decided from the module
        and its configuration alone (alike on every rank)."""
        return None

    def check(self, tensor: Tensor, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` if this tensor's layout is not supported (at construction,
        decided from what every rank sees alike)."""

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's elements of ``tensor`` (a parameter this adapter claims, its gradient, or a state
        tensor made like it), as a tensor sharing its storage that an elementwise rule (the fallback) may
        update in place instead: a plain tensor lets it use torch's foreach/fused kernels directly."""
        return tensor

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        """This rank's piece of each member of ``tensor`` (``rules``: SWAN or not, per member)."""
        raise NotImplementedError

    def peer_ranges(self, tensor: Tensor, piece: Piece, world: int) -> list[tuple[int, int]] | None:
        """Every rank's range ``[lo, hi)`` of ``piece``'s parameter (rank order over the optimizer's group
        of ``world``), where this rank can know it without asking (the layout a function of the rank), else
        ``None``. Used only where ranges cannot be gathered: torch's fake process group, one rank simulated
        to estimate a step's memory. Default: a whole tensor is whole on every rank (replicated)."""
        return [(piece.lo, piece.hi)] * world if piece.whole else None

    def adopt(self, originals: list[tuple[str, Tensor]], params: list[Tensor], use_swan: bool, index: int,
              group: Any) -> list[Piece] | None:
        """Pieces for param group ``index`` whose tensors ``originals`` the framework replaced by
        ``params``; ``None`` if this framework did not do it: claim only a layout that really is this
        framework's (an original is ``None`` where nothing holds it any more)."""
        return None

    def export_state(self, tensor: Tensor, state: dict, rules: tuple[bool, ...], stateful: set[int]) -> dict:
        """``tensor``'s optimizer state as its framework's checkpoint code expects it. ``stateful``: ids
        of the tensors whose rule keeps state (AdamW fallback)."""
        return state

    def import_state(self, tensor: Tensor, state: dict, rules: tuple[bool, ...]) -> dict:
        """Inverse of :meth:`export_state` for a loaded state."""
        return state


def _registry() -> Sequence[Adapter]:
    from swan_dist.integrations import ADAPTERS  # the one place adapters are registered

    return ADAPTERS


def registry_token() -> Sequence[Adapter]:
    """The registry as it stands: pieces kept from a step are reused only under the same registry."""
    return _registry()


def tensor_key(adapter: Adapter, tensor: Tensor) -> tuple:
    """What a reused piece of ``tensor`` depends on: its local storage (:meth:`Adapter.local`: a DTensor's
    shard), shape, strides and dtype."""
    local = adapter.local(tensor)
    return _address(local), tensor.shape, local.stride(), tensor.dtype


def reusable(adapter: Adapter, tensor: Tensor, pieces: Sequence[Piece]) -> bool:
    """Whether ``pieces`` (just made by ``adapter`` for ``tensor``) are the tensor itself, so that a later
    step may reuse them with :func:`repoint` while :func:`tensor_key` of the tensor is unchanged: one
    piece, target and state slot the tensor, ``param`` its whole local storage flat, ``grad`` its local
    gradient flat (checked against the gradient there is now; without one nothing is known, so no reuse)."""
    if not adapter.reuse_pieces or len(pieces) != 1:
        return False
    pc, g = pieces[0], tensor.grad
    try:
        if g is None or pc.grad is None or g.layout is not torch.strided:
            return False
        local, local_g = adapter.local(tensor), adapter.local(g)
        return (
            pc.target is tensor and pc.target_grad is g and pc.slot.key is tensor and pc.slot.index is None
            and local.layout is torch.strided and local_g.layout is torch.strided and local.numel() > 0
            and pc.param.dim() == 1 and pc.grad.dim() == 1
            and pc.param.numel() == local.numel() == pc.hi - pc.lo and _address(pc.param) == _address(local)
            and pc.grad.numel() == local_g.numel() and _address(pc.grad) == _address(local_g)
        )
    except (RuntimeError, NotImplementedError, AttributeError):  # tensors without storage (wrapper subclasses)
        return False


def repoint(adapter: Adapter, piece: Piece, tensor: Tensor) -> bool:
    """Point a reusable piece at ``tensor``'s current gradient (as ``tensor_piece`` would: its local
    elements flat, ``None`` without one); False where the gradient is not a strided tensor with the
    piece's number of local elements (the adapter then answers again)."""
    g = tensor.grad
    if g is None:
        piece.grad = piece.target_grad = None
        return True
    if g.layout is not torch.strided:
        return False
    local_g = adapter.local(g)
    if local_g.numel() != piece.hi - piece.lo:
        return False
    piece.grad, piece.target_grad = local_g.reshape(-1), g
    return True


# Tensor types torch's foreach/fused kernels take without a subclass's dispatch.
PLAIN = (Tensor, nn.Parameter)


def local_of(target: Tensor, *lists: Sequence[Tensor]) -> tuple[list[Tensor], ...]:
    """``lists`` (the targets, gradients and state tensors of pieces whose targets are like ``target``)
    as the adapter claiming ``target`` gives them to elementwise rules (:meth:`Adapter.local`: a
    DTensor's local shard); as they are where ``target`` is plain or no adapter claims it."""
    adapter = None if type(target) in PLAIN else next(
        (a for a in _registry() if a.claims(target)), None)
    if adapter is None:
        return tuple(list(ts) for ts in lists)
    return tuple([adapter.local(t) for t in ts] for ts in lists)


def adapter_for(tensor: Tensor) -> Adapter:
    for adapter in _registry():
        if adapter.claims(tensor):
            return adapter
    raise TypeError(f"swan_dist: no adapter claims a tensor of type {type(tensor).__name__}")


def members_of(tensor: Tensor, name: str | None) -> list[Member]:
    return adapter_for(tensor).members(tensor, name)


def form_of(module: nn.Module, param_name: str, shape: tuple[int, ...]) -> Form | None:
    """The first adapter's :meth:`Adapter.form` answer for a module's parameter."""
    for adapter in _registry():
        if (found := adapter.form(module, param_name, tuple(shape))) is not None:
            return found
    return None


def prepare_model(model: nn.Module) -> list[tuple[str, Tensor]]:
    """Every adapter's :meth:`Adapter.prepare`; the tensors outside ``model.named_parameters()`` they report."""
    outside: list[tuple[str, Tensor]] = []
    for adapter in _registry():
        outside += adapter.prepare(model) or ()
    return outside


def name_bare_params(params: Sequence[Tensor]) -> nn.Module | None:
    for adapter in _registry():
        if (model := adapter.name_bare(params)) is not None:
            return model
    return None


def step_key(params: Sequence[Tensor]) -> tuple | None:
    """The first adapter's :meth:`Adapter.step_key` for the optimizer's tensors at a step."""
    for adapter in _registry():
        if (key := adapter.step_key(params)) is not None:
            return key
    return None


def optimizer_built(optimizer: torch.optim.Optimizer) -> None:
    for adapter in _registry():
        adapter.optimizer_built(optimizer)


def adopt(originals: list[tuple[str, Tensor | None]], params: list[Tensor], use_swan: bool, index: int,
          group: Any, shapes: Sequence[tuple[int, ...]] | None = None) -> tuple[list[Piece], bool]:
    """Pieces for a param group whose tensors a framework replaced, and whether the replacement is
    one-to-one (then the optimizer adopts the new tensors for good, keeping names and rules).

    ``originals``: the group's (name, tensor) as the optimizer was given them, the tensor ``None`` where
    nothing holds it any more (the optimizer keeps only weak references); ``shapes``: their logical
    shapes, recorded when the optimizer was built (default: asked of the live tensors).

    Adapters first (flat partitions and the like: only a layout an adapter recognises as its own);
    otherwise each new tensor of the same logical shape as its original stands for it, whatever
    adapter claims it (DeepSpeed's fp32 copies, Accelerate's sharded DTensors)."""
    for adapter in _registry():
        found = adapter.adopt(originals, params, use_swan, index, group)
        if found is not None:
            return found, False
    if shapes is None:
        shapes = [None if old is None else adapter_for(old).shape(old) for _, old in originals]
    if len(params) == len(originals) and all(s is not None for s in shapes):
        out = []
        for (name, _), shape, new in zip(originals, shapes, params):
            ad = adapter_for(new)
            if tuple(ad.shape(new)) != tuple(shape) or len(ad.members(new, name)) != 1:
                break
            ad.check(new, name)
            out += ad.pieces(new, name, (use_swan,))
        else:
            return out, True
    got = [list(adapter_for(p).shape(p)) for p in params[:3]]
    want = [None if s is None else list(s) for s in shapes[:3]]
    raise ValueError(
        f"swan_dist: param group {index}'s {len(originals)} tensors (e.g. {[n for n, _ in originals[:3]]} of shapes "
        f"{want}) were replaced by {len(params)} tensors (shapes {got}...) that are neither tensors of the same "
        "shapes, one for one, nor a layout an adapter knows; build the optimizer after the framework wraps the "
        "model, or pass the wrapped model's parameters"
    )
