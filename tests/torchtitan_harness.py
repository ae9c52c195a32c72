"""Run torchtitan's own trainer (``torchtitan.train.main``) on the CPU, for tests/test_torchtitan.py.

What a CPU run needs lives here, not in swan_dist: torchtitan's device helper falls back to ``"cuda"`` without
an accelerator and several modules copy ``device_type`` at import, so the device is overridden before
torchtitan is first imported. The job configs (``torchtitan_configs.py`` beside this file) point at a tiny
tokenizer and data set that :func:`make_assets` writes.

    torchrun --nproc_per_node 2 tests/torchtitan_harness.py --module torchtitan_configs --config llama3_swan \
        --checkpoint.folder /tmp/x ...

Several jobs run one after the other in one launch when their argument lists are separated by ``---``.
Environment: ``SWAN_TT_ASSETS`` the assets folder (:func:`make_assets`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

VOCAB = 200  # words w0..w199, plus <s> and </s> (the debug models' vocabularies are larger)
DOCS = 36  # contiguous dp shards of 36 documents give every dp degree in {1, 2, 4} the same global batches


def cpu_device() -> None:
    """torchtitan picks its device at import from ``torch._utils._get_available_device_type``."""
    if not torch.cuda.is_available():
        import torch._utils as torch_utils
        torch_utils._get_available_device_type = lambda: "cpu"


class CpuMemoryMonitor:
    """torchtitan's ``DeviceMemoryMonitor`` for a CPU: the process's peak resident set (``ru_maxrss``) as its
    "max active" and "max reserved" memory (torch.cpu has no allocator statistics)."""

    device_name = "cpu"
    device_capacity_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30

    def reset_peak_stats(self) -> None:
        pass

    def get_peak_stats(self):
        import resource
        from torchtitan.components.metrics import DeviceMemStats
        gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        pct = 100 * gib / self.device_capacity_gib
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)


def eager_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """torchtitan's ``FlexAttention.compiled_flex_attn`` in plain tensor ops (torch's FlexAttention has no CPU
    backward): the block mask made dense (``create_mask``), softmax attention, the log-sum-exp if asked."""
    from types import SimpleNamespace
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None, "the CPU attention of the test harness takes no score_mod"
    b, h, lq, d = q.shape
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    mask = create_mask(block_mask.mask_mod, b, 1, lq, k.shape[2], device=q.device)
    scores = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    return out, SimpleNamespace(lse=lse if return_aux is not None and return_aux.lse else None)


def make_assets(folder: str, seq_len: int) -> None:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and a local json data set whose
    documents are exactly ``seq_len`` tokens with BOS and EOS (one sample each), alternating between two texts
    so that any contiguous split among 1, 2 or 4 data-parallel ranks yields the same global batches."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, f)
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB, (seq_len - 1,), generator=g)) for _ in range(2)]
    with open(os.path.join(folder, "data", "train.json"), "w") as f:
        for d in range(DOCS):
            f.write(json.dumps({"text": texts[d % 2]}) + "\n")


def ensure_assets(seq_len: int = 16) -> None:
    """Make the assets in ``SWAN_TT_ASSETS`` if they are missing (local rank 0 writes, the others wait)."""
    import time
    folder = os.environ["SWAN_TT_ASSETS"]
    done = os.path.join(folder, "done")
    if os.path.exists(done):
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        make_assets(folder, seq_len)
        open(done, "w").close()
    while not os.path.exists(done):
        time.sleep(0.2)


def pipeline_microbatch_step() -> None:
    """torchtitan 0.3.0 calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`` with the microbatches
    already split (a newer torch's signature); torch 2.13.0's ``step`` splits a whole batch itself. Where the
    installed torch lacks it, the split microbatches go straight to the schedule's ``_step_microbatches``."""
    import inspect
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" in inspect.signature(cls.step).parameters:
            continue
        whole = cls.step

        def step(self, *args, whole=whole, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                 return_outputs=True, loss_kwargs=None, **kwargs):
            if kwarg_mbs is None and arg_mbs is None:
                return whole(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                             **kwargs)
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            return None
        cls.step = step


def main() -> None:
    cpu_device()
    ensure_assets()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if not torch.cuda.is_available():
        import torchtitan.components.metrics as metrics
        metrics.build_device_memory_monitor = CpuMemoryMonitor
        from torchtitan.models.common.attention import FlexAttention
        FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
        from torch.distributed.fsdp import FSDPModule
        set_factor = FSDPModule.set_gradient_divide_factor

        def set_factor_gloo(self, factor):  # a factor makes FSDP2 reduce with PREMUL_SUM, which gloo lacks
            set_factor(self, factor)
            self.set_force_sum_reduction_for_comms(True)  # SUM, then FSDP divides by the factor itself
        FSDPModule.set_gradient_divide_factor = set_factor_gloo
        pipeline_microbatch_step()
        import torchtitan.distributed.utils as dist_utils
        dist_utils.set_pg_timeouts = lambda *a, **k: None  # its barrier passes device_ids=["cpu"], gloo refuses
    from torchtitan.train import main as titan_main
    # several jobs per launch (one import, one start-up): argument lists separated by "---", run in turn
    argv, jobs = sys.argv[1:], [[]]
    for a in argv:
        jobs.append([]) if a == "---" else jobs[-1].append(a)
    import torch.distributed.distributed_c10d as c10d
    rendezvous = c10d.rendezvous
    for k, job in enumerate(jobs):
        # each job's process group keys under a prefix of its own in torchrun's store (a second
        # init_process_group on the same store would meet the first job's keys and hang)
        def prefixed(*a, k=k, **kw):
            for store, rank, world in rendezvous(*a, **kw):
                yield c10d.PrefixStore(f"job{k}", store), rank, world
        c10d.rendezvous = prefixed
        sys.argv = [sys.argv[0], *job]
        titan_main()


if __name__ == "__main__":
    main()
