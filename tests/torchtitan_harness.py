"""Run torchtitan's own trainer (``torchtitan.train.main``) on the CPU, for tests/test_torchtitan.py.

What a CPU run needs lives here, not in swan_dist: torchtitan's device helper falls back to ``"cuda"`` without
an accelerator and several modules copy ``device_type`` at import, so the device is overridden before
torchtitan is first imported. The job configs (``torchtitan_configs.py`` beside this file) point at a tiny
tokenizer and data set that :func:`make_assets` writes.

    torchrun --nproc_per_node 2 tests/torchtitan_harness.py --module torchtitan_configs --config llama3_swan \
        --checkpoint.folder /tmp/x ...

Environment: ``SWAN_TT_ASSETS`` the assets folder (made if missing).
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


def main() -> None:
    cpu_device()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if not torch.cuda.is_available():
        import torchtitan.components.metrics as metrics
        metrics.build_device_memory_monitor = CpuMemoryMonitor
        from torchtitan.models.common.attention import FlexAttention
        FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
        import torchtitan.distributed.utils as dist_utils
        dist_utils.set_pg_timeouts = lambda *a, **k: None  # its barrier passes device_ids=["cpu"], gloo refuses
    from torchtitan.train import main as titan_main
    titan_main()


if __name__ == "__main__":
    main()
