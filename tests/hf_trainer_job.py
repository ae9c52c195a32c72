"""One 2-process ``transformers.Trainer`` job for tests/test_huggingface.py, run under torchrun:

    python -m torch.distributed.run --nproc_per_node 2 tests/hf_trainer_job.py CONFIG OUT_DIR

CONFIG: ``ddp`` | ``fsdp2`` (the entry point ``swan_dist.SWANFactory``, then the bare
``optimizer_cls_and_kwargs=(swan_dist.SWAN, kwargs)``, each a Trainer of its own) or ``zero2`` | ``zero3``
(DeepSpeed JSON with ``"optimizer": {"type": "SWAN"}``). A tiny Llama from a config, a tiny random data
set that repeats (so the loss falls), gloo on loopback. Each rank writes ``OUT_DIR/<rank>.json``:
per run the logged losses and learning rates, the optimizer's summary, each group's lr after the run
(Trainer's linear schedule ends at 0), the types of the tensors it steps and how many matrices it
whitened.

On the CPU Accelerate picks ``MULTI_CPU`` (DDP) even with an FSDP plugin; ``fsdp2`` sets its state to
FSDP after the Accelerator is built, so that Accelerate's own FSDP2 preparation (``fully_shard`` and the
optimizer's parameter swap) runs unchanged, as it does on GPUs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SWAN_DIST_CPU_BF16", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 6
LR = 0.02


def _model(config: str = ""):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if config.endswith("-moe"):  # 4 experts (top 2) in layer 0, a dense MLP in layer 1
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[1]))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128))


class _Data(torch.utils.data.Dataset):
    """8 random sequences of 16 tokens, repeated: memorisable, so a few steps lower the loss."""

    def __init__(self) -> None:
        self.x = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        x = self.x[i % len(self.x)]
        return {"input_ids": x, "labels": x}


def _trainer_cls(fsdp2: bool):
    from transformers import Trainer

    if not fsdp2:
        return Trainer

    class FSDP2OnCPU(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP  # what Accelerate picks on GPUs with this plugin
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True
            assert self.accelerator.is_fsdp2

    return FSDP2OnCPU


def _run(config: str, variant: str, out_dir: str) -> dict:
    from transformers import TrainingArguments

    import swan_dist

    extra: dict = {}
    kwargs: dict = {}
    if config in ("zero2", "zero3", "zero3-moe"):
        extra["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**9,
            # lr from learning_rate; or, "json-adamw", learning_rate as AdamW's lr (SWAN's lr 4x it)
            "optimizer": {"type": "SWAN", "params": {"preset": "swan_ddagger",
                                                     **({"adamw_lr": "learning_rate"} if variant == "json-adamw" else {"lr": "auto"})}},
            "zero_optimization": {"stage": int(config[4])},
        }
    else:
        kwargs["optimizer_cls_and_kwargs"] = (
            swan_dist.SWANFactory if variant == "factory" else swan_dist.SWAN, {"preset": "swan_ddagger", "lr": LR})
    if config == "fsdp2":
        extra.update(fsdp=True, fsdp_config={"version": 2})
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"{config}-{variant}"), max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=LR / 4 if variant == "json-adamw" else LR, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0, lr_scheduler_type="linear", use_cpu=config in ("ddp", "fsdp2"), **extra,
    )
    trainer = _trainer_cls(config == "fsdp2")(model=_model(config), args=args, train_dataset=_Data(), **kwargs)
    trainer.train()
    opt = trainer.optimizer
    while not isinstance(opt, swan_dist.SWAN):  # Accelerate's / DeepSpeed's wrappers
        opt = opt.optimizer
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "losses": losses, "logged_lr": [h["learning_rate"] for h in trainer.state.log_history if "loss" in h], "summary": opt.summary(), "lr": [g["lr"] for g in opt.param_groups],
        "types": sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]}),
        "whitened": opt.whitened_matrices,
    }


def main() -> None:
    config, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    variants = {"ddp": ("factory", "bare"), "fsdp2": ("factory", "bare"), "zero2": ("json", "json-adamw")}.get(config, ("json",))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            results[variant] = _run(config, variant, tmp)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip native teardown (DeepSpeed / gloo aborts at exit seen in CI); results are written


if __name__ == "__main__":
    main()
