"""Every measured figure stated in words, once: ``DEFINITIONS`` (``profiling.figures`` computes them, and names
each rule here; the report prints this text as its method section, ``definitions_text``). Words only: no import
beyond the standard library, so the report and the docs read them without numpy."""

from __future__ import annotations

DEFINITIONS: dict[str, str] = {
    "warm-up": "The first N steps of every start of the job (its first start and each requeue or `resume`, i.e. "
               "records with the same `restart`) are warm-up, N = profiling.warmup_steps (analyze --warmup overrides "
               "it). Warm-up steps count in no time, throughput or share figure; the steps after them are the measured "
               "steps. A requeued or resumed job re-runs the steps after its checkpoint: on each rank the last record "
               "of a step (the newest start's) wins.",
    "step_time_median_s, _p10_s, _p90_s, _mean_s": "A step's time is its slowest rank's step_time_s (a synchronous "
               "step ends when the last rank does). Median, 10th and 90th percentile (linear interpolation) and mean "
               "over the measured steps. Per rank: the same over that rank's own measured steps.",
    "tokens_per_s, tokens_per_s_per_gpu": "Tokens per step (global batch x sequence length, the records' `tokens`) / "
               "median step time; per GPU: divided by the world size.",
    "tflops_per_gpu": "Model FLOPs per step (the records' model_flops, under profiling.flops_convention) / median step "
               "time / world size / 1e12. Empty when the records carry no FLOPs (comm_check).",
    "mfu, hfu": "TFLOP/s per GPU / the per-GPU peak the job measured against (peak_tflops_per_gpu, implied by the "
               "records' tflops_per_gpu / mfu: the device the job ran on). HFU uses hardware_flops, which count "
               "recomputation. Empty when the peak was unknown (CPU ranks, an unknown GPU): never a guessed peak.",
    "data_share, comm_share": "Per rank: sum(data_time_s or comm_time_s) / sum(step_time_s) over the measured steps "
               "on which the part was recorded (collectives are timed on sampled steps only); then the mean over "
               "ranks.",
    "bubble_share": "Per rank: sum(pp_wait_s) / sum(step_time_s) over the measured steps; per pipeline stage the mean "
               "over its ranks (bubble_share_per_stage); the job's figure is the least-waiting stage's. In 1F1B every "
               "stage ideally waits (p-1)(t_f+t_b) per step; a stage that waits more is waiting on a slower stage, so "
               "the least-waiting stage shows the schedule's own bubble.",
    "bubble_share_theory": "The schedule's bubble as a share of the step, b / (1 + b), with b = (p-1)/(v m) the bubble "
               "over ideal compute time (Narayanan et al. 2021); empty without pipeline parallelism.",
    "mem_*_peak_bytes, peak_mem_gb": "Peaks over every recorded step, warm-up included (a job needs its peak whenever "
               "it occurs), and over ranks: torch.cuda max allocated and max reserved, host RSS. peak_mem_gb (1e9 "
               "bytes) is the allocated peak on GPUs, else the RSS peak; peak_mem_kind says which.",
    "rank_skew, slowdown_vs_median": "rank_skew = (slowest - fastest rank median step time) / median of the rank "
               "medians; slowdown_vs_median = a rank's median step time / the median of rank medians - 1. Neither "
               "finds the slow rank of a synchronous job: every rank waits for it, so step times come out equal.",
    "stragglers, straggler_verdict": "On the measured steps whose collectives were timed, a rank's busy time is "
               "step_time_s - comm_time_s (every collective and pipeline p2p it waited in) and splits into data "
               "(data_time_s) and compute (the rest). A rank is compared per step with the median of its peers (the "
               "other ranks of its pipeline stage); it is a straggler when its median excess busy time exceeds 5 % "
               "of the median step time and it is busier than its peers on enough steps for a one-sided sign test "
               "to give p <= 0.01 (7+ steps). Cause: data or compute, whichever excess is larger; communication "
               "when, with no late peer, its own waiting exceeds its peers' by the same rule. Host stalled: over every "
               "measured step (CPU ranks), a rank's lateness is its time in the step outside collectives "
               "(step_time_s - collective_wait_s) minus its peers' mean: how much longer they waited for it at the "
               "step's collectives; less its extra cpu_time_s and data time it is unexplained (off its CPU outside "
               "collectives). A rank is host stalled when its mean lateness and its mean unexplained lateness exceed "
               "5 % of the stage's mean step time (the latter also half its lateness), a one-sided test of its "
               "per-step lateness against mean 0 gives p <= 0.01 and it was the latest by over 5 % of the median "
               "step on 2+ steps, or when it was kept from running (host_stall_s: stopped or descheduled, its own "
               "evidence, which a stall inside a collective does not hide) by more than 5 % of the mean step over its "
               "peers' mean, with p <= 0.01 by the same test; either overrides its busy-time verdict, unless its "
               "extra cpu_time_s exceeds 5 % of the step. Of stalled-looking ranks of several pipeline "
               "stages, those late by their extra pipeline wait are the stalled one's victims. The verdict names "
               "rank, node (its records' `node`), cause, excess, steps and "
               "p (profiling.stragglers).",
    "last_loss": "The mean over the ranks that report a loss at the last step that has one.",
    "goodput": "Per life of the run (each start of its ranks): allocation = its start (rank process start or the "
               "launcher's event) to its end; start-up = to the first step's start, less the checkpoint load; "
               "checkpoint save/load = the loop's timings (slowest rank per save); productive = step time of the "
               "steps no later life recorded again; lost work = step time of the steps a later life recomputed; "
               "evaluation = 0; other = the rest. Requeue wait = end of a life to the next start, outside the "
               "allocation. goodput = productive / allocation; hours = seconds x world size / 3600 "
               "(profiling.goodput).",
    "post_save": "Post-save step inflation, from the lowest rank: steady = the median step time of the measured "
               "steps that are not among the first 3 after a save; per save of step s, the steps s+1, s+2, ... "
               "(the same start, up to the next save, at most 20) counted while each is longer than 1.25 x steady; "
               "their count, their time beyond steady (extra), the largest step / steady (profiling.post_save).",
    "moe_load_imbalance_median, _max, moe_aux_loss": "Mixture of experts: a step's load imbalance is the max over "
               "the MoE layers of the busiest expert's tokens / the mean tokens per expert, counted over every rank "
               "(1 = even; num_experts / top-k = every token to the same experts); median and max over the measured "
               "steps. moe_aux_loss: the router's load-balancing loss without its coefficient (mean over MoE layers "
               "and microbatches, as Megatron-LM logs it), mean over the measured steps. Empty without experts.",
    "all_to_all_share": "Mixture of experts: time in all-to-all collectives (the token dispatcher's) per sampled "
               "rank-step / the median step time (collectives are timed on sampled steps only).",
    "comm (per kind)": "Calls, bytes and time of the sampled collectives on measured steps, summed over steps and "
               "ranks per (kind, group size); algbw = bytes / span, busbw = algbw x the nccl-tests factor of the "
               "kind (profiling.comm.busbw_factor).",
}


def definitions_text(width: int = 110) -> str:
    """``DEFINITIONS`` as plain text, one wrapped paragraph per figure (the report's method section)."""
    import textwrap

    return "\n".join(textwrap.fill(f"- {name}: {text}", width, subsequent_indent="  ")
                     for name, text in DEFINITIONS.items())
