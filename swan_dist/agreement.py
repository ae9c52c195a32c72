"""What every rank must agree on before a step, reached from the same data so that all take the same
collective path: the structure (every parameter's record: name, shape, layout, dtype, rule and the
options that shape the computation), every rank's ranges, the scalar options a scheduler may change
(``lr``, ``alpha``, ...), each parameter's gradient code, and whether some rank failed before the
step could start. A disagreement raises the same error on every rank, naming the rank and the key.
"""

from __future__ import annotations

import enum
import operator
import warnings
import zlib
from collections import defaultdict
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .adapter import Piece
from .collectives import all_gather, all_reduce_max, assemble, gather_objects, host_tensor, is_fake
from .functional import _compile_wanted, resolve_dtype
from .records import Descriptor, Entry, GradCode
from .rules import SCALAR_KEYS

__all__ = ["agree", "Agreed", "engine_descriptor", "StepAgreement", "Verdict", "Hashes", "grad_codes",
           "raise_rank_failure", "raise_structure_mismatch", "raise_scalar_mismatch", "raise_sharded", "scalar_hash",
           "nonfinite_grads", "gather_names", "nonfinite_update"]

_MASK = (1 << 30) - 1  # hashes travel in int32 tensors, negated too: keep them well inside its range


class Verdict(enum.Enum):
    """What the ranks found when they agreed on a step, alike on every rank."""

    OK = "ok"
    FAILED = "failed"  # some rank could not list its pieces or its options are invalid
    MISMATCH = "mismatch"  # structures (records, engine settings) differ
    SCALARS = "scalars"  # scalar options differ


class StepAgreement:
    """What the ranks agree on before a step. Where every rank agreed before (:attr:`agreed` is set, alike
    on every rank), the steady step's :meth:`fast`: one ``all_reduce(MAX)`` of ``[changed, s, -s,
    codes...]`` whose result stays on the device: ``changed`` is set by a rank whose structure or ranges
    differ from what was last agreed (re-sharding, ZeRO-3's alternating sub-groups) or that failed; ``s``
    is a hash of the scalar options (max of ``s`` and of ``-s`` differ exactly when some rank's scalars
    differ); ``codes`` per parameter (:class:`GradCode`) come back as their max over ranks. The step runs
    masked by that verdict and reads it once, in its closing status; where it did not hold, the step
    changed nothing and is run again after :meth:`full`. :meth:`full` (the first step, after a change):
    every rank's ``[structure, layout, count, failed, scalars]`` gathered and read, the layouts kept.
    """

    def __init__(self) -> None:
        self.agreed: tuple[int, int, int] | None = None  # this rank's (structure, layout, count) last agreed
        self.layouts: tuple[int, ...] = ()  # every rank's layout hash, as last agreed

    def fast(self, codes: Tensor, structure: int, layout: int, scalars: int, group,
             failed: bool = False) -> tuple[Tensor, Tensor, bool]:
        """``(held, codes, blind)``: ``held`` a 0-d bool on the device, whether every rank's structure,
        ranges and scalars are as last agreed and none failed; the max code per parameter (last agreed
        count) on the device; ``blind``: this rank knows it differs (it takes part in the step's collectives
        without updating anything). No host read."""
        n = self.agreed[2]
        blind = failed or (structure, layout, codes.numel()) != self.agreed
        scalars &= _MASK
        body = codes[:n] if codes.numel() >= n else torch.cat([codes, codes.new_zeros(n - codes.numel())])
        head = host_tensor([int(blind), scalars, -scalars], codes.dtype, codes.device)
        out = all_reduce_max(torch.cat([head, body]), group)
        return (out[0] == 0) & (out[1] == -out[2]), out[3:], blind

    def full(self, codes: Tensor, structure: int, layout: int, scalars: int, group,
             failed: bool = False) -> tuple[Verdict, Tensor | None]:
        """``codes``: int32, one per parameter, on the communication device. Returns ``(Verdict.OK, max code
        per parameter)`` (on the device), or another verdict and ``None``, on every rank alike."""
        mine = (structure, layout, codes.numel())
        scalars &= _MASK
        head = torch.tensor([structure, layout, codes.numel(), int(failed), scalars], dtype=torch.int64,
                            device=codes.device)
        table = all_gather(head, group)
        self.agreed = None
        if table[:, 3].any():
            return Verdict.FAILED, None
        if (table[:, 0] != table[0, 0]).any() or (table[:, 2] != table[0, 2]).any():
            return Verdict.MISMATCH, None
        if (table[:, 4] != table[0, 4]).any():
            return Verdict.SCALARS, None
        self.agreed, self.layouts = mine, tuple(table[:, 1].tolist())
        return Verdict.OK, all_reduce_max(codes.clone(), group)


