"""Megatron-core's local core attention on ``torch.nn.functional.scaled_dot_product_attention`` (the ``sdpa``
attention path): a drop-in for megatron-core's ``DotProductAttention`` in the local layer spec, built where the layers
are local and ``backend.megatron.use_flash_attention`` is true (``layers.layer_plan``; ``model.block_spec`` puts it in
the spec).

Megatron's own local attention materialises the s x s scores, their fp32 softmax and the probabilities the P.V matmul
saves (O(s^2) memory, several kernels). SDPA runs torch's flash, cuDNN or memory-efficient kernel on a GPU and
torch's flash kernel for CPU (dropout 0) or its math kernel (dropout > 0) on CPU, so the CPU tests run the code the
GPUs run. It subclasses ``DotProductAttention``: the constructor is megatron-core's (heads and groups per
tensor-parallel partition, the softmax scale, the dropout module, the context-parallel assertion, the sharded state
dict), only ``forward`` differs. Inputs ``[s, b, heads_per_partition, head_dim]`` (keys and values with the groups
per partition), output ``[s, b, hidden_per_partition]``, as megatron-core's.

What SDPA cannot do is refused at build in one line (``UserError``): a softmax other than the vanilla one
(``softmax_type``: SDPA has no softmax offset), sliding-window attention (``window_size``), and, at the forward,
attention bias and packed sequences (megatron-core's local attention asserts both too). Context parallelism is
refused before (``config.context_options``: local layers have none).
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


def _version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


GQA_TORCH = (2, 5)
"""The first torch whose ``scaled_dot_product_attention`` takes ``enable_gqa``."""


class SDPAttention(DotProductAttention):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        extra = {k: v for k, v in (("k_channels", k_channels), ("v_channels", v_channels)) if v is not None}
        # (k_channels / v_channels: multi-latent attention on CPU, where cpu_compat's DotProductAttention takes them)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **extra)
        refuse_unsupported(config, self.scale_mask_softmax.window_size)
        # Megatron divides the scale by the layer number under apply_query_key_layer_scaling and multiplies the
        # scores back by it inside its softmax: the net scale is the one before the division.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)
        self.sdpa_gqa = _version() >= GQA_TORCH

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key and value -> ``[sq, b, np * hn]``."""
        import torch
        import torch.nn.functional as F
        from megatron.core import tensor_parallel

        from hpc_tools.errors import UserError

        if packed_seq_params is not None or attention_bias is not None:
            what = "packed sequences" if packed_seq_params is not None else "attention bias"
            raise UserError(f"backend.megatron.use_flash_attention=true runs the local layers' attention on torch's "
                            f"scaled_dot_product_attention, which takes no {what} here (set use_flash_attention: "
                            "false, or run Transformer Engine layers)")
        heads, groups = query.size(2), key.size(2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn] views
        options = {}
        if groups != heads:
            if self.sdpa_gqa and (q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)):
                # torch's flash kernels (CUDA: 16-bit only; CPU) take grouped K/V as they are; its cuDNN and
                # memory-efficient kernels do not, and an fp32 CUDA call would fall back to the O(s^2) math kernel
                options["enable_gqa"] = True
            else:
                k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is not None:  # megatron's boolean mask is True where a score is masked out
            options["attn_mask"] = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask
        else:
            options["is_causal"] = mask_type.name == "causal" and q.size(2) > 1
        dropout = self.attention_dropout.p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.sdpa_scale, **options)

        if dropout and not self.config.sequence_parallel:  # the model-parallel RNG stream, as megatron's dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, np, sq, hn] -> [sq, b, np, hn] -> [sq, b, hp]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], -1)


def refuse_unsupported(config, window_size) -> None:
    """One line for what SDPA cannot compute that the local attention can: a softmax offset, a sliding window."""
    from hpc_tools.errors import UserError

    if config.softmax_type != "vanilla":
        raise UserError(f"softmax_type={config.softmax_type} needs a softmax offset, which torch's "
                        "scaled_dot_product_attention has not (set backend.megatron.use_flash_attention: false)")
    if window_size is not None:
        raise UserError(f"window_size={tuple(window_size)} (sliding-window attention) is not run on torch's "
                        "scaled_dot_product_attention here (set backend.megatron.use_flash_attention: false)")
