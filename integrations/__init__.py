"""Framework adapters for swan_dist (installed as ``swan_dist.integrations``).

Each adapter only answers, for every managed matrix: which contiguous piece of it this rank holds,
where that piece's gradient is, and where its update goes. The math lives in
``swan_dist.functional``; the optimizer in ``swan_dist.optimizer``.
"""
