"""What autograd saves in a real Megatron-core model vs what the planner predicts, for random configurations.

Shared by ``tests/integration/test_planner_activations.py`` and ``benchmarks/bench_planner_activations.py``.

``sample_cases(n, seed)`` draws configurations from the space the Megatron job supports (GPT and LLaMA shapes: LayerNorm
or RMSNorm, GELU or SwiGLU, learned or rotary positions, biases, grouped-query attention, hidden and attention
dropout, bf16 or fp32, no / selective / full (uniform or block) recomputation, TP 1 or 2 with and without sequence
parallelism, micro batch, sequence length, the attention path: ``sdpa`` or Megatron's ``unfused``) and a pipeline
role for the model chunk (first stage: embedding; last stage: final norm, output layer and loss; both; or a middle
chunk).

``measure_cases(cases)`` (run it inside ranks spawned by ``hpc_tools.testing.spawn``; it needs torch and megatron)
builds each chunk as the job builds it (``train/megatron/config.transformer_config`` and ``model.block_spec``,
Float16Module for 16-bit), runs one forward with labels, and sums the bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``; each storage once, so views of one tensor count once; parameters
left out; only what the graph still holds after the forward, since a graph built and dropped inside a
full-recompute checkpoint frees its tensors, whose addresses later tensors may reuse). Bytes saved while a
TransformerLayer runs belong to that layer, the rest to the chunk's edges (embedding, head, loss, full-recompute
checkpoints).

``predict_case(case, memory)`` is the planner's figure for the same chunk and microbatch; ``memory`` is the module
that holds the formulas (``hpc_tools.planner.memory`` or an older copy of it, for before/after comparisons).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BASE_RECIPE = REPO / "recipes" / "gpt_3d.yaml"
ROLES = ("both", "first", "last", "middle")


@dataclass(frozen=True)
class Case:
    """One model chunk and microbatch: the recipe overrides, the chunk's pipeline role, TP, SP."""

    overrides: tuple[str, ...]
    role: str  # both | first | last | middle
    tensor: int
    sp: bool

    def label(self) -> str:
        keep = ("family", "num_layers", "num_attention_heads", "num_query_groups", "seq_length", "micro_batch",
                "precision", "recompute", "dropout", "position", "activation", "normalization", "flash")
        short = [o.split(".", 1)[1] for o in self.overrides if any(k in o for k in keep)]
        return f"{self.role} TP{self.tensor}{' SP' if self.sp else ''} " + " ".join(short)

    def as_dict(self) -> dict:
        return asdict(self)


def sample_cases(n: int, seed: int, tensors: tuple[int, ...] = (1, 2)) -> list[Case]:
    """``n`` random configurations of the supported space (seeded)."""
    rng = random.Random(seed)
    paths = random.Random(seed + 1)  # the attention path from its own stream: the other draws stay as they were
    out = []
    for _ in range(n):
        t = rng.choice(tensors)
        family = rng.choice(("gpt", "llama"))
        heads = rng.choice([x for x in (2, 4, 8) if x % t == 0])
        groups = rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0 and g % t == 0])
        head_dim = rng.choice((8, 16))
        seq = rng.choice((8, 16, 24, 32))
        recompute = rng.choice(("none", "selective", "full"))
        layers = rng.randint(1, 3)
        ov = [f"model.family={family}", f"model.num_layers={layers}", f"model.hidden_size={heads * head_dim}",
              f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}", f"model.seq_length={seq}",
              f"model.vocab_size={rng.choice((100, 200, 300))}",
              f"model.ffn_hidden_size={rng.choice((2, 3, 4)) * heads * head_dim + 8 * t * rng.randint(0, 2)}",
              f"model.normalization={rng.choice(('LayerNorm', 'RMSNorm'))}",
              f"model.activation={rng.choice(('gelu', 'swiglu'))}",
              f"model.position_embedding={rng.choice(('learned_absolute', 'rope'))}",
              f"model.add_bias_linear={str(rng.random() < 0.5).lower()}",
              f"model.untie_embeddings={str(rng.random() < 0.5).lower()}",
              f"model.hidden_dropout={rng.choice((0.0, 0.1))}", f"model.attention_dropout={rng.choice((0.0, 0.1))}",
              f"training.micro_batch_size={rng.randint(1, 3)}", f"training.precision={rng.choice(('bf16', 'fp32'))}",
              f"training.recompute_granularity={recompute}",
              f"backend.megatron.use_flash_attention={str(paths.random() < 0.5).lower()}"]  # sdpa | unfused
        if recompute == "full":  # Megatron's uniform method needs groups that divide the chunk's layers
            method = rng.choice(("uniform", "block"))
            n = rng.choice([x for x in range(1, layers + 1) if method == "block" or layers % x == 0])
            ov += [f"training.recompute_method={method}", f"training.recompute_num_layers={n}"]
        out.append(Case(tuple(ov), rng.choice(ROLES), t, t > 1 and rng.random() < 0.6))
    return out


