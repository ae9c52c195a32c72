"""Reference trainer: a small LLaMA-style model (``model``), real-text data (``data``) and a single- or
multi-process training loop (``loop``, with ``config``, ``parallel``, ``optim``, ``baselines``, ``step``,
``checkpoint`` and ``outputs``; ``train`` is its command line) for comparing SWAN with AdamW.

    python -m swan_dist.reference.train --config configs/train/swan_ddagger_tiny.yaml
    torchrun --nproc_per_node 2 -m swan_dist.reference.train --config configs/train/main.yaml
"""
