"""After training: evaluating a run's checkpoints with lm-evaluation-harness (``eval``) and reducing a model with
torchao (``quantize``). docs/evaluate-and-quantize.md.

Modules: ``evaljob`` (``eval``'s work: every check first, then each model in turn or one job array), ``results``
(the files under ``<run>/eval/`` and their reading, light: status and the report read it), ``target`` (what a
command's RUN_OR_HF_DIR names, its checkpoints and their exports), ``tasks`` (lm-eval's task names and
--include-path), ``harness`` (one lm-eval run on a Hugging Face folder), ``quantize`` (torchao weight-only schemes),
``quantize_gpt2`` (a GPT-2 folder as the same network in ``nn.Linear`` layers, which torchao quantizes). The Slurm
job array of several checkpoints is rendered by ``hpc_tools.render.batch`` (``render_eval_array``) from the run's
recipe. Nothing imports torch, transformers or lm_eval at module level.
"""
