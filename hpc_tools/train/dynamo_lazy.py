"""TorchDynamo imported by a rank only when something compiles (``install``), not by the first optimizer call.

PyTorch 2.13 imports ``torch._dynamo`` (with sympy and part of Inductor: ~0.7 CPU-s after megatron-core, ~1.9 s
after torch alone, on this project's 2-core test machine; ``benchmarks/bench_rank_import.py --library dynamo``)
from two kinds of wrapper that every backend's ranks call in eager mode:

- ``torch._disable_dynamo`` (``torch/_compile.py``): ``Optimizer.add_param_group``/``zero_grad``/``state_dict``/
  ``load_state_dict``, ``DTensor.__init__``, DDP's forward context, ``torch.utils.checkpoint`` ... import
  ``torch._dynamo`` at their first call to build ``torch._dynamo.disable(fn)``, cached as ``fn.__dynamo_disable``;
- ``_use_grad_for_differentiable`` (``torch/optim/optimizer.py``), around every ``step`` of Adam, AdamW, SGD ...:
  ``import torch._dynamo`` on each call, for two ``graph_break()`` calls that do nothing outside a compiled frame.

Both only matter inside a frame TorchDynamo compiles, and nothing compiles before ``torch._dynamo`` is imported
(``torch.compile`` imports it). ``install`` keeps each wrapper's behaviour and defers the import: while
``torch._dynamo`` is not in ``sys.modules`` the function runs as the wrapper would run it outside compilation
(the ``step``'s grad mode set and restored the same way); once anything has imported it, every call goes the original
way. Wrappers made after ``install`` (modules imported later) get the same treatment through ``torch._disable_dynamo``
and ``_use_grad_for_differentiable``. Where torch's internals differ from these (another torch version), ``install``
leaves them as they are: the ranks then import Dynamo as before, correct and slower.
"""

from __future__ import annotations

import functools
import sys
import types

_installed = False
_DYNAMO = "torch._dynamo"


def installed() -> bool:
    """True once ``install`` has deferred the import in this process."""
    return _installed


def install() -> bool:
    """Defer ``torch._dynamo`` as the module docstring says; returns whether the deferral is active. Idempotent;
    a no-op (False) where ``torch._dynamo`` is imported already or torch's wrappers are not the expected ones."""
    global _installed
    if _installed:
        return True
    import torch
    import torch.optim.optimizer as optim_mod

    if _DYNAMO in sys.modules or not hasattr(torch, "_disable_dynamo"):
        return False
    disable_code = _code_of(torch._disable_dynamo(lambda: None), ("fn", "recursive"))
    use_grad_code = _code_of(getattr(optim_mod, "_use_grad_for_differentiable", None), ("func",), probe=True)
    if disable_code is None or use_grad_code is None:
        return False
    _defer_existing(disable_code)
    _defer_steps(optim_mod.Optimizer, use_grad_code)
    _wrap_decorators(torch, optim_mod)
    _installed = True
    return True


def _code_of(wrapper, freevars: tuple[str, ...], probe: bool = False):
    """The code object of torch's wrapper (``probe``: of what the decorator returns), if its closure is as expected."""
    if wrapper is None:
        return None
    if probe:
        wrapper = wrapper(lambda *a, **k: None)
    code = getattr(wrapper, "__code__", None)
    return code if code is not None and code.co_freevars == freevars else None


def _cell(wrapper, name: str):
    return wrapper.__closure__[wrapper.__code__.co_freevars.index(name)].cell_contents


class _LazyDisable:
    """What ``torch._disable_dynamo``'s wrapper finds as ``fn.__dynamo_disable``: ``fn`` itself while Dynamo is not
    imported (nothing is being compiled, so there is nothing to disable), the real ``torch._dynamo.disable(fn)``
    from the first call after it is."""

    def __init__(self, fn, recursive: bool):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        if _DYNAMO not in sys.modules:
            return self.fn(*args, **kwargs)
        import torch._dynamo

        real = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)
        setattr(self.fn, "__dynamo_disable", real)  # the wrapper's own cache, as torch fills it (setattr: no mangling)
        return real(*args, **kwargs)


