"""Run Megatron-core on a CPU-only torch build (gloo), for tests and laptops. Never active when CUDA is available.

Megatron-core 0.16.1 assumes CUDA in a handful of places (each found by running it on CPU; docs/megatron-on-cpu.md):

1. the CUDA RNG in ``tensor_parallel.random`` (``_get/_set_cuda_rng_state`` and the RNG tracker);
2. tensor factories called with ``device="cuda"`` or an int device (schedules' ``total_num_tokens``, grad buffers,
   clip_grads, the causal mask rebuilt during recomputation inside backward), and ``torch.cuda.current_device()``;
3. ``tensor.type() == 'torch.cuda.FloatTensor'`` checks in clip_grads and the (distributed) optimizer;
4. ``.cuda()`` in embedding tying and the optimizer; ``torch.cuda.synchronize()`` in batch p2p;
5. the mixture-of-experts ``alltoall`` token dispatcher (``_route_moe``): its device-to-host side stream and event
   (``torch.cuda.Stream/current_stream/stream``, ``Stream.record_event``) and the split sizes of
   ``all_to_all_single`` (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts only CUDA tensors, and gloo
   wants int sequences, not CPU tensors). (``moe_utils.te_general_gemm``, bound only when Transformer Engine
   imports, is not a CPU matter: the model builder binds it on every device, ``model.bind_router_gemm``);
6. multi-latent attention on the local spec (``_route_mla``): the local ``DotProductAttention`` takes no
   ``k_channels``/``v_channels`` (MLA's key and value widths differ from ``kv_channels``), and the Transformer Engine
   extension module, imported under a MagicMock stand-in for TE, leaves ``HAVE_TE`` true in the MLA module so that
   it builds TE's fused linear layers from the mock.

Each is routed to the CPU by replacing the function itself (a TorchFunctionMode would not see the calls made inside
autograd's backward). On CPU the "CUDA" generator *is* the CPU generator, so the tracker forks the CPU RNG state.
``install()`` logs one line when it activates.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

log = logging.getLogger("hpc_tools.megatron")

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor",
              "zeros_like", "ones_like", "empty_like", "full_like")
_installed = False


def active() -> bool:
    """True once install() has routed CUDA calls to the CPU in this process."""
    return _installed


def install() -> bool:
    """Install the CPU routes when torch has no CUDA; returns whether they are active. Idempotent."""
    global _installed
    import torch

    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    _route_factories(torch)
    _route_cuda_module(torch)
    _route_tensor_methods(torch)
    _route_rng()
    _route_moe(torch)
    _route_mla()
    _installed = True
    log.info("cpu_compat: no CUDA in this torch build; Megatron-core's CUDA calls (device='cuda', .cuda(), CUDA RNG, "
             "cuda tensor-type checks, cuda.synchronize, the MoE dispatcher's streams, MLA's local attention) are "
             "routed to the CPU")
    return True


def import_megatron() -> None:
    """Import megatron-core on a torch without CUDA, leaving out three imports only a GPU, inference or Megatron-LM's
    own training loop uses: its fusion functions are decorated with ``torch.compile`` at import
    (``megatron.core.jit.jit_fuser``), which loads TorchDynamo and Inductor; its inference context imports ``wandb``;
    its ``Timers`` import ``torch.utils.tensorboard`` for ``Timers.write``, which nothing here calls (the run's
    TensorBoard files are ``hpc_tools.tracking.events``'s). For that one import ``torch.compile`` returns the function
    itself (the fusions are off on CPU: ``config.transformer_config``; should one run, it runs eagerly) and the two
    packages read as absent to megatron-core (``hpc_tools.train.imports.absent``; a recipe's ``tracking`` imports them
    later as usual). A no-op where CUDA is available or megatron-core is imported already
    (``benchmarks/bench_rank_import.py`` times the import both ways)."""
    import torch

    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return
    from hpc_tools.train.imports import absent

    compile_ = torch.compile
    torch.compile = _eager_compile
    try:
        with absent("wandb", "torch.utils.tensorboard"):
            import megatron.core  # noqa: F401
            import megatron.core.models.gpt  # noqa: F401  # the fusions' modules
    finally:
        torch.compile = compile_


def _eager_compile(model=None, **_kwargs):
    """``torch.compile``'s signature, compiling nothing: the function itself (or, as a decorator factory, a
    decorator returning it)."""
    return model if model is not None else (lambda fn: fn)


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # an int device means a CUDA ordinal
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _route_factories(torch) -> None:
    for name in _FACTORIES:
        original = getattr(torch, name)

        @functools.wraps(original)
        def factory(*args, _original=original, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        setattr(torch, name, factory)


def _route_cuda_module(torch) -> None:
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # used as `device=...` and `.to(...)`: a CPU device keeps both working
    torch.cuda.synchronize = lambda device=None: None  # CPU ops are synchronous


def _from_megatron(depth: int = 2) -> bool:
    """Whether the caller `depth` frames up is Megatron-core code (the only code that gets the CUDA type names)."""
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("megatron.core")


def _route_tensor_methods(torch) -> None:
    original_type = torch.Tensor.type
    original_cuda = torch.Tensor.cuda

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        name = original_type(self, dtype, non_blocking, **kwargs)
        # Megatron tells fp32/bf16/fp16 params apart by 'torch.cuda.*Tensor' names; CPU tensors say 'torch.*Tensor'.
        if dtype is None and isinstance(name, str) and self.device.type == "cpu" and _from_megatron():
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if self.device.type == "cpu":
            return self
        return original_cuda(self, device, non_blocking, memory_format)

    torch.Tensor.type = tensor_type
    torch.Tensor.cuda = tensor_cuda


def _route_rng() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named RNG streams (model-parallel, data-parallel, expert) kept as CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            # Upstream also warns when the CPU state changes inside the fork; here that is the point of the fork.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


class CpuEvent:
    """What the MoE dispatcher does with a CUDA event, on the CPU: it has happened when it is recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """A stand-in for ``torch.cuda.Stream``: CPU work is synchronous, so waiting and recording are no-ops. Compared by
    identity (the dispatcher asks whether it runs on its side stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = CpuStream()


def _route_moe(torch) -> None:
    """The MoE token dispatcher on CPU (item 5 of the module docstring)."""
    import contextlib

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        # gloo's all_to_all_single takes its split sizes as int sequences: a CPU tensor becomes numpy as a CUDA one
        # would (upstream converts only tensors that were on the GPU).
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu  # imported by name there


def _route_mla() -> None:
    """Multi-latent attention with the local spec on CPU (item 6 of the module docstring)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import dot_product_attention, multi_latent_attention

    if not te_extension.HAVE_TE:  # TE absent: the extension's names are MagicMock stand-ins, not layers
        multi_latent_attention.HAVE_TE = False
    local = dot_product_attention.DotProductAttention
    if getattr(local.__init__, "_hpc_tools_mla", False):
        return
    original = local.__init__

    @functools.wraps(original)
    def init(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
             softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        original(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                 softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        heads = self.num_attention_heads_per_partition
        if k_channels is not None and softmax_scale is None:  # the scale follows the query/key width
            import math

            self.softmax_scale = 1.0 / math.sqrt(k_channels)
        if v_channels is not None:  # the context is heads x value width wide, not heads x kv_channels
            self.hidden_size_per_partition = heads * v_channels

    init._hpc_tools_mla = True
    local.__init__ = init
