"""This rank's random-number state, captured into a checkpoint and restored from it (both backends).

The state is every generator a step can draw from: Python's ``random``, NumPy's global generator, torch's CPU
generator and, when torch sees CUDA, the current device's generator. A backend adds its own streams beside these
(Megatron: the tensor-parallel RNG tracker).
"""

from __future__ import annotations

import random
from typing import Any


def capture() -> dict[str, Any]:
    """The current states; ``cuda`` is None without CUDA (the key is always there, so the layout never varies)."""
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def restore(state: dict[str, Any]) -> None:
    """Set the generators from a ``capture()``; a CUDA state is applied only where torch sees CUDA."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
