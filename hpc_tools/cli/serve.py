"""``serve RUN_OR_HF_DIR``: a job that serves the model behind Triton Inference Server (or vLLM's OpenAI server)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import (
    COUNT,
    PORT,
    SECONDS,
    add_json,
    add_runs_dir,
    emit_json,
    real_number,
    say,
    whole_number,
)

NAME = "serve"
ORDER = 62
HELP = ("serve a run (exported first) or a Hugging Face folder behind Triton Inference Server, as a local process "
        "or a Slurm job on a node of its own; returns once the server is ready and records its endpoint")
DESCRIPTION = """\
Starts a serving job over the model: the run's newest verified checkpoint, exported once to <run>/exports/ (the
export eval and quantize read too), or a Hugging Face folder (it gets a run folder of its own, kind serve). With
--engine triton (the default, CPU or GPU) the job runs, in the serving environment (environment/install-serve.sh;
$HPC_TOOLS_SERVE_ENV), Triton Inference Server through PyTriton with a model named generate behind Triton's dynamic
batcher (inputs input_ids or text, max_tokens, optional temperature; greedy decoding by default); with --engine vllm
(GPU nodes only) vLLM's OpenAI-compatible server. The command returns once the model answers readiness, and the run
folder then holds the endpoint {host, http_port, grpc_port} (`status RUN` shows it). `generate RUN --prompt TEXT` is
the client; `cancel RUN` stops the server. Refused before anything starts (one line, exit 2): a run without a
verified checkpoint, a port in use, a model larger than the node's memory by the planner's count, a missing serving
environment, --engine vllm without a GPU. Engines and figures: docs/serving.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_OR_HF_DIR", help="run folder, run id (or unique prefix), Slurm job id, or a "
                                                        "Hugging Face model folder")
    p.add_argument("--engine", choices=["triton", "vllm"], default="triton",
                   help="triton (CPU and GPU, default) or vllm (vLLM's OpenAI server; GPU nodes only)")
    p.add_argument("--executor", choices=["local", "slurm"], default=None,
                   help="local process group, or a Slurm job on a node of its own with the run's recipe's account, "
                        "qos, partition, constraint and set-up (default: slurm where Slurm is installed, refused in "
                        "one line when its controller does not answer; local without Slurm)")
    p.add_argument("--time", default="1:00", metavar="H:MM", help="time limit of the serving job (default 1:00)")
    p.add_argument("--http-port", type=PORT, default=8000, help="HTTP port (default 8000, Triton's; 0: any free)")
    p.add_argument("--grpc-port", type=PORT, default=8001, help="gRPC port (default 8001, Triton's; 0: any free)")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--gpus", type=whole_number(0, 1024, what="GPUs of one node"), default=0,
                   help="GPUs of the Slurm node to request (--engine vllm needs >= 1)")
    p.add_argument("--mem", type=real_number(0.0, what="GB of memory", above=True), default=None, metavar="GB",
                   help="memory to request for the job (Slurm --mem) and to check the model against")
    p.add_argument("--max-batch-size", type=COUNT, default=8, help="largest batch Triton's dynamic batcher forms")
    p.add_argument("--ready-timeout", type=SECONDS, default=600, metavar="S",
                   help="seconds to wait for readiness (a pending Slurm job counts); the job is cancelled after")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpc_tools.errors import UserError
    from hpc_tools.serving import job
    from hpc_tools.submission import choose_executor

    # The rule of every command: no Slurm here -> local, said; Slurm that does not answer -> one line, nothing written.
    args.executor, note = choose_executor(args.executor or "auto", local="")
    opts = job.ServeOptions(engine=args.engine, executor=args.executor, time=args.time, http_port=args.http_port,
                            grpc_port=args.grpc_port, partition=args.partition, gpus=args.gpus, mem_gb=args.mem,
                            max_batch_size=args.max_batch_size, ready_timeout_s=args.ready_timeout)
    job.check_time(opts.time)
    job.check_engine(opts)
    job.check_ports(opts)
    python = job.serve_python() if opts.engine == "triton" else Path("python3")
    job.check_gpus(opts, python)
    folder = job.model_folder(args.run)
    if folder is not None:  # a Hugging Face folder: checked, then given a run folder of its own
        job.check_memory(job.folder_weight_bytes(folder), job.hf_config(folder), opts)
        from hpc_tools.registry import runs_root

        run, model_dir = job.serve_run(folder, runs_root(args.runs_dir)), folder
    else:
        run, model_dir = job.target(args.run, args.runs_dir)
        record = run.manifest().get("serve") or {}
        if record.get("state") in job.LIVE and job.refresh(run).get("state") in job.LIVE:
            raise UserError(f"run {run.run_id} is already served at {run.manifest().get('endpoint')} "
                            f"(stop it first: `python -m hpc_tools cancel {run.run_id}`)")
        if model_dir is None:
            from hpc_tools.hf.export import checkpoint_root, run_recipe, verified_checkpoint

            verified_checkpoint(run, checkpoint_root(run_recipe(run), run), None)  # one line when there is none
            job.check_memory(job.run_weight_bytes(run), {}, opts)  # the planner's count, before any export
            model_dir = job.export_for_serving(run)
        job.check_memory(job.folder_weight_bytes(model_dir), job.hf_config(model_dir), opts)
    if note and not args.json:
        say(note)
    endpoint = job.start(run, model_dir, opts, python)
    if args.json:
        emit_json({"ok": True, "run_dir": str(run.path), "run_id": run.run_id, "endpoint": job.public(endpoint),
                   "engine": opts.engine, "executor": opts.executor, "model_dir": str(model_dir),
                   **{k: v for k, v in (run.manifest().get("serve") or {}).items() if k in ("job_id", "pid", "log")}})
    else:
        say(f"serving {run.run_id} ({opts.engine}, {opts.executor}) at http://{endpoint['host']}:"
            f"{endpoint['http_port']} (gRPC {endpoint['host']}:{endpoint['grpc_port']}); "
            f"`python -m hpc_tools generate {run.run_id} --prompt TEXT`, stop with `cancel {run.run_id}`")
    return 0
