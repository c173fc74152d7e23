#!/usr/bin/env bash
# The GPU smoke run: everything a lent one-GPU machine should check, in one go, with one summary file.
#
#   bash benchmarks/gpu_smoke.sh --fetch-wheels DIR   # on a machine with network and torch: the wheels to carry
#   bash benchmarks/gpu_smoke.sh [--wheels DIR] [--out DIR (default $OUT, else a temp folder)] [--dry-run]
#                                [--only STEP,STEP... (those steps alone: a rerun of what failed)]
#                                [--budget-s S (no step starts after S seconds; each step's limit ends by then)]
#
# On the GPU machine (no network): installs what --wheels holds (megatron-core, a pure-Python deepspeed wheel,
# pydantic and its parts, submitit, transformers...), then runs, each step with its own time limit and log:
#   env            `hpc_tools doctor` of megatron_save's recipe: Python, the packages that job needs, torch's
#                  CUDA, the GPU, NCCL, TE / apex / flash-attn (a package only other backends need, Horovod's, Ray's
#                  or `datasets`, is a warning when absent, not a failure)
#   moe_local      gpt_moe's local profile on 1 GPU, local layers, unfused attention, 2 steps: the fp32 router's
#                  GEMM without Transformer Engine (Megatron-core's te_general_gemm is unbound there)
#   mla_local      the same with multi_latent_attention=true: must be refused in one line (exit 2), not a TypeError
#   profiling      tests/integration/test_profiling_gpu.py (event timing, memory, NVML)
#   gpu_units      the fast tier's modules with a CUDA branch (test_prefetch's page-locked batches, test_gpu_path,
#                  test_gpu_refusals, test_megatron_cpu_compat): they must pass on a GPU machine too
#   deepspeed      tests/integration/test_deepspeed_gpu.py (ZeRO 1-3, bf16/fp16, NCCL)
#   fsdp           tests/integration/test_fsdp_gpu.py (FSDP2 bf16 against fp32, HSDP/DDP, NCCL) and
#                  test_fused_kernels_gpu.py (Liger and compiled blocks against the plain losses)
#   megatron_save  gpt_3d local profile on 1 GPU, bf16, local layers, 10 steps, checkpoint at 10
#   megatron_resume the same from that checkpoint (checkpoint.load_path) to step 20
#   export         `hpc_tools export` of the resumed run; hf_forward: one forward with transformers on the GPU
#   with Transformer Engine importable: megatron_gpu (tests/integration/test_megatron_gpu.py and test_gpu_tier.py)
#   and gpu_mfu (benchmarks/gpu_mfu.py --size 1.3b); without it gpu_mfu_sdpa (--layers sdpa: local layers, SDPA)
#   gpu_mfu_fsdp   benchmarks/gpu_mfu.py --backend fsdp --size 1.3b (Llama shape, SDPA, compiled blocks, bf16)
#   side_by_side   benchmarks/gpu_side_by_side.py: torchtitan 0.3.0, the Megatron and the FSDP path on Llama 3.2 1B's
#                  shape, tok/s, MFU and the ratios to torchtitan (its wheels: titan_install, from --wheels DIR/titan)
# The pytest steps run without xdist (-n 0): one GPU module at a time on the one GPU (under xdist every gpu-marked
# test is in one group too, tests/conftest.py). It writes OUT/summary.json: each step's status, exit code, seconds
# and last lines, the GPU, and the figures of gpu_mfu, gpu_mfu_fsdp and side_by_side.
# Order: the open issues' figures first (gpu_mfu or gpu_mfu_sdpa, gpu_mfu_fsdp, side_by_side), then the Megatron run
# and what reads it (save, resume, export, hf_forward, eval_bf16, serve_gpu), horovod_nccl, then the regression checks
# (moe_local, mla_local, profiling, gpu_units, deepspeed, fsdp, megatron_gpu). Time: the regression checks and the
# Megatron run took about 6 minutes on the H200 (docs/gpu-path.md); gpu_mfu_fsdp about 1.5 and side_by_side about 3.5
# more (estimates; 6 timed steps after 3 of warm-up each): about 12 minutes in all. One 10-minute device call:
#   bash benchmarks/gpu_smoke.sh --wheels .whl --budget-s 540
# gets the figures first; a step that would start after the budget is recorded "skipped" (budget), and --only reruns
# what was left.
# A failing step does not stop the others. --dry-run runs nothing on a GPU: it validates the Megatron runs' recipes
# (offline) and writes the summary with every other step "planned". Exit status: 0 when no step failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-${TMPDIR:-/tmp}/hpc_tools_gpu_smoke}"
wheels=""
dry_run=0
only=""
budget=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --only) only=",$2,"; shift 2 ;;
    --budget-s)
      [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "gpu_smoke: --budget-s ${2:-} must be a whole number of seconds" >&2; exit 2; }
      budget="$2"; shift 2 ;;
    --fetch-wheels)
      # What the lent machine lacks (it has torch and transformers): megatron-core (its own wheel, without torch),
      # deepspeed built here as a pure-Python wheel (no ops compiled; torch must be installed here) and, resolved for
      # the GPU machine's Python (PY_VERSION, default 3.12), the pure or manylinux wheels of DeepSpeed's other
      # requirements and of pydantic, submitit and hpc_tools' small requirements (EXTRA_WHEELS adds more).
      dest="$2"; mkdir -p "$dest"
      # pip matches each manylinux tag exactly: megatron-core 0.16.1 is manylinux_2_24/2_28 only
      target=(--only-binary=:all: --python-version "${PY_VERSION:-3.12}" --platform manylinux2014_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64)
      "$py" -m pip download --no-deps "${target[@]}" -d "$dest" megatron-core==0.16.1 || exit 1
      # shellcheck disable=SC2086  # EXTRA_WHEELS is a list of requirements
      "$py" -m pip download "${target[@]}" -d "$dest" pydantic==2.13.4 submitit==1.5.4 xxhash==4.1.0 Jinja2==3.1.6 \
        PyYAML==6.0.3 einops hjson msgpack ninja py-cpuinfo psutil tqdm ${EXTRA_WHEELS:-} || exit 1
      "$py" -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w "$dest" || exit 1
      # Liger Kernel (backend.*.liger): pure Python, its Triton comes with the CUDA torch
      "$py" -m pip download --no-deps "${target[@]}" -d "$dest" liger-kernel==0.8.5 || exit 1
      # torchtitan 0.3.0 for side_by_side, in titan/, installed --no-deps by titan_install: it pins datasets<4.8 (the
      # project pins 5.2) and its trainer imports datasets only for its Hugging Face loaders, which the synthetic run
      # never builds (gpu_side_by_side.py shims it where absent: no pyarrow/pandas to carry); these are what its
      # import and train path load beyond torch, numpy, requests, fsspec and safetensors (already there)
      mkdir -p "$dest/titan"
      "$py" -m pip download --no-deps "${target[@]}" -d "$dest/titan" torchtitan==0.3.0 torchdata==0.11.0 \
        torch_checkpointing==0.1.1 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
        tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 dill==0.4.0 || exit 1
      ls -l "$dest" "$dest/titan"; exit 0 ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "gpu_smoke: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out/logs"
