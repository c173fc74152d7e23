"""Serving a trained model: ``hpc_tools serve`` (a job that puts a Hugging Face folder behind Triton Inference Server,
or vLLM's OpenAI server on GPU nodes), ``hpc_tools generate`` (its client) and the serving record of a run folder.

- ``serving.job``: the serving job (script, local process or Slurm job, readiness, the record, stopping it);
- ``serving.client``: KServe v2 REST requests to the ``generate`` model (standard library only);
- ``serving.triton_server``: the server itself, run as a file in the serving environment (environment/
  install-serve.sh), never imported here.

The control plane never imports torch: the server runs in its own environment, and a run is exported through
``hpc_tools.hf.export`` (which imports torch when called, as ``hpc_tools export`` does).
"""
