"""Run a function on N real processes with torch.distributed (gloo on loopback), with a timeout.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` inside an initialised gloo process group, and returns the list of
their return values (pickled through files). An exception in any rank is re-raised with its rank;
a rank still running at the deadline fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    result: tuple
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the rank
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", type(e).__name__, str(e))
    # the result is written before teardown: what the test checks is then safe from a native library
    # aborting at exit (seen once per ~20 DeepSpeed runs: "terminate called without an active exception")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        try:  # no rank tears down while a peer still has collectives in flight
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except RuntimeError:
            pass  # a peer is gone or stuck; the parent reports it
        dist.destroy_process_group()


class RankError(RuntimeError):
    def __init__(self, results):
        self.results = results
        msgs = [f"rank {r}: {res[1]}" for r, res in enumerate(results) if res and res[0] == "error"]
        super().__init__("\n".join(msgs))


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, raw: bool = False):
    """Results per rank; with ``raw=True`` the (status, value...) tuples, errors included."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world_size, _free_port(), out_dir, fn, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"distributed test did not finish within {timeout}s (hang?)")
        except mp.ProcessExitedException:  # a rank died: fine only if it died after reporting, at teardown
            if not all(os.path.exists(os.path.join(out_dir, f"{r}.pkl")) for r in range(world_size)):
                raise
            for p in ctx.processes:
                p.join(timeout=30)
            print(f"dist_utils: a rank exited abnormally after reporting its result: {[p.exitcode for p in ctx.processes]}")
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pkl")
            results.append(pickle.load(open(path, "rb")) if os.path.exists(path) else None)
    if raw:
        return results
    if any(res is None or res[0] == "error" for res in results):
        raise RankError(results)
    return [res[1] for res in results]


# SWAN(exchange_dtype=...): the same run with each dtype the owner exchange can send, this rank's weights
# and the bytes its exchange sent. Against the fp32 exchange, bf16 rounds each gradient piece and each
# update piece to 2^-8 of its size; an update has RMS 1 (SWAN's rescale), so per step a weight moves by at
# most lr * 2^-7 more than under fp32 (twice that rounding, through the whitening). "param" sends what the
# parameters hold: equal, bit for bit, to fp32 on fp32 parameters.
EXCHANGE_DTYPES = ("param", "fp32", "bf16")
BF16_EXCHANGE_BOUND = 2 ** -7  # per step, in units of lr


def exchange_bytes(opt) -> int:
    """The bytes ``opt``'s owner exchanges sent so far, over every set of entries it stepped (ZeRO-3 steps
    its sub-groups apart)."""
    return sum(ex.bytes_sent for memo in opt._memos.values() for ex in memo.plans.cache.values())


def exchange_dtype_runs(run):
    """``{dtype: run(dtype)}`` for each of :data:`EXCHANGE_DTYPES`; ``run`` returns (this rank's weights as
    ``{name: tensor}``, the bytes its exchange sent)."""
    return {xd: run(xd) for xd in EXCHANGE_DTYPES}


def check_exchange_dtypes(per_rank, lr: float, steps: int, fp32_params: bool = True) -> float:
    """Every rank's :func:`exchange_dtype_runs`: bf16 within :data:`BF16_EXCHANGE_BOUND` of fp32 (and not
    equal to it somewhere: it rounded), sending half the bytes; ``param`` equal to fp32 on fp32 parameters.
    Returns the largest bf16 difference."""
    worst = 0.0
    for runs in per_rank:
        (w32, b32), (w16, b16), (wp, bp) = runs["fp32"], runs["bf16"], runs["param"]
        assert set(w16) == set(w32)
        for n in w32:
            assert w16[n].dtype == w32[n].dtype, n  # applied in the parameter's dtype
            if w32[n].numel():
                worst = max(worst, (w16[n].float() - w32[n].float()).abs().max().item())
            if fp32_params:
                assert torch.equal(wp[n], w32[n]), n
        assert 2 * b16 == b32, (b16, b32)
        if fp32_params:
            assert bp == b32
    assert 0 < worst <= steps * lr * BF16_EXCHANGE_BOUND, (worst, steps * lr * BF16_EXCHANGE_BOUND)
    return worst