steps="$out/steps.jsonl"
: > "$steps"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" HPC_TOOLS_RUNS_DIR="$out/runs"
cd "$repo" || exit 1

record() {  # name status rc seconds log
  "$py" - "$@" >> "$steps" <<'PY'
import json, sys
name, status, rc, seconds, log = sys.argv[1:6]
try:
    tail = open(log, errors="replace").read().splitlines()[-15:]
except OSError:
    tail = []
print(json.dumps({"step": name, "status": status, "rc": int(rc), "seconds": float(seconds), "log": log,
                  "tail": tail}))
PY
}

selected() {  # whether --only (if given) names this step
  [ -z "$only" ] || [[ "$only" == *",$1,"* ]]
}

step() {  # step NAME TIMEOUT_S COMMAND...: run it (unless --dry-run), log it, record it
  local name="$1" limit="$2"; shift 2
  local log="$out/logs/$name.log" start=$SECONDS rc
  selected "$name" || return 0
  if [ -n "$budget" ] && [ "$dry_run" = 0 ]; then  # the call's budget: skip what cannot finish, end the rest by it
    local left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then
      echo "budget: ${budget} s spent before this step" > "$log"; record "$name" skipped 0 0 "$log"
      echo "gpu_smoke: $name skipped: budget"; return 1
    fi
    [ "$left" -lt "$limit" ] && limit="$left"
  fi
  if [ "$dry_run" = 1 ]; then
    printf '%q ' "$@" > "$log"; echo >> "$log"
    record "$name" planned 0 0 "$log"; echo "gpu_smoke: $name planned"; return 0
  fi
  echo "gpu_smoke: $name ..."
  LOG="$log" timeout "$limit" "$@" > "$log" 2>&1; rc=$?
  local status=passed; [ "$rc" = 0 ] || status=failed
  record "$name" "$status" "$rc" "$((SECONDS - start))" "$log"
  echo "gpu_smoke: $name $status (exit $rc, $((SECONDS - start)) s; $log)"
  return "$rc"
}