def load_case(case: Case):
    """The recipe of ``case`` (the local profile of gpt_3d with the case's overrides, one chunk = the model)."""
    from hpc_tools.recipe.load import load_recipe

    return load_recipe(BASE_RECIPE, [*case.overrides, f"parallel.tensor_size={case.tensor}",
                                     "parallel.pipeline_size=1", "parallel.virtual_pipeline_size=null",
                                     f"parallel.sequence_parallel={str(case.sp).lower()}", "parallel.data_size=-1",
                                     "cluster.nodes=1", f"cluster.gpus_per_node={case.tensor}",
                                     "training.global_batch_size=null"],
                       profile="local", check=False)


# --- the planner's side ---------------------------------------------------------------------------------------------

def predict_case(case: Case, memory: ModuleType) -> dict[str, Any]:
    """The planner's bytes for one microbatch of this chunk: per layer, edges, total. ``memory`` is the module with
    the formulas; only ``stage_activation_bytes`` and ``edge_activation_bytes`` are used, so that an older copy of
    ``hpc_tools.planner.memory`` predicts the same chunk. The chunk is posed as one stage of a pipeline with one
    microbatch (one chunk in flight): the first of two stages, the last of two, the middle of three, or p = 1."""
    from dataclasses import replace

    from hpc_tools.planner.arch import arch_for
    from hpc_tools.planner.knobs import Knobs

    recipe = load_case(case)
    arch, k = arch_for(recipe), Knobs.from_recipe(recipe)
    p, stage = {"both": (1, 0), "first": (2, 0), "last": (2, 1), "middle": (3, 1)}[case.role]
    layers = arch.layers
    arch = replace(arch, layers=layers * p)
    k = replace(k, layout=replace(k.layout, pipeline_size=p, virtual_pipeline_size=None, data_size=1,
                                  global_batch_size=k.layout.micro_batch_size, ranks_per_node=case.tensor * p))
    acts, _ = memory.stage_activation_bytes(arch, k, stage)
    edge = memory.edge_activation_bytes(arch, k, stage)
    return {"layer": acts / layers if k.recompute != "full" else None, "edge": edge, "total": acts + edge}


