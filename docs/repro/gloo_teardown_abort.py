"""A finished gloo job whose rank aborts at exit, without swan_dist: FSDP2 + torch's AdamW and the
collectives an owner-mode step issues (an all_reduce, an async all_to_all_single waited, an
all_reduce), then destroy_process_group(). Occasionally a rank ends with

    terminate called without an active exception      (SIGABRT, after main() returned)

and torchrun reports the job as failed. Rare: run it many times on a loaded machine, e.g.

    for i in $(seq 100); do torchrun --standalone --nproc_per_node 2 docs/repro/gloo_teardown_abort.py \
        >/dev/null 2>&1 || echo "run $i: exit $?"; done

Why: each collective here is issued on a fresh tensor that the script drops as soon as the call returns;
gloo's worker thread may then hold the last reference, and if it lets go only once the interpreter is
finalizing, freeing the tensor's Python object needs the GIL there and the thread is ended inside a C++
destructor (docs/troubleshooting.md). Keeping the tensors referenced to the end avoids it.

Pass ``--exit`` to leave with os._exit(0) after destroy_process_group() (the workaround: no
interpreter finalization runs, so nothing is torn down under it)."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 32))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    w = dist.get_world_size()
    for _ in range(3):
        model(torch.randint(0, 32, (4, 8))).float().pow(2).mean().backward()
        dist.all_reduce(torch.zeros(8, dtype=torch.int32), op=dist.ReduceOp.MAX)
        out = torch.empty(4 * w)
        dist.all_to_all_single(out, torch.randn(4 * w), [4] * w, [4] * w, async_op=True).wait()
        dist.all_reduce(torch.zeros(2, dtype=torch.int32), op=dist.ReduceOp.MAX)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if "--exit" in sys.argv:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
