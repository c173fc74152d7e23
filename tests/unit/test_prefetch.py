"""The next step's batch built ahead (issue 25 item 11): the same tensors as building it in the step, built on the
background thread, nothing past the last step, failures raised at the step they belong to. On CPU the trainers build
inline (``background=False``): the same code path, no thread."""

from __future__ import annotations

import threading

import pytest
import torch

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.train.prefetch import BatchPrefetcher, pin_batch

LAST = 6


def setup():
    recipe = resolve({"name": "p", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                             "seq_length": 16, "vocab_size": 512},
                      "training": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": LAST},
                      "cluster": {"gpus_per_node": 2, "gpu_type": "cpu"}})
    return build_samples(recipe), ParallelLayout.from_recipe(recipe)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("background", [True, False])
def test_batches_are_those_of_the_step_whichever_thread_builds_them(background):
    samples, layout = setup()
    threads: dict[int, str] = {}

    def build(step):
        threads[step] = threading.current_thread().name
        return microbatches_for_step(samples, step, 1, layout)

    prefetch = BatchPrefetcher(build, LAST, background=background, pin=False)
    try:
        for step in range(3, LAST + 1):  # a resumed run starts past step 1
            assert same(prefetch.get(step), microbatches_for_step(samples, step, 1, layout)), step
            assert prefetch.ahead == (step + 1 if background and step < LAST else None)
    finally:
        prefetch.close()
    assert sorted(threads) == list(range(3, LAST + 1)), "nothing is built past the last step"
    ahead = {s for s, name in threads.items() if name.startswith("batch-prefetch")}
    assert ahead == (set(range(4, LAST + 1)) if background else set())  # the first one is built in the step


def test_a_step_asked_out_of_order_is_built_then_and_a_failure_ahead_raises_at_its_step():
    samples, layout = setup()

    def build(step):
        if step == 5:
            raise ValueError("bad shard at step 5")
        return microbatches_for_step(samples, step, 0, layout)

    prefetch = BatchPrefetcher(build, LAST, background=True, pin=False)
    try:
        prefetch.get(2)  # 3 is built ahead
        assert same(prefetch.get(4), microbatches_for_step(samples, 4, 0, layout))  # not 3's batch
        with pytest.raises(ValueError, match="bad shard at step 5"):
            prefetch.get(5)
    finally:
        prefetch.close()


def test_pin_batch_pins_every_tensor_and_keeps_the_rest():
    if not torch.cuda.is_available():
        pytest.skip("page-locked memory needs CUDA (benchmarks/gpu_smoke.sh runs this: its gpu_units step)")
    samples, layout = setup()
    batch = pin_batch([{**mb, "poison": True} for mb in microbatches_for_step(samples, 1, 0, layout)])
    assert all(mb["tokens"].is_pinned() and mb["labels"].is_pinned() and mb["poison"] is True for mb in batch)