def compare(case: Case, measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """One row of the comparison: measured and predicted bytes and the relative errors (predicted / measured - 1)."""
    layers = measured["layers"]
    layer = layers[0] if layers and case_recompute(case) != "full" else None
    row = {"case": case.label(), "measured_total": measured["total"], "predicted_total": predicted["total"],
           "total_error": predicted["total"] / measured["total"] - 1,
           "measured_layer": layer, "predicted_layer": predicted["layer"], "measured_edge": measured["edge"],
           "predicted_edge": predicted["edge"]}
    row["layer_error"] = (predicted["layer"] / layer - 1) if layer else None
    return row


def case_recompute(case: Case) -> str:
    return next((o.split("=", 1)[1] for o in case.overrides if o.startswith("training.recompute_granularity=")),
                "none")


# --- the measured side (inside a rank with torch.distributed up) ----------------------------------------------------

def _build(recipe, case: Case):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.config import transformer_config
    from hpc_tools.train.megatron.model import block_spec

    layout = ParallelLayout.from_recipe(recipe)
    cfg = transformer_config(recipe, layout, "cpu")
    m = recipe.model
    model = GPTModel(config=cfg, transformer_layer_spec=block_spec(recipe, cfg, "cpu", None),
                     vocab_size=m.padded_vocab_size(case.tensor), max_sequence_length=m.seq_length,
                     pre_process=case.role in ("both", "first"), post_process=case.role in ("both", "last"),
                     share_embeddings_and_output_weights=not m.untie_embeddings, parallel_output=True,
                     position_embedding_type=m.position_embedding, rotary_base=m.rotary_base)
    wrapped = Float16Module(cfg, model) if (cfg.bf16 or cfg.fp16) else model
    return wrapped, model, cfg


def _inputs(recipe, case: Case, model, cfg) -> tuple[Any, Any, Any]:
    """One micro-batch: its tokens, their positions (as the engine builds them) and, on a chunk that computes the
    loss, its labels (else None); a chunk after the first gets its hidden input from the previous stage's shape."""
    import torch

    m, b, t = recipe.model, recipe.training.micro_batch_size, case.tensor
    s = m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    positions = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(tokens)  # as the engine builds them
    if case.role in ("middle", "last"):
        tokens_here = s // t if case.sp else s
        hidden = torch.randn(tokens_here, b, m.hidden_size, dtype=cfg.params_dtype, requires_grad=True)
        model.set_input_tensor(hidden)
    return tokens, positions, tokens if case.role in ("both", "last") else None


def measure_case(case: Case) -> dict[str, Any]:
    """Bytes autograd saves in one forward of this chunk (per layer, edges, total)."""
    import gc
    import os
    import weakref

    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    recipe = load_case(case)
    torch.manual_seed(0)
    wrapped, model, cfg = _build(recipe, case)
    wrapped.train()
    tokens, positions, labels = _inputs(recipe, case, model, cfg)
    skip = {p.untyped_storage().data_ptr() for p in wrapped.parameters()}
    owner = ["edge"]
    packed: list[tuple[int, int, str, weakref.ref]] = []  # (storage address, bytes, owner, holder)

    class Held:  # what the graph keeps instead of the tensor: a graph dropped inside the forward drops it too
        __slots__ = ("x", "__weakref__")

        def __init__(self, x):
            self.x = x

    def pack(x):
        storage = x.untyped_storage()
        held = Held(x)
        if storage.data_ptr() not in skip:
            packed.append((storage.data_ptr(), storage.nbytes(), owner[0], weakref.ref(held)))
        return held

    layers = [mod for mod in model.modules() if isinstance(mod, TransformerLayer)]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: owner.__setitem__(0, f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda *_: owner.__setitem__(0, "edge")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.x):
        out = wrapped(tokens, positions, None, labels=labels)
        if labels is not None:
            out = out.float().mean()  # the engine's loss_func
    for h in hooks:
        h.remove()
    gc.collect()
    # kept = saved into the graph that reaches the output (Megatron's bias-dropout-add runs under enable_grad even
    # inside a full-recompute checkpoint; that inner graph dies with the checkpoint's forward)
    # Only live holders count: an address freed by a dropped graph may be reused by a later tensor.
    saved: dict[int, tuple[int, str]] = {}
    for ptr, nbytes, who, ref in packed:
        if ref() is not None:
            saved.setdefault(ptr, (nbytes, who))
    del out
    if os.environ.get("HPC_TOOLS_ACTIVATIONS_DEBUG"):
        print(case.label(), sorted(saved.values(), key=lambda v: v[1]), flush=True)
    per_layer = [sum(n for n, o in saved.values() if o == f"layer{i}") for i in range(len(layers))]
    edge = sum(n for n, o in saved.values() if o == "edge")
    return {"layers": per_layer, "edge": edge, "total": sum(n for n, _ in saved.values())}


def measure_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Measure every case under the tensor-parallel size it asks for, shared out between the data-parallel
    replicas; every rank gets every result (None for a TP size that does not divide the world)."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    gc.freeze()  # the collections after each forward then walk only the objects made since (10x faster)
    out: list[Any] = [None] * len(cases)
    for t in sorted({c.tensor for c in cases if world % c.tensor == 0}):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        replicas = world // t  # data-parallel replicas share the cases of this TP size out between them
        mine = [i for i, c in enumerate(cases) if c.tensor == t]
        for j, i in enumerate(mine):
            if j % replicas == ps.get_data_parallel_rank():
                out[i] = measure_case(cases[i])
    ps.destroy_model_parallel()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    return [next((g[i] for g in gathered if g[i] is not None), None) for i in range(len(cases))]


def rank_main() -> None:
    """Rank entry: ``python -m hpc_tools.testing.activations CASES.json OUT_PREFIX``; the ranks measure the cases
    together (``measure_cases``) and rank 0 writes ``OUT_PREFIX.json``."""
    import os

    import torch.distributed as dist

    from hpc_tools.train.megatron import cpu_compat

    cpu_compat.install()
    cases = [Case(tuple(c["overrides"]), c["role"], c["tensor"], c["sp"])
             for c in json.loads(Path(sys.argv[1]).read_text())]
    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    results = measure_cases(cases)
    if dist.get_rank() == 0:
        Path(sys.argv[2] + ".json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    rank_main()
