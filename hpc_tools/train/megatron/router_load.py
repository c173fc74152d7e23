"""What the mixture-of-experts routers did in a step: the tokens each expert received and the load-balancing loss.

``RouterLoad`` hooks every ``TopKRouter`` of this rank's model chunks and counts, per MoE layer, the tokens routed to
each expert (``routing_map.sum(0)``: a token counts once for each of its top-k experts) in the training forwards of
a step; evaluation forwards (no grad) and the recomputation of a layer inside backward (activation checkpointing runs
the router again) are not counted. ``step()`` reduces the counts over every rank once per step (the layers of all
pipeline stages, the tokens of all data/context/sequence-parallel shards), reads megatron-core's aux-loss tracker
(reduced as Megatron-LM reduces it, ``reduce_aux_losses_tracker_across_ranks``) and returns the step's figures, the
same on every rank:

- ``moe_tokens_per_expert``: tokens routed to each expert in the step, summed over the MoE layers;
- ``moe_load_imbalance``: max over the MoE layers of (tokens of the busiest expert / mean tokens per expert); 1.0 is
  a perfectly even load, ``num_experts / topk`` the worst (every token to the same k experts);
- ``moe_aux_loss``: the load-balancing loss (without its coefficient), mean over the MoE layers and microbatches, as
  Megatron-LM logs ``load_balancing_loss``; None when the router has no aux loss (``load_balancing_type: none``).
"""

from __future__ import annotations

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

    def step(self, num_microbatches: int) -> dict[str, Any]:
        """The step's figures (collective: every rank calls it after the forward/backward of every step)."""
        import torch

        counts = self.counts.clone()
        self.counts.zero_()
        torch.distributed.all_reduce(counts)
        counts /= self.tp_duplicates
        used = counts[counts.sum(1) > 0]
        imbalance = None
        if len(used):
            imbalance = float((used.max(1).values / used.mean(1)).max())
        return {"moe_tokens_per_expert": [int(round(x)) for x in counts.sum(0).tolist()],
                "moe_load_imbalance": imbalance, "moe_aux_loss": self._aux_loss(num_microbatches)}

    def _aux_loss(self, num_microbatches: int) -> float | None:
        """Megatron-LM's ``load_balancing_loss`` figure: each rank's tracker holds, per layer, its partial sums over
        the tokens it routed (summed over its microbatches); summed over the tensor/context-parallel shards and
        averaged over data-parallel replicas (as ``reduce_aux_losses_tracker_across_ranks`` does), over the layers
        and microbatches. Reduced here in one all-reduce over the world, so a stage without MoE layers takes part
        too (megatron's own reduction would wait for it in groups it never joined)."""
        import torch
        from megatron.core.transformer.moe import moe_utils

        if self.aux_name is None:
            return None
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        values = torch.zeros(self.num_layers, dtype=torch.float64, device=self.counts.device)
        if self.aux_name in tracker:
            values += tracker[self.aux_name]["values"].double()
            tracker[self.aux_name]["values"].zero_()
        torch.distributed.all_reduce(values)
        return float(values.sum()) / (self.data_size * self.moe_layers * num_microbatches)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
