"""Checkpoint folders on disk, torch-free: naming and pointers (``dirs``) and what their files must be (``verify``).

The trainers write them; ``export``, ``resume``, ``status`` and the loop read them through these modules.
"""
