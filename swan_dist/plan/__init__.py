"""The planner: from every rank's ranges of every matrix, who computes which matrix in which bucket
(:func:`build_plan`). Identical on every rank; knows ranks and ranges, not frameworks nor SWAN.

- :mod:`.ranges`: every rank's ranges (:class:`Ranges`) and what they say of each matrix (holders, tiles, holes);
- :mod:`.build`: :class:`MatrixSpec`, :class:`Plan`, :func:`cover` (where each element comes from), :func:`build_plan`;
- :mod:`.packing`: the policy, buckets and owners on costs and bytes (the byte-room rule, :func:`has_room`).
"""

from .build import Matrix, MatrixSpec, Plan, Segment, build_plan, cover, row_shard_ranges
from .packing import EVERY_RANK, Bucket
from .ranges import Ranges

__all__ = ["Matrix", "MatrixSpec", "Plan", "Bucket", "EVERY_RANK", "Ranges", "Segment", "build_plan", "cover", "row_shard_ranges"]
