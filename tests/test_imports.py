"""``import swan_dist`` loads no framework it adapts to.

A user of one framework should not pay for (or break on) the others: the adapters reach their framework
only through ``sys.modules`` or imports inside functions, and DTensor's private helpers are imported on
first use, so a torch upgrade that moves them fails at that use with a message naming the version.
"""

import re
import subprocess
import sys

import pytest
import torch

# Importing the public torch.distributed.tensor loads its private modules too, so none of it may load.
FRAMEWORKS = ("deepspeed", "megatron", "transformers", "accelerate", "lightning", "pytorch_lightning",
              "lightning_fabric", "torch.distributed.fsdp", "torch.distributed.tensor")

PROBE = f"""
import sys
import torch
import swan_dist

frameworks = {FRAMEWORKS!r}
print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in frameworks)))
print(swan_dist.SWANFactory.__name__, torch.optim.SWAN is swan_dist.SWAN)
"""


def test_import_loads_no_framework():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    loaded, resolved = done.stdout.strip().splitlines()
    assert loaded == "[]", f"import swan_dist imported {loaded}"
    assert resolved == "SWANFactory True"  # the Trainer factory and DeepSpeed's "type": "SWAN" still resolve


def test_missing_private_dtensor_api_names_the_version():
    from swan_dist.integrations import dtensor

    with pytest.raises(ImportError, match=re.escape(f"torch {torch.__version__} has no torch.distributed.tensor._utils.x")):
        dtensor._private("torch.distributed.tensor._utils", "x")