skip() {  # skip NAME REASON
  selected "$1" || return 0
  local log="$out/logs/$1.log"; echo "$2" > "$log"; record "$1" skipped 0 0 "$log"; echo "gpu_smoke: $1 skipped: $2"
}

# gpt_3d's local profile on one GPU: bf16, local layers (no Transformer Engine needed), checkpoint at step 10.
MEGATRON=(recipes/gpt_3d.yaml --profile local --set cluster.gpu_type=H100-SXM --set cluster.gpus_per_node=1
          --set cluster.nodes=1 --set parallel.tensor_size=1 --set parallel.pipeline_size=1
          --set parallel.sequence_parallel=false --set training.precision=bf16
          --set backend.megatron.transformer_impl=local --set backend.megatron.use_flash_attention=false
          --set checkpoint.interval_iters=10)

# gpt_moe's local profile on one GPU with local layers: experts and the fp32 router without Transformer Engine.
MOE=(recipes/gpt_moe.yaml --profile local --set cluster.gpu_type=H100-SXM --set cluster.gpus_per_node=1
     --set parallel.expert_size=1 --set backend.megatron.transformer_impl=local
     --set backend.megatron.use_flash_attention=false --set training.train_iters=2 --set training.lr_warmup_iters=1
     --set checkpoint.interval_iters=2)

GPU_UNITS=(tests/unit/test_prefetch.py tests/unit/test_gpu_path.py tests/unit/test_gpu_refusals.py
           tests/unit/test_megatron_cpu_compat.py)

