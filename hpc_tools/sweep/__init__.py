"""Sweeps: a recipe's grid expanded into cells, submitted as Slurm job arrays (or run locally), tracked per cell."""
