"""Run an unmodified Megatron-LM script (``pretrain_gpt.py``) on CPU with gloo, through swan_dist's
``--optimizer swan`` launcher; for tests only::

    OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 2 \\
        tests/megatron_lm_cpu.py PATH/pretrain_gpt.py \\
        --optimizer swan --distributed-backend gloo --transformer-impl local \\
        --no-gradient-accumulation-fusion --use-cpu-initialization --no-rope-fusion \\
        --no-persist-layer-norm --no-bias-swiglu-fusion --no-bias-dropout-fusion ...

Megatron-LM (tag core_v0.16.1) assumes CUDA. This file installs the CPU shims its training path
needs, each named with the Megatron file:line it serves (lines of that tag), then calls
:func:`swan_dist.integrations.megatron_lm.main`. Nothing here is part of swan_dist and nothing is
written into the Megatron-LM checkout: the shims live in this process only.

Names inside megatron modules are replaced where one module needs it; ``torch.cuda`` functions that
Megatron calls from ~20 modules are set on ``torch.cuda`` while the run lasts (``cuda_on_cpu``), and a
``TorchFunctionMode`` puts tensors asked for on ``cuda`` on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode


# --------------------------------------------------------------------------- tensors: cuda -> CPU
def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA device (torch.cuda.current_device() is 0 below)
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
              torch.bfloat16: "torch.cuda.BFloat16Tensor"}


class CudaToCpu(TorchFunctionMode):
    """Active around the whole run:

    - ``device='cuda'`` or ``device=torch.cuda.current_device()`` in a factory or ``.to(device=...)``
      makes the tensor on the CPU: training.py:806,812,1816,2072,3405; optimizer/optimizer.py:481,485,907;
      clip_grads.py:103,174; timers.py:302; param_and_grad_buffer.py:797,803; rerun_state_machine.py:265;
      checkpointing.py:315; core/utils.py:628,1207; pipeline_parallel/schedules.py:596;
      rotary_pos_embedding.py:162; state_dict_saver.py:251; training/utils.py:253,272,563-738;
    - ``Tensor.cuda()`` (and so ``Module.cuda()``, training.py:1258) leaves the tensor where it is:
      training/utils.py:534-542 (get_batch_on_this_tp_rank);
    - ``Tensor.type()`` without arguments names a CPU fp32/fp16/bf16 tensor by its CUDA type, the only
      types these accept: distrib_optimizer.py:361,420,582; clip_grads.py:167.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE:
                return _CUDA_TYPE[t.dtype]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- torch.cuda
class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, *a, **k):  # MoE all-to-all dispatcher: token_dispatcher.py:895, then :899
        return self

    def synchronize(self):
        pass


def _noop(*a, **k):
    return None


def _zero(*a, **k):
    return 0


# Set on ``torch.cuda`` while the run lasts. ``is_available`` / ``device_count`` are not: torch's own
# code (DataLoader pin_memory, torch.distributed.checkpoint) keeps to the CPU, and Megatron's gates on
# them are answered per module (CPU_TORCH below).
CUDA_ON_CPU = dict(
    # training.py:1258; training/utils.py:253-731; timers.py:303; param_and_grad_buffer.py:800,806;
    # rotary_pos_embedding.py:162; core/utils.py:631; state_dict_saver.py:252: an index, which CudaToCpu maps
    current_device=_zero,
    synchronize=_noop,  # timers.py:152,165; filesystem_async.py:230
    empty_cache=_noop,  # checkpointing.py:1911
    Stream=_Stream,  # training.py:1325-1329: DDP wrapping on a side stream
    current_stream=lambda *a, **k: _Stream(),  # training.py:1327,1344
    stream=lambda *a, **k: contextlib.nullcontext(),  # training.py:1329
    memory_allocated=_zero, max_memory_allocated=_zero,  # training/utils.py:284-287 (report_memory)
    memory_reserved=_zero, max_memory_reserved=_zero,
    # training/utils.py:448 (arguments.py:928, with TP > 1): a Hopper, so CUDA_DEVICE_MAX_CONNECTIONS=1
    # is required with TP > 1 (arguments.py:926-950), as Megatron's own scripts set it
    get_device_properties=lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="cpu", total_memory=0),
    # The CUDA RNG is the CPU generator: tensor_parallel/random.py:235-238 (tracker.add), 422
    # (model_parallel_cuda_manual_seed); rerun_state_machine.py:957; checkpointing.py:343,1866 (rng state)
    manual_seed=torch.manual_seed,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
)


@contextlib.contextmanager
def cuda_on_cpu():
    saved = {k: torch.cuda.__dict__.get(k) for k in CUDA_ON_CPU}
    for k, v in CUDA_ON_CPU.items():
        setattr(torch.cuda, k, v)
    try:
        with CudaToCpu():
            yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)


class _Proxy(types.ModuleType):
    """Stands for a module in one megatron module's globals: the names given here replace the real
    module's, every other name is the real one."""

    def __init__(self, real, **names):
        super().__init__(real.__name__)
        self.__dict__.update(names)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


