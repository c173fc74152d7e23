"""Published memory savings the planner does not model, named with their sources.

The memory terms (``hpc_tools.planner.memory``) are what Megatron-core, DeepSpeed and FSDP keep as they are built
here: 16-bit activations held until their backward, fp32 optimizer moments. Some published runs fit layouts this
model says do not, because their authors saved memory in ways no recipe field turns on. A plan that does not fit
names the ones that apply to it, so that "does not fit" is read as "does not fit as this project would run it".
"""

from __future__ import annotations

from hpc_tools.planner.knobs import Knobs

EARLY_FREE = ("tensors freed as soon as no later computation reads them: Meta trained Llama 3 405B on 8K sequences "
              "without activation checkpointing this way (arXiv 2407.21783, sec. 3.3.2)")
BF16_MOMENTS = ("optimizer moments in BF16 instead of fp32 (DeepSeek-V3, arXiv 2412.19437, sec. 3.3.3)")
FP8_ACTIVATIONS = ("activations cached in FP8 for the backward (DeepSeek-V3, arXiv 2412.19437, sec. 3.3.3)")


def memory_not_modelled(k: Knobs) -> list[str]:
    """The published savings that would lower this configuration's memory and that the plan does not count."""
    out = []
    if k.recompute != "full":
        out.append(EARLY_FREE)
    if k.scheme.moments_on_gpu(k):
        out.append(BF16_MOMENTS)
    if k.fp8 is not None:
        out.append(FP8_ACTIVATIONS)
    return out
