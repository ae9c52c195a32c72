"""DeepSpeed universal checkpoints (resume at another world size) for runs with SWAN.

DeepSpeed's converter, ``python -m deepspeed.checkpoint.ds_to_universal``, assumes Adam: it reads
``exp_avg`` and ``exp_avg_sq`` for every param group and fails with ``KeyError: 'exp_avg'`` on a
SWAN group, which keeps no state. This wrapper runs that converter unchanged on a scratch copy of
the checkpoint in which every stateless group carries zero stand-in moments, then deletes the
stand-ins from the output. Each SWAN-managed matrix's universal folder then holds ``fp32.pt`` only,
so loading (``"checkpoint": {"load_universal": true}``) creates no optimizer state for it, while
fallback parameters keep their real AdamW moments and step.

    python -m swan_dist.integrations.ds_universal --input_folder ckpt/step100 --output_folder ckpt/step100_universal

Further arguments are passed to DeepSpeed's converter (``--num_extract_workers``, ...).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

import torch

STAND_INS = ("exp_avg", "exp_avg_sq")


def _fill_stateless(path: str, out: str) -> list[str]:
    """Copy one ``*_optim_states.pt`` to ``out`` with zero moments for stateless groups; returns the
    names of the parameters in those groups."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    osd = sd["optimizer_state_dict"]
    if "base_optimizer_state" in osd:  # ZeRO-1/2: one fp32 partition (padding stripped) per group
        states, flats = osd["base_optimizer_state"]["state"], osd["single_partition_of_fp32_groups"]
        sizes = [f.numel() + pad for f, pad in zip(flats, osd["group_paddings"])]  # moments keep the padding
        groups = [list(m) for m in osd["param_slice_mappings"]]
    else:
        raise ValueError(
            f"swan_dist: {os.path.basename(path)} is a ZeRO-3 checkpoint. DeepSpeed 0.19's ZeRO-3 universal "
            "loader (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3) assumes Adam moments in every "
            "sub-group and copies param group 0's hyper-parameters to all groups, which would hand SWAN's "
            "settings to the fallback group. Change world size from a ZeRO-1/2 checkpoint, or resume ZeRO-3 at "
            "the same world size"
        )
    names: list[str] = []
    for g, n in enumerate(sizes):
        if all(k not in states.get(g, {}) for k in STAND_INS):
            states[g] = {**states.get(g, {}), **{k: flats[g].new_zeros(n) for k in STAND_INS}}
            names += groups[g]
    torch.save(sd, out)
    return names


def convert(input_folder: str, output_folder: str, extra_args: list[str] = ()) -> list[str]:
    """Write a universal checkpoint of ``input_folder`` (one tag's folder) to ``output_folder``;
    returns the parameters saved without optimizer state (SWAN matrices, stateless fallbacks)."""
    stateless: set[str] = set()
    with tempfile.TemporaryDirectory() as scratch:
        for path in sorted(glob.glob(os.path.join(input_folder, "*"))):
            dest = os.path.join(scratch, os.path.basename(path))
            if path.endswith("_optim_states.pt"):
                stateless.update(_fill_stateless(path, dest))
            else:
                os.symlink(os.path.abspath(path), dest)
        # --inject_missing_state: checkpoints of plain (non-Megatron) models carry no universal info
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", scratch,
               "--output_folder", output_folder, "--inject_missing_state", *extra_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"swan_dist: DeepSpeed's ds_to_universal failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    for name in stateless:
        for key in STAND_INS:
            stand_in = os.path.join(output_folder, "zero", name, f"{key}.pt")
            if os.path.exists(stand_in):
                os.remove(stand_in)
    return sorted(stateless)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_folder", required=True, help="one checkpoint tag's folder")
    parser.add_argument("--output_folder", required=True)
    args, extra = parser.parse_known_args(argv)
    names = convert(args.input_folder, args.output_folder, extra)
    print(f"swan_dist: universal checkpoint in {args.output_folder}; {len(names)} parameters carry no optimizer state")


if __name__ == "__main__":
    main()