# ``torch`` in megatron/training/initialize.py, where Megatron asks whether there is a GPU:
# 62 asserts is_available; 319 device_count gates set_device (331) and, at 360, initialize_model_parallel;
# 422 gates model_parallel_cuda_manual_seed (the RNG tracker).
CPU_TORCH = _Proxy(torch, cuda=_Proxy(torch.cuda, is_available=lambda: True, device_count=lambda: 1,
                                      set_device=_noop))


# tensor_parallel/random.py:41-111 read and set the CUDA generator through torch._C and
# torch.cuda.default_generators (tracker.fork(), 244-277): the CPU generator's state instead.
def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


class _NoCpuRngWarning(logging.Filter):
    """random.py:264-265 warns when the CPU RNG state changes inside ``tracker.fork()``; here the
    tracker's states are the CPU generator's, so it always does, by design."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# --------------------------------------------------------------------------- Megatron functions
def _compile_dependencies() -> None:
    """For initialize.py:179-235 (called at 169): it runs ``make`` on core/datasets/helpers.cpp, which
    needs pybind11 and writes into the checkout (the prebuilt helpers come from the megatron-core
    wheel instead, :func:`_dataset_helpers`), and builds megatron/legacy/fused_kernels, CUDA only."""


def _warmup_jit_function() -> None:
    """For initialize.py:463-523 (called at 460, from training.py:792): it warms the CUDA fusions up
    with ``torch.rand(..., device="cuda")``, drawn on a GPU from the CUDA generator. Here that would
    draw from the CPU generator, by amounts that depend on the TP size, and the CPU-initialized weights
    (tensor_parallel/layers.py:149-189) would differ between TP layouts. The fusions are off here."""


def _get_write_results_queue():
    """For dist_checkpointing/strategies/filesystem_async.py:51-56 (torch_dist save): a *spawn* Manager,
    whose child re-imports the running ``__main__`` (pretrain_gpt.py, and through initialize.py:25
    triton) without these shims. A fork Manager serves the same queue (Megatron forks its writer
    processes anyway, filesystem_async.py:266)."""
    import multiprocessing as mp

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    if fa._results_queue is None:
        fa._results_queue = mp.get_context("fork").Manager().Queue()
    return fa._results_queue


# --------------------------------------------------------------------------- imports
def _import_batch_invariant_kernels() -> None:
    """initialize.py:25 imports batch_invariant_kernels, which imports triton at top level (15-16) and
    uses it at import (``@triton.jit`` 49, 59, 237, 330; ``tl.constexpr`` annotations). Without triton,
    import that module against a stub that is removed again, so that every other ``import triton``
    (core/utils.py:40, fusions/*) still finds none. Its kernels are never launched here."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    importlib.import_module("megatron.core.utils")
    importlib.import_module("megatron.core.transformer.custom_layers")
    triton, tl = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.language, triton.__version__, tl.constexpr = tl, "0.0.0", type("constexpr", (), {})
    sys.modules["triton"], sys.modules["triton.language"] = triton, tl
    try:
        importlib.import_module(name)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def _dataset_helpers() -> None:
    """gpt_dataset.py:504-524 imports core/datasets/helpers.py, which imports the compiled
    ``helpers_cpp`` (8-9) that a checkout lacks until initialize.py:192 builds it. The megatron-core
    wheel of the same version ships it: ``megatron.core.datasets`` also looks there."""
    import megatron.core.datasets as datasets

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        return
    for entry in sys.path:
        candidate = os.path.join(entry, "megatron", "core", "datasets")
        if (os.path.isdir(candidate) and candidate not in datasets.__path__
                and any(f.startswith("helpers_cpp") for f in os.listdir(candidate))):
            datasets.__path__.append(candidate)
            return
    raise RuntimeError("megatron_lm_cpu: no prebuilt megatron/core/datasets/helpers_cpp (pip install megatron-core)")


def install(script: str) -> None:
    """The shims, for ``script``'s checkout (its directory first on ``sys.path``, as the launcher puts it)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _import_batch_invariant_kernels()
    _dataset_helpers()
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    import megatron.core.tensor_parallel.random as random
    import megatron.training.initialize as initialize

    initialize.torch = CPU_TORCH
    initialize._compile_dependencies = _compile_dependencies
    initialize._warmup_jit_function = _warmup_jit_function
    random._get_cuda_rng_state, random._set_cuda_rng_state = _get_cpu_rng_state, _set_cpu_rng_state
    logging.getLogger(random.__name__).addFilter(_NoCpuRngWarning())
    filesystem_async._get_write_results_queue = _get_write_results_queue
    _moe()


def _moe() -> None:
    """MoE (``--num-experts``) without Transformer Engine: moe_utils.py:22-39 binds ``te_general_gemm`` only
    when TE imports, while the router's gating function tests it (1192, 1225): None takes its torch path.
    The all-to-all dispatcher converts split sizes to numpy only for CUDA tensors (moe_utils.py:1077-1100,
    used at token_dispatcher.py); CPU ones are converted too."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    orig = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(orig, "_cpu_shim", False):
        return

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
    to_host._cpu_shim = True
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python tests/megatron_lm_cpu.py PATH/pretrain_gpt.py [Megatron-LM args...]")
    install(argv[0])
    from swan_dist.integrations.megatron_lm import main as run

    with cuda_on_cpu():
        run(argv)


if __name__ == "__main__":
    main()
