"""backend.kind: deepspeed — a Hugging Face causal LM under DeepSpeed ZeRO (stages 0-3, offload, its pipeline).

Modules: ``ds_config`` (recipe -> ds_config.json), ``model`` (the HF model from ``model:`` or a local folder, with the
initial values of ``hpc_tools.train.hf_causal_lm``, whose loss it trains on), ``pipeline`` (the same model as a
DeepSpeed PipelineModule), ``trainer`` (``run(ctx)`` on every rank), ``export`` (a trained run -> a plain Hugging
Face model folder), ``device`` (the rank's device as DeepSpeed sees it). Only ``trainer`` and ``export`` import
torch/deepspeed, and only when called.
"""
