"""Rendering a recipe into the artefacts Slurm runs: the sbatch script and the submitit parameters."""
