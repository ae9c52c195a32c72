"""The exchange: this rank's schedule of a plan (:mod:`.schedule`) and running it with
``all_to_all_single`` (:mod:`.runtime`). Knows ranks, ranges and buffers, not frameworks nor SWAN."""

from .runtime import Compute, Exchange, OnUpdate
from .schedule import MAX_PHASES, PHASE_BYTES, Moves, Slot, Splits, Step, build_steps

__all__ = ["Exchange", "Compute", "OnUpdate", "Step", "Splits", "Moves", "Slot", "build_steps", "PHASE_BYTES",
           "MAX_PHASES"]
