"""The parallel layout owns all parallel arithmetic."""

from __future__ import annotations

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe, resolve
from hpc_tools.render.slurm_params import SlurmSpec
from tests.helpers import REPO

BASE = {"name": "t", "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 32,
                               "vocab_size": 512}}


def layout(**sections) -> ParallelLayout:
    raw = {**BASE, **sections}
    return ParallelLayout.from_recipe(resolve(raw))


def test_data_size_is_inferred_from_the_world():
    lay = layout(parallel={"tensor_size": 2, "pipeline_size": 2}, cluster={"nodes": 2, "gpus_per_node": 8},
                 training={"micro_batch_size": 2, "global_batch_size": 64})
    assert (lay.world_size, lay.data_size, lay.layout_size) == (16, 4, 16)
    assert lay.num_microbatches == 64 // (2 * 4)
    assert lay.deepspeed_batch() == {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                     "gradient_accumulation_steps": 8}
    assert lay.megatron_sizes() == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                    "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
                                    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2}


def test_global_batch_defaults_to_one_microbatch_per_rank():
    lay = layout(cluster={"nodes": 1, "gpus_per_node": 4}, training={"micro_batch_size": 3})
    assert (lay.data_size, lay.global_batch_size, lay.num_microbatches) == (4, 12, 1)


def test_bubble_fraction_plain_and_interleaved():
    plain = layout(parallel={"pipeline_size": 4}, cluster={"nodes": 1, "gpus_per_node": 4},
                   training={"global_batch_size": 16})
    assert plain.bubble_fraction == 3 / 16
    inter = layout(parallel={"pipeline_size": 4, "virtual_pipeline_size": 2}, cluster={"nodes": 1, "gpus_per_node": 4},
                   training={"global_batch_size": 16})
    assert inter.bubble_fraction == 3 / (2 * 16)
    assert layout(cluster={"nodes": 1, "gpus_per_node": 1}).bubble_fraction == 0.0


def test_slurm_resources_come_from_the_layout():
    recipe = load_recipe(REPO / "recipes/gpt_3d.yaml")
    lay, spec = ParallelLayout.from_recipe(recipe), SlurmSpec.from_recipe(recipe)
    assert (spec.nodes, spec.ntasks_per_node, spec.gpus_per_node) == (lay.nodes, lay.ranks_per_node, lay.ranks_per_node)
    params = spec.submitit_parameters()
    assert (params["nodes"], params["ntasks_per_node"], params["gpus_per_node"]) == (lay.nodes, lay.ranks_per_node,
                                                                                    lay.ranks_per_node)
    assert params["time"] == recipe.cluster.time_limit_min and params["signal_delay_s"] == recipe.cluster.signal_delay_s
    cpu = SlurmSpec.from_recipe(load_recipe(REPO / "recipes/gpt_3d.yaml", profile="local"))
    assert cpu.gpus_per_node is None and "gpus-per-node" not in dict(cpu.sbatch_options())