def engine_descriptor(mode: str, bucket_mb: float, device: torch.device, records: Sequence,
                      exchange_dtype: str = "auto") -> Descriptor:
    """The engine's part of the structure every rank must agree on, shaped like a record's descriptor so
    that a difference names its setting: mode, bucket bound, the exchange's dtype choice and device type, the
    whitening dtypes ``auto`` resolves to there (decided per process: the CPU's bf16 support, ``SWAN_DIST_CPU_BF16``)
    and whether ``torch.compile`` runs (``SWAN_DIST_COMPILE``, or a compile that failed on some rank)."""
    dtypes = sorted({str(resolve_dtype(r.cfg, device)) for r in records if r.cfg is not None})
    return Descriptor("<engine>", (), (), "", (("mode", repr(mode)), ("bucket_mb", repr(bucket_mb)),
                                               ("exchange_dtype", repr(exchange_dtype)), ("device", device.type),
                                               ("whiten_dtype (resolved)", repr(dtypes)),
                                               ("compile", repr(_compile_wanted(device)))))


class Agreed(NamedTuple):
    """What a step runs with: the max :class:`GradCode` per entry (on the device), the plan key (``None``
    at W=1), whether the agreement held (a 0-d bool on the device; ``None``: it held, known on the host)
    and whether this rank takes part blind (it knows it differs: it updates nothing)."""

    codes: Tensor
    key: tuple | None
    held: Tensor | None
    blind: bool


def agree(entries: list[Entry], failure: BaseException | None, ctx, memo, groups: Sequence[dict]) -> Agreed:
    """The step's :class:`Agreed`, or every rank raises the same error. ``ctx``: the step's
    :class:`~swan_dist.engine.StepContext`; ``memo``: the agreement and hashes kept for this set of entries
    (:class:`~swan_dist.engine.EngineMemo`); ``groups``: the param groups whose scalar options every rank
    must share. A steady step: one ``all_reduce``, nothing read on the host."""
    pieces = [e.piece for e in entries]
    codes = grad_codes(pieces, ctx.device or (pieces[0].param.device if pieces else None))
    part = [i for i, e in enumerate(entries) if e.record.use_swan and not e.piece.whole] if ctx.mode == "local" else []
    if part:
        raise_sharded([entries[i].record.name for i in part])
    if ctx.world == 1:
        return Agreed(codes, None, None, False)
    records = [e.record for e in entries]
    engine = engine_descriptor(ctx.mode, ctx.bucket_mb, ctx.device, records, ctx.exchange_dtype)
    structure = memo.hashes.structure(records, engine)
    layout = memo.hashes.layout(pieces)
    if is_fake(codes) and memo.agreement.agreed is None:  # a trace (torch's fake process group, fake tensors):
        # the full agreement reads every rank's table, which a trace cannot; every rank is taken to agree, so
        # that the steps traced after it run the steady step's agreement, as real ones do
        memo.agreement.agreed, memo.agreement.layouts = (structure, layout, codes.numel()), (layout,) * ctx.world
        return Agreed(codes, (structure, memo.agreement.layouts), None, False)
    if memo.agreement.agreed is not None:
        held, flags, blind = memo.agreement.fast(codes, structure, layout, scalar_hash(groups), ctx.group,
                                                 failure is not None)
        return Agreed(flags, (memo.agreement.agreed[0], memo.agreement.layouts), held, blind)
    verdict, flags = memo.agreement.full(codes, structure, layout, scalar_hash(groups), ctx.group,
                                         failure is not None)
    if verdict is Verdict.FAILED:
        raise_rank_failure(failure, ctx.group)
    if verdict is Verdict.MISMATCH:
        raise_structure_mismatch([r.descriptor for r in records] + [engine], ctx.group)
    if verdict is Verdict.SCALARS:
        raise_scalar_mismatch(groups, ctx.group)
    return Agreed(flags, (structure, memo.agreement.layouts), None, False)


def raise_sharded(names: list[str]) -> None:
    raise ValueError(
        f"swan_dist: {names[:4]} are sharded; mode='local' needs whole matrices on every rank "
        "(use mode='owner' or 'replicated')")


def _crc(obj) -> int:
    return zlib.crc32(repr(obj).encode()) & _MASK


def scalar_rows(groups: Sequence[dict]) -> list[tuple]:
    """Per param group, its scalar options as compared between ranks."""
    return [tuple((k, _shown(g.get(k))) for k in SCALAR_KEYS) for g in groups]


