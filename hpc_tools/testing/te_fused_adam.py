"""A CPU stand-in for Transformer Engine's ``FusedAdam`` with the same optimizer-state contract.

TE's ``FusedAdam`` (``transformer_engine/pytorch/optimizers/fused_adam.py``) is what megatron-core wraps whenever TE
imports (``megatron/core/optimizer/__init__.py``), but it launches CUDA kernels, so a CPU test cannot run it. This
double reproduces, line for line, the parts of its contract that checkpoint code depends on:

- ``name_to_dtype_map = {"exp_avg", "exp_avg_sq", "master_param"}``; ``get_unscaled_state(param, name)`` and
  ``set_scaled_state(param, name, value)`` look the name up there, so any other per-parameter key (torch AdamW's
  ``step``) raises ``KeyError``;
- ``state_dict()`` = torch's, then every per-parameter entry replaced by ``get_unscaled_state`` of each of its keys;
- ``load_state_dict()`` = torch's, then every per-parameter state rebuilt with ``set_scaled_state`` of each key;
- ``step()`` keeps the step count per parameter group: ``group["step"] += 1`` (an int, created at 1), skipping empty
  groups; the state is created at the first step with ``initialize_state`` (zeros);
- the update is TE's ``multi_tensor_adam`` kernel's: bias-corrected moments, ``adam_w_mode`` 1 = decoupled decay
  (``update = m_hat / (sqrt(v_hat) + eps) + wd * p``), 0 = L2 (``g + wd * p`` enters the moments).

Only fp32 states are modelled (the defaults megatron-core uses without the precision-aware optimizer).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class FusedAdamDouble(torch.optim.Optimizer):
    """TE ``FusedAdam``'s state contract and update on CPU tensors (see the module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, **_unused):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = False
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}

    def get_unscaled_state(self, param, state_name):
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]  # TE: KeyError for a key it does not know (e.g. "step")
        assert dtype == torch.float32 and state[state_name].dtype == torch.float32
        return state[state_name]

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False)
        state[state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name, zero_buffer: bool):
        dtype = self.name_to_dtype_map[state_name]
        data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders=False):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def state_dict(self):
        state_dict = super().state_dict()
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        id_map = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {name: self.get_unscaled_state(id_map[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        id_map = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is not None:
                        self.set_scaled_state(param, name, v[name].float())

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            step, lr, eps, wd = group["step"], group["lr"], group["eps"], group["weight_decay"]
            bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g = p.grad.float()
                if not self.adam_w_mode and wd != 0:
                    g = g + wd * p
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode and wd != 0:
                    update = update + wd * p
                p.add_(update, alpha=-lr)
        return loss


@contextmanager
def megatron_uses_fused_adam_double():
    """megatron-core as it is when Transformer Engine imports: ``get_megatron_optimizer`` builds the TE optimizer
    (here the double) and the distributed optimizer takes its TE branches (step per parameter group)."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    names = ("Adam", "USING_PYTORCH_OPTIMIZER"), ("Adam", "HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER")
    values = (FusedAdamDouble, False), (FusedAdamDouble, True, True)
    saved = [[getattr(mod, n) for n in group] for mod, group in zip((mo, do), names)]
    try:
        for mod, group, vals in zip((mo, do), names, values):
            for n, v in zip(group, vals):
                setattr(mod, n, v)
        yield
    finally:
        for mod, group, vals in zip((mo, do), names, saved):
            for n, v in zip(group, vals):
                setattr(mod, n, v)
