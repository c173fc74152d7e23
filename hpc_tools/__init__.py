"""hpc_tools: from a YAML recipe to a finished, analysed Megatron / DeepSpeed run on Slurm."""

__version__ = "0.1.0"
