"""Framework adapters for swan_dist (installed as ``swan_dist.integrations``).

Each adapter implements :class:`swan_dist.adapter.Adapter` in one file: which tensors it claims, the
logical parameters they stand for, this rank's piece of each, and its framework's checkpoint layout
of optimizer state. ``ADAPTERS`` is the one place they are registered; the first that claims a
tensor answers for it, so the catch-all replicated adapter comes last. docs/engine.md shows how to
add one.

``import swan_dist`` imports this registry, so an adapter module imports no framework at module level:
it reaches its framework through ``sys.modules`` (a framework's tensors exist only once it is imported)
or imports inside the functions that need it (tests/test_imports.py checks this).
"""

from __future__ import annotations

from .ddp import ReplicatedAdapter
from .deepspeed import DeepSpeedAdapter
from .dtensor import DTensorAdapter
from .fsdp1 import FlatParamAdapter, OrigParamAdapter
from .huggingface import HuggingFaceAdapter
from .grouped_experts import GroupedExpertsLayouts
from .hf_layouts import TransformersLayouts
from .megatron import MegatronAdapter

ADAPTERS = (
    DeepSpeedAdapter(),  # ZeRO-3 partitioned parameters; flat fp32 partitions replacing a group
    FlatParamAdapter(),  # FSDP1 use_orig_params=False: a FlatParameter packs several originals
    OrigParamAdapter(),  # FSDP1 use_orig_params=True: flat views of each original's shard
    DTensorAdapter(),  # FSDP2, tensor parallelism and both (Shard / _StridedShard / Replicate)
    MegatronAdapter(),  # megatron-core's TP layers (plain tensors, partition_dim), its distributed optimizer
    HuggingFaceAdapter(),  # claims no tensor: names for the bare groups Transformers' Trainer passes
    TransformersLayouts(),  # claims no tensor: Conv1D orientation, fused QKV / gate-up, stacked MoE experts
    GroupedExpertsLayouts(),  # claims no tensor: torchtitan-style GroupedExperts w1/w2/w3 (E, ., .)
    ReplicatedAdapter(),  # DDP, ZeRO-0, no wrapper: every rank holds the whole tensor
)

__all__ = ["ADAPTERS"]