def _shown(value) -> str:
    """An option as compared between ranks; a tensor (``lr``, ``alpha``, ``weight_decay`` with
    ``capturable=True``) by its kind only, its value never read in the step (every rank sets it alike)."""
    if isinstance(value, Tensor):
        return f"<tensor {value.dtype}>"
    if isinstance(value, (tuple, list)):
        return repr(tuple(_shown(v) if isinstance(v, Tensor) else v for v in value))
    return repr(value)


def scalar_hash(groups: Sequence[dict]) -> int:
    return _crc(scalar_rows(groups))


class Hashes:
    """The structure and layout hashes, recomputed only when the records or pieces are other objects
    than last step's (records are immutable and cached; a reused piece is the same object)."""

    def __init__(self) -> None:
        self._structure: tuple | None = None
        self._layout: tuple | None = None

    def structure(self, records: list, extra: tuple) -> int:
        last = self._structure
        if last is not None and last[1] == extra and len(last[0]) == len(records) and all(
                map(operator.is_, last[0], records)):
            return last[2]
        h = _crc([r.descriptor for r in records] + [extra])
        self._structure = (records, extra, h)
        return h

    def layout(self, pieces: list[Piece]) -> int:
        last = self._layout
        if last is not None and len(last[0]) == len(pieces) and all(map(operator.is_, last[0], pieces)):
            return last[1]
        h = _crc([(pc.lo, pc.hi) for pc in pieces])
        self._layout = (pieces, h)
        return h

    def clear(self) -> None:
        """Forget the pieces (they hold gradient views until released)."""
        self._layout = None


def raise_rank_failure(failure: BaseException | None, group) -> None:
    """Every rank calls this together: the first failing rank's error, raised on all (the failing rank
    raises its own exception; the others an error of the same kind where it is a ``ValueError`` or
    ``TypeError``, a ``RuntimeError`` otherwise, naming the rank, the type and the message)."""
    mine = None if failure is None else (type(failure).__name__, str(failure))
    rank, (kind, msg) = next((r, f) for r, f in enumerate(gather_objects(mine, group)) if f is not None)
    if failure is not None and rank == dist.get_rank(group):
        raise failure
    cls = {"TypeError": TypeError, "ValueError": ValueError, "FloatingPointError": FloatingPointError,
           "OutOfMemoryError": torch.OutOfMemoryError}.get(kind, RuntimeError)
    raise cls(f"swan_dist: on rank {rank}: {kind}: {msg}")


def raise_structure_mismatch(descriptors: list[Descriptor], group) -> None:
    """Every rank calls this together (same gathered descriptors) and raises the same error."""
    everyone = gather_objects(descriptors, group)
    ref = everyone[0]
    for rank, desc in enumerate(everyone):
        if len(desc) != len(ref):
            raise ValueError(f"swan_dist: rank {rank} has {len(desc) - 1} parameters, rank 0 has {len(ref) - 1}")
        for a, b in zip(ref, desc):
            if a != b:
                diff = [k for (k, va), (_, vb) in zip(a.options, b.options) if va != vb]
                what = f"key(s) {diff}" if diff else f"{(a.shape, a.layout, a.dtype)} vs {(b.shape, b.layout, b.dtype)}"
                raise ValueError(
                    f"swan_dist: optimizer config differs between rank 0 and rank {rank} for parameter "
                    f"{a.name!r} vs {b.name!r}: {what}"
                )
    raise ValueError("swan_dist: optimizer config differs between ranks")


def raise_scalar_mismatch(groups: Sequence[dict], group) -> None:
    """Every rank calls this together: the first scalar option that differs from rank 0's, named."""
    everyone = gather_objects(scalar_rows(groups), group)
    ref = everyone[0]
    for rank, rows in enumerate(everyone):
        if len(rows) != len(ref):
            raise ValueError(f"swan_dist: rank {rank} has {len(rows)} param groups, rank 0 has {len(ref)}")
        for gi, (a, b) in enumerate(zip(ref, rows)):
            for (key, va), (_, vb) in zip(a, b):
                if va != vb:
                    raise ValueError(
                        f"swan_dist: {key!r} differs between rank 0 ({va}) and rank {rank} ({vb}) in param group "
                        f"{gi}; every rank must set the same hyper-parameters (an lr scheduler stepped on every "
                        "rank alike, the same config)")
    raise ValueError("swan_dist: hyper-parameters differ between ranks")


