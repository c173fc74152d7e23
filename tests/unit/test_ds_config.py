"""recipe -> ds_config.json: the batch triple from the layout, overrides, a round trip through DeepSpeed's parser."""

from __future__ import annotations

import json

import pytest

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve
from hpc_tools.train.deepspeed.ds_config import BATCH_KEYS, build_ds_config, render, write_ds_config
from hpc_tools.train.schedule import lr_at


def make_recipe(*, ranks=2, pipeline=1, micro=2, global_batch=16, stage=1, precision="bf16", offload_opt="none",
                offload_param="none", overrides=None, nvme=None, **training):
    return resolve({
        "name": "ds", "model": {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "seq_length": 32, "vocab_size": 512},
        "parallel": {"pipeline_size": pipeline},
        "training": {"micro_batch_size": micro, "global_batch_size": global_batch, "precision": precision, **training},
        "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": stage, "offload_optimizer": offload_opt,
                                                       "offload_param": offload_param, "nvme_path": nvme,
                                                       "config_overrides": overrides or {}}},
        "cluster": {"gpus_per_node": ranks, "gpu_type": "cpu" if precision != "fp16" else "H100-SXM"}})


@pytest.mark.parametrize("ranks,pipeline,micro,global_batch", [(2, 1, 2, 16), (4, 1, 1, 16), (4, 2, 2, 16),
                                                               (1, 1, 4, 4)])
def test_batch_triple_comes_from_the_layout(ranks, pipeline, micro, global_batch):
    recipe = make_recipe(ranks=ranks, pipeline=pipeline, micro=micro, global_batch=global_batch)
    layout = ParallelLayout.from_recipe(recipe)
    cfg = build_ds_config(recipe, layout)
    assert {k: cfg[k] for k in BATCH_KEYS} == layout.deepspeed_batch()
    assert cfg["train_batch_size"] == micro * cfg["gradient_accumulation_steps"] * layout.data_size == global_batch


def test_sections_follow_the_recipe(tmp_path):
    r = make_recipe(stage=3, offload_opt="cpu", offload_param="nvme", nvme="/local_nvme", precision="bf16",
                    clip_grad=0.5, lr=2e-4, weight_decay=0.01, adam_beta2=0.98)
    cfg = build_ds_config(r, ParallelLayout.from_recipe(r))
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                        "offload_param": {"device": "nvme", "pin_memory": False,
                                                          "nvme_path": "/local_nvme"}}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["gradient_clipping"] == 0.5
    params = cfg["optimizer"]["params"]
    assert params["lr"] == 2e-4 and params["betas"] == [0.9, 0.98] and params["weight_decay"] == 0.01
    assert params["torch_adam"] is True  # no compiled optimizer ops
    path = write_ds_config(cfg, tmp_path)
    assert json.loads(path.read_text()) == cfg and path.read_text() == render(cfg)


def test_overrides_merge_last_but_cannot_change_the_batch():
    r = make_recipe(stage=3, overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0},
                                        "gradient_clipping": 2.0, "train_batch_size": 16})
    cfg = build_ds_config(r, ParallelLayout.from_recipe(r))
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}  # merged, not replaced
    assert cfg["gradient_clipping"] == 2.0
    for key, value in (("train_batch_size", 32), ("gradient_accumulation_steps", 1),
                       ("train_micro_batch_size_per_gpu", 4)):
        bad = make_recipe(overrides={key: value})
        with pytest.raises(UserError,
                           match=rf"backend.deepspeed.config_overrides.{key}={value} cannot change the batch"):
            build_ds_config(bad, ParallelLayout.from_recipe(bad))


@pytest.fixture(scope="module")
def deepspeed_comm():
    """A one-process gloo group, handed to deepspeed.comm (its config parser reads the rank through it)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed.comm
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build for a config test
    deepspeed.comm.init_distributed("gloo", dist_init_required=False, verbose=False)
    yield
    if created:
        dist.destroy_process_group()


class DataParallelOf:
    """DeepSpeed's model-parallel-unit interface, answering the layout's data-parallel size (as Megatron's mpu does)."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.mark.deepspeed
@pytest.mark.parametrize("kwargs", [
    {"ranks": 2, "stage": 0, "precision": "fp32"},
    {"ranks": 4, "micro": 1, "stage": 2, "offload_opt": "cpu", "precision": "bf16"},
    {"ranks": 4, "pipeline": 2, "stage": 1, "precision": "bf16"},
    {"ranks": 8, "stage": 3, "offload_opt": "nvme", "offload_param": "cpu", "nvme": "/nvme", "precision": "fp16",
     "overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
])
def test_round_trip_through_deepspeeds_parser(deepspeed_comm, kwargs, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    r = make_recipe(**kwargs)
    layout = ParallelLayout.from_recipe(r)
    written = write_ds_config(build_ds_config(r, layout), tmp_path)
    parsed = DeepSpeedConfig(str(written), mpu=DataParallelOf(layout.data_size))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == \
        (layout.global_batch_size, layout.micro_batch_size, layout.num_microbatches)
    assert parsed.zero_optimization_stage == kwargs["stage"]
    offload = parsed.zero_config.offload_optimizer
    assert (offload.device if offload else "none") == kwargs.get("offload_opt", "none")
    param = parsed.zero_config.offload_param
    assert (param.device if param else "none") == kwargs.get("offload_param", "none")
    assert parsed.bfloat16_config.enabled == (kwargs["precision"] == "bf16")
    assert parsed.float16_config.enabled == (kwargs["precision"] == "fp16")
    assert parsed.gradient_clipping == r.training.clip_grad
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == r.training.lr
    if "overrides" in kwargs:
        assert parsed.zero_config.param_persistence_threshold == 0
    # DeepSpeed's own batch check refuses a triple that does not multiply out
    bad = json.loads(written.read_text())
    bad["train_batch_size"] += layout.data_size
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        DeepSpeedConfig(bad, mpu=DataParallelOf(layout.data_size))


def test_lr_schedule_shape():
    t = make_recipe(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, train_iters=110).training
    assert lr_at(t, 1) == pytest.approx(1e-4) and lr_at(t, 10) == pytest.approx(1e-3)
    assert lr_at(t, 60) == pytest.approx(5.5e-4)  # cosine half way
    assert lr_at(t, 110) == pytest.approx(1e-4) and lr_at(t, 500) == pytest.approx(1e-4)
    lin = make_recipe(lr=1e-3, min_lr=0.0, lr_warmup_iters=0, train_iters=100, lr_decay_style="linear").training
    assert lr_at(lin, 50) == pytest.approx(5e-4)
    const = make_recipe(lr=1e-3, lr_warmup_iters=5, lr_decay_style="constant").training
    assert lr_at(const, 3) == pytest.approx(6e-4) and lr_at(const, 99) == 1e-3
