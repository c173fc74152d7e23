"""What the mixture-of-experts routers did in a step: the tokens each expert received and the load-balancing loss.

``RouterLoad`` hooks every ``TopKRouter`` of this rank's model chunks and counts, per MoE layer, the tokens routed to
each expert (``routing_map.sum(0)``: a token counts once for each of its top-k experts) in the training forwards of
a step; evaluation forwards (no grad) and the recomputation of a layer inside backward (activation checkpointing runs
the router again) are not counted. ``step_tensor()`` reduces the counts and megatron-core's aux-loss tracker over
every rank in one all-reduce per step (the layers of all pipeline stages, the tokens of all data/context/
sequence-parallel shards; the aux loss as Megatron-LM reduces it, ``reduce_aux_losses_tracker_across_ranks``) and
computes the step's figures on the device, without a host read: the engine reads them with the loss, in the one
host read of its step (``figures()`` turns the values read into the figures, the same on every rank):

- ``moe_tokens_per_expert``: tokens routed to each expert in the step, summed over the MoE layers;
- ``moe_load_imbalance``: max over the MoE layers of (tokens of the busiest expert / mean tokens per expert); 1.0 is
  a perfectly even load, ``num_experts / topk`` the worst (every token to the same k experts);
- ``moe_aux_loss``: the load-balancing loss (without its coefficient), mean over the MoE layers and microbatches, as
  Megatron-LM logs ``load_balancing_loss``; None when the router has no aux loss (``load_balancing_type: none``).
"""

from __future__ import annotations

import math
from typing import Any

AUX_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
"""megatron-core 0.16.1's tracker name of each load-balancing type's loss (``router.py``)."""


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass in this thread (where activation recomputation runs)."""
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class RouterLoad:
    """Per-step router figures of this rank's MoE layers (module docstring)."""

    def __init__(self, chunks: list, config, data_size: int, device) -> None:
        """``config``: the model's TransformerConfig; ``data_size``: the layout's (dense) data-parallel size."""
        import torch
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts, self.num_layers = config.num_moe_experts, config.num_layers
        freq = config.moe_layer_freq
        pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(self.num_layers)]
        self.moe_layers = max(sum(pattern), 1)
        # ranks that route the same tokens: tensor parallelism without sequence parallelism (evaluation only)
        self.tp_duplicates = 1 if config.sequence_parallel else config.tensor_model_parallel_size
        self.data_size = data_size
        self.aux_name = AUX_NAMES.get(config.moe_router_load_balancing_type)
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device)
        self.handles = [m.register_forward_hook(self._count) for chunk in chunks for m in chunk.modules()
                        if isinstance(m, TopKRouter)]

    def _count(self, module, inputs, output) -> None:
        import torch

        if not (module.training and torch.is_grad_enabled()) or in_backward():
            return
        routing_map = output[1]
        with torch.no_grad():
            self.counts[module.layer_number - 1] += routing_map.reshape(-1, self.num_experts).sum(0).double()

    def step_tensor(self, num_microbatches: int):
        """The step's figures on the device (collective: every rank calls it after the forward/backward of every
        step): one float64 tensor of ``num_experts + 2`` values, the tokens per expert, the imbalance (-inf when no
        MoE layer routed a token) and the aux loss (of ``_aux_values``; 0 without one), for ``figures`` once read.

        One all-reduce over the world for the counts and the aux-loss tracker together, and no host read (the
        imbalance is masked over the layers that routed, not indexed by them, which would read their number)."""
        import torch

        n = self.num_layers * self.num_experts
        reduced = torch.cat([self.counts.reshape(-1), self._aux_values()])
        self.counts.zero_()
        torch.distributed.all_reduce(reduced)
        counts = reduced[:n].reshape(self.num_layers, self.num_experts) / self.tp_duplicates
        ratio = counts.max(1).values / counts.mean(1)
        imbalance = torch.where(counts.sum(1) > 0, ratio, torch.full_like(ratio, -math.inf)).max()
        aux = reduced[n:].sum() / (self.data_size * self.moe_layers * num_microbatches)
        return torch.cat([counts.sum(0), imbalance.reshape(1), aux.reshape(1)])

    def figures(self, values: list[float]) -> dict[str, Any]:
        """The step's figures from ``step_tensor``'s values read to the host."""
        tokens, imbalance, aux = values[:self.num_experts], values[self.num_experts], values[self.num_experts + 1]
        return {"moe_tokens_per_expert": [int(round(x)) for x in tokens],
                "moe_load_imbalance": None if imbalance == -math.inf else imbalance,
                "moe_aux_loss": None if self.aux_name is None else aux}

    def step(self, num_microbatches: int) -> dict[str, Any]:
        """``step_tensor`` read to the host on its own (one read; the engine reads it with the loss instead)."""
        return self.figures(self.step_tensor(num_microbatches).tolist())

    def _aux_values(self):
        """Per layer, this rank's share of Megatron-LM's ``load_balancing_loss`` figure (its tracker's partial sums
        over the tokens it routed, summed over its microbatches; the tracker is zeroed): summed over every rank by
        ``step_tensor``'s all-reduce (over the tensor/context-parallel shards, and over the data-parallel replicas,
        which the figure then averages, as ``reduce_aux_losses_tracker_across_ranks`` does), then over the layers
        and microbatches. Reduced over the world, so a stage without MoE layers takes part too (megatron's own
        reduction would wait for it in groups it never joined). Zeros without an aux loss."""
        import torch
        from megatron.core.transformer.moe import moe_utils

        values = torch.zeros(self.num_layers, dtype=torch.float64, device=self.counts.device)
        if self.aux_name is None:
            return values
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if self.aux_name in tracker:
            values += tracker[self.aux_name]["values"].double()
            tracker[self.aux_name]["values"].zero_()
        return values

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