def nonfinite_grads(named: list[tuple[str, str]], codes: list[int]) -> list[str]:
    """Called once a step's status says some gradient was not finite (``named``: the step's (name,
    nonfinite option) per entry; ``codes``: the agreed codes, read): the names of those parameters;
    raises ``FloatingPointError`` where one of them is in a ``nonfinite="raise"`` group (nothing was
    updated), else warns (``skip``: those parameters were left unchanged; ``skip_step``: every parameter
    was)."""
    bad = [i for i, c in enumerate(codes) if c == GradCode.NONFINITE]
    names = [named[i][0] for i in bad]
    if not bad:
        return names
    modes = {named[i][1] for i in bad}
    if "raise" in modes:
        raise FloatingPointError(
            f"SWAN: non-finite gradient in {names[:8]}{' ...' if len(names) > 8 else ''}; "
            "no parameter was updated"
        )
    if "skip_step" in modes:
        warnings.warn(f"SWAN: non-finite gradient in {names[:8]}: step skipped, no parameter updated", RuntimeWarning)
    else:
        warnings.warn(f"SWAN: non-finite gradient, update skipped for {names[:8]}", RuntimeWarning)
    return names


def gather_names(names: list[str], group) -> list[str]:
    """Every rank's names, in rank order, each once."""
    return list(dict.fromkeys(n for ns in gather_objects(names, group) for n in ns))


def nonfinite_update(named: list[tuple[str, str]], names: list[str]) -> None:
    """SWAN matrices whose whitened update was not finite (made inside NS/NSDS, or owed by an owner that
    failed): not applied on any rank; every rank raises ``FloatingPointError`` where one of them is in a
    ``nonfinite="raise"`` group, else warns. The other parameters of the step were updated. ``named``: the
    step's (name, nonfinite option) per entry."""
    bad = set(names)
    if any(mode == "raise" for name, mode in named if name in bad):
        raise FloatingPointError(
            f"SWAN: non-finite whitened update for {names[:8]}{' ...' if len(names) > 8 else ''}; not applied to "
            "them (the step's other parameters were updated)")
    warnings.warn(f"SWAN: non-finite whitened update, not applied to {names[:8]}", RuntimeWarning)


# ------------------------------------------------------------------------------------ gradient codes
def grad_codes(pieces: list[Piece], device: torch.device | None) -> Tensor:
    """Per piece its :class:`GradCode` (none, finite, NaN/Inf) as an int32 tensor on ``device`` (the
    communication device; the CPU without one), computed without a device sync: one foreach reduction
    per device and dtype (:func:`_finite`)."""
    device = torch.device(device or "cpu")
    by_kind: defaultdict = defaultdict(list)
    for i, pc in enumerate(pieces):
        g = pc.grad
        if g is not None:
            by_kind[(g.device, g.dtype, g.layout is torch.strided and g.numel() > 0)].append((i, g))
    parts = []
    for (_, _, foreach), items in by_kind.items():
        grads = [g for _, g in items]
        # empty or sparse gradients: one check each
        finite = _finite(grads) if foreach else torch.stack([g.isfinite().all() for g in grads])
        codes = int(GradCode.NONFINITE) - finite.to(device, torch.int32)  # FINITE where finite
        if len(items) == len(pieces):
            return codes
        parts.append(([i for i, _ in items], codes))
    return assemble(len(pieces), parts, torch.zeros((), dtype=torch.int32, device=device))  # NONE elsewhere


def _finite(grads: list[Tensor]) -> Tensor:
    """Whether each gradient (strided, non-empty, all on one device with one dtype) is all finite, as a
    bool tensor on that device, with no host read. On an accelerator: one foreach max-abs reduction,
    which NaN and Inf survive and finite values never overflow. On the CPU (where a max-abs reduction is
    several times slower): each gradient's min and max, which NaN and Inf reach alike; small gradients of
    one size stacked and reduced together (one call for many, as the foreach kernel does)."""
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite()
    parts, small, big = [], defaultdict(list), []
    for i, g in enumerate(grads):
        (small[g.numel()] if g.numel() <= _SMALL else big).append(i)
    for n, idx in small.items():
        per = max(1, _STACK // n)
        for k in range(0, len(idx), per):
            chunk = idx[k:k + per]
            rows = torch.stack([_flat(grads[i]) for i in chunk])  # (amax, amin per row: faster than aminmax)
            parts.append((chunk, rows.amax(1).isfinite() & rows.amin(1).isfinite()))
    if big:
        parts.append((big, torch.stack([torch.stack(torch.aminmax(grads[i].reshape(-1))) for i in big]).isfinite().all(1)))
    if len(parts) == 1 and parts[0][0] == list(range(len(grads))):
        return parts[0][1]
    return assemble(len(grads), parts, torch.zeros((), dtype=torch.bool))


def _flat(t: Tensor) -> Tensor:
    return t if t.dim() == 1 else t.reshape(-1)  # (a piece's gradient is flat already: no reshape call)


# CPU finite check: gradients of at most _SMALL elements are stacked by size, _STACK elements per stack
_SMALL, _STACK = 1 << 16, 1 << 22