def _defer(wrapper, disable_code) -> bool:
    """Give one ``torch._disable_dynamo`` wrapper a lazy cache entry; False for anything else (only plain functions
    are looked at: other objects' attribute lookups can run code, e.g. ``torch.backends.cuda``'s)."""
    if type(wrapper) is not types.FunctionType or wrapper.__code__ is not disable_code:
        return False
    fn = _cell(wrapper, "fn")
    if getattr(fn, "__dynamo_disable", None) is None:
        fn.__dynamo_disable = _LazyDisable(fn, _cell(wrapper, "recursive"))
    return True


# The torch modules whose ``torch._disable_dynamo`` wrappers a rank calls (torch 2.13); those not imported when
# ``install`` runs are covered as they are imported (``_wrap_decorators``). Scanning every loaded torch module instead
# costs ~0.1 CPU-s per rank.
WRAPPER_MODULES = ("torch.optim.optimizer", "torch.nn.parallel.distributed", "torch.distributed.tensor._api",
                   "torch.utils.checkpoint", "torch.distributed._composable.replicate", "torch.library",
                   "torch._library.custom_ops")


def _defer_existing(disable_code, modules: tuple[str, ...] = WRAPPER_MODULES) -> int:
    """Every ``torch._disable_dynamo`` wrapper already made in ``modules`` (those imported): module functions and
    class attributes (and the functions under a ``contextmanager`` or a static/class method). Returns how many."""
    found = 0
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            found += _defer(value, disable_code)
            if isinstance(value, type):
                for attr in list(vars(value).values()):
                    if isinstance(attr, (staticmethod, classmethod)):
                        attr = attr.__func__
                    if type(attr) is types.FunctionType:
                        found += _defer(attr, disable_code) or _defer(attr.__dict__.get("__wrapped__"), disable_code)
    return found


def _deferred_step(use_grad):
    """``step`` as ``_use_grad_for_differentiable`` makes it, importing Dynamo only when it is already imported."""
    func = _cell(use_grad, "func")

    def step(*args, **kwargs):
        if _DYNAMO in sys.modules:
            return use_grad(*args, **kwargs)
        import torch

        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)

    functools.update_wrapper(step, func)
    step._hpc_tools_dynamo_lazy = True
    return step


def _defer_steps(base, use_grad_code) -> int:
    """Replace the ``step`` of every loaded optimizer class that ``_use_grad_for_differentiable`` wraps (under the
    profiling hook ``Optimizer`` adds at the first instance, when it is there already). Returns how many."""
    found, todo, seen = 0, [base], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        step = cls.__dict__.get("step")
        hooked = getattr(step, "hooked", False)
        inner = getattr(step, "__wrapped__", None) if hooked else step
        if getattr(inner, "__code__", None) is not use_grad_code:
            continue
        new = _deferred_step(inner)
        if hooked:
            new = base.profile_hook_step(new)
            new.hooked = True
        cls.step = new
        found += 1
    return found


def _wrap_decorators(torch, optim_mod) -> None:
    """Wrappers made from now on (a module imported later) are deferred as they are made."""
    disable_dynamo, use_grad_for_differentiable = torch._disable_dynamo, optim_mod._use_grad_for_differentiable
    disable_code = _code_of(disable_dynamo(lambda: None), ("fn", "recursive"))

    @functools.wraps(disable_dynamo)
    def lazy_disable_dynamo(fn=None, recursive=True):
        if fn is None:
            return functools.partial(lazy_disable_dynamo, recursive=recursive)
        wrapper = disable_dynamo(fn, recursive)
        _defer(wrapper, disable_code)
        return wrapper

    @functools.wraps(use_grad_for_differentiable)
    def lazy_use_grad(func):
        return _deferred_step(use_grad_for_differentiable(func))

    torch._disable_dynamo = lazy_disable_dynamo
    optim_mod._use_grad_for_differentiable = lazy_use_grad