newest_run() { ls -td "$out/runs"/*/ 2>/dev/null | head -1; }

if [ -n "$wheels" ]; then
  step install 900 "$py" -m pip install --no-index --find-links "$wheels" "$wheels"/*.whl
  if [ -d "$wheels/titan" ]; then
    step titan_install 300 "$py" -m pip install --no-index --no-deps "$wheels"/titan/*.whl
  fi
fi
# Python, packages, CUDA, driver, NCCL, TE / apex / flash-attn, for the Megatron job below: a bare `doctor` needs
# every backend's package, Horovod's too, which no step here uses
step env 300 "$py" -m hpc_tools doctor "${MEGATRON[@]}"
# The open issues' figures first (a --budget-s call gets them before the regression checks): the Megatron path's MFU
# (with Transformer Engine, or without it the local layers on SDPA), the Hugging Face path's (compiled blocks), then the
# same Llama shape under torchtitan, Megatron and FSDP
have_te=1
if [ "$dry_run" = 0 ] && ! "$py" -c "import transformer_engine.pytorch" > "$out/logs/te_import.log" 2>&1; then
  have_te=0
  skip gpu_mfu "transformer_engine not importable here"
  step gpu_mfu_sdpa 900 "$py" benchmarks/gpu_mfu.py --size 1.3b --layers sdpa --steps 6 --warmup 3 \
    --json "$out/mfu_1.3b_sdpa.json"
else
  step gpu_mfu 1800 "$py" benchmarks/gpu_mfu.py --size 1.3b --json "$out/mfu_1.3b.json"
fi
step gpu_mfu_fsdp 900 "$py" benchmarks/gpu_mfu.py --backend fsdp --size 1.3b --steps 6 --warmup 3 \
  --json "$out/mfu_1.3b_fsdp.json"
step side_by_side 1200 "$py" benchmarks/gpu_side_by_side.py --steps 6 --warmup 3 --out "$out/side_by_side"
if [ "$dry_run" = 1 ]; then
  # what a dry run can prove of the two benchmarks: their recipes, the prediction, torchtitan's config and commands
  step_rc=0
  "$py" benchmarks/gpu_mfu.py --backend fsdp --size 1.3b --dry-run > "$out/logs/benchmark_plans.log" 2>&1 || step_rc=$?
  "$py" benchmarks/gpu_side_by_side.py --dry-run --out "$out/side_by_side" >> "$out/logs/benchmark_plans.log" 2>&1 \
    || step_rc=$?
  record benchmark_plans "$([ "$step_rc" = 0 ] && echo passed || echo failed)" "$step_rc" 0 \
    "$out/logs/benchmark_plans.log"
fi

if [ "$dry_run" = 1 ]; then
  # what a dry run can prove: the Megatron runs' recipes (gpt_3d's two, gpt_moe's) are valid as written here
  step_rc=0
  "$py" -m hpc_tools validate --offline "${MEGATRON[@]}" --set training.train_iters=10 \
    > "$out/logs/megatron_recipes.log" 2>&1 || step_rc=$?
  "$py" -m hpc_tools validate --offline "${MEGATRON[@]}" --set training.train_iters=20 \
    --set checkpoint.load_path=runs/x/checkpoints/iter_0000010 >> "$out/logs/megatron_recipes.log" 2>&1 || step_rc=$?
  "$py" -m hpc_tools validate --offline "${MOE[@]}" >> "$out/logs/megatron_recipes.log" 2>&1 || step_rc=$?
  record megatron_recipes "$([ "$step_rc" = 0 ] && echo passed || echo failed)" "$step_rc" 0 \
    "$out/logs/megatron_recipes.log"
fi
first=""
if step megatron_save 1200 "$py" -m hpc_tools submit "${MEGATRON[@]}" --executor local \
     --set training.train_iters=10; then
  first="$(newest_run)"
fi
second=""
if [ -n "$first" ] && step megatron_resume 1200 "$py" -m hpc_tools submit "${MEGATRON[@]}" --executor local \
     --set training.train_iters=20 --set "checkpoint.load_path=${first}checkpoints/iter_0000010"; then
  second="$(newest_run)"
elif [ "$dry_run" = 1 ]; then
  step megatron_resume 1200 "$py" -m hpc_tools submit "${MEGATRON[@]}" --executor local \
    --set training.train_iters=20 --set "checkpoint.load_path=RUN/checkpoints/iter_0000010"
else
  skip megatron_resume "no checkpoint from megatron_save"
fi
if [ -n "$second" ] || [ "$dry_run" = 1 ]; then
  step export 600 "$py" -m hpc_tools export "${second:-RUN}" --out "$out/hf" --overwrite
  step hf_forward 600 "$py" -c "
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained('$out/hf').cuda().eval()
tokens = torch.randint(0, model.config.vocab_size, (1, 32), device='cuda')
with torch.no_grad():
    out = model(tokens, labels=tokens)
assert torch.isfinite(out.loss), out.loss
print('forward ok:', type(model).__name__, 'loss', float(out.loss))"
else
  skip export "no resumed run"; skip hf_forward "no export"
fi

# ---- issue 46: serving, eval and Horovod on the GPU (eval_bf16, serve_gpu, horovod_nccl) ----------------------------
#   eval_bf16     `eval` of the export above (the run's bf16) with --batch-size auto on a tiny local task
#   serve_gpu     `serve --gpus 1` (Triton) of that export, nvidia-smi's memory of its process, then `cancel`; skipped
#                 without a serving environment built on a CUDA torch (environment/install-serve.sh)
#   horovod_nccl  environment/install-horovod.sh on the CUDA torch: nccl_built() true, or its one-line nvcc refusal
if [ -n "$second" ] || [ "$dry_run" = 1 ]; then
  mkdir -p "$out/eval_task"  # one multiple-choice example over a local file (the machine has no network)
  echo '{"context": "The sun is", "choices": [" hot", " cold"], "label": 0}' > "$out/eval_task/t.jsonl"
  cat > "$out/eval_task/t.yaml" <<YAML
task: smoke_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: $out/eval_task/t.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
YAML
  step eval_bf16 900 "$py" -m hpc_tools eval "${second:-$out/hf}" --tasks smoke_choice \
    --include-path "$out/eval_task" --batch-size auto --json
  if [ "$dry_run" = 1 ] || [ -x "${HPC_TOOLS_SERVE_ENV:-$repo/.venv-serve}/bin/python" ]; then
    step serve_gpu 900 bash -c 'set -e; "$0" -m hpc_tools serve "$1/hf" --executor local --gpus 1 --json \
      > "$1/serve.json"; cat "$1/serve.json"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv;
      "$0" -m hpc_tools cancel "$("$0" -c "import json,sys; print(json.load(open(sys.argv[1]))[\"run_id\"])" \
      "$1/serve.json")"' "$py" "$out"
  else
    skip serve_gpu "no serving environment (bash environment/install-serve.sh with a CUDA torch)"
  fi
else
  skip eval_bf16 "no export"; skip serve_gpu "no export"
fi
step horovod_nccl 900 bash -c 'if bash environment/install-horovod.sh; then "$0" -c "import horovod.torch as h,
  sys; print(\"nccl_built\", h.nccl_built()); sys.exit(not h.nccl_built())"; else grep -q "nvcc is not on PATH" "$LOG";
  fi' "$py"
# ---- end of issue 46's steps ----------------------------------------------------------------------------------------

# The regression checks: what earlier reviews fixed must stay fixed on a GPU
step moe_local 600 "$py" -m hpc_tools submit "${MOE[@]}" --executor local
# MLA on local layers: the refusal is the pass (exit 2 and one "error:" line); anything else fails the step
step mla_local 300 bash -c '"$0" -m hpc_tools submit "$@" --executor local; rc=$?; echo "exit $rc";
  [ "$rc" = 2 ] && [ "$(grep -c "^error:" "$LOG")" = 1 ]' "$py" "${MOE[@]}" --set model.multi_latent_attention=true
step profiling 900 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_profiling_gpu.py
# the fast tier's modules that take another branch where CUDA is there (pinned batches, the CUDA configs and refusals)
step gpu_units 600 "$py" -m pytest -q -n 0 -p no:cacheprovider "${GPU_UNITS[@]}"
step deepspeed 1800 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_deepspeed_gpu.py
step fsdp 1800 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_fsdp_gpu.py \
  tests/integration/test_fused_kernels_gpu.py
if [ "$have_te" = 0 ]; then
  skip megatron_gpu "transformer_engine not importable here (see logs/te_import.log)"
else
  step megatron_gpu 3000 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_megatron_gpu.py \
    tests/integration/test_gpu_tier.py
fi

"$py" - "$out" <<'PY'
import json, sys, time
from pathlib import Path
out = Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
figures = {"gpu_mfu": out / "mfu_1.3b.json", "gpu_mfu_sdpa": out / "mfu_1.3b_sdpa.json",
           "gpu_mfu_fsdp": out / "mfu_1.3b_fsdp.json", "side_by_side": out / "side_by_side" / "side_by_side.json"}
summary = {"written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": steps,
           "failed": [s["step"] for s in steps if s["status"] == "failed"],
           **{k: json.loads(f.read_text()) if f.is_file() else None for k, f in figures.items()}}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"gpu_smoke: {len(steps)} steps, failed: {summary['failed'] or 'none'}; {out / 'summary.json'}")
sys.exit(1 if summary["failed"] else 0)
PY
