"""The Hugging Face backends' fused-kernel switches on CPU: ``backend.fsdp.compile`` trains the same losses as the
plain blocks; ``backend.<kind>.liger`` is refused for GPT-2 models, is one note on CPU ranks (plain layers kept, the
same losses), and where liger-kernel imports it patches a Llama model's norms, MLPs and forward. The losses of Liger's
Triton kernels against the plain path are tests/integration/test_fused_kernels_gpu.py's (CUDA only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpc_tools.recipe.load import resolve  # noqa: E402

LLAMA = {"family": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": 512}


def recipe(kind: str = "fsdp", family: str = "llama", gpu: bool = False, check: bool = True, **options):
    model = dict(LLAMA, family=family)
    if family == "gpt":
        model.pop("num_query_groups")
    return resolve({"name": "k", "model": model, "backend": {"kind": kind, kind: options},
                    "training": {"micro_batch_size": 2, "global_batch_size": 2, "train_iters": 3},
                    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "H100-SXM" if gpu else "cpu"}},
                   check=check)


@pytest.fixture
def gloo():
    """A one-rank gloo group for FSDP2's device mesh (left as found)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


def losses(r, steps: int = 3) -> list[float]:
    """``steps`` SGD steps of the FSDP backend's model (one rank, full_shard) on fixed batches: each step's loss."""
    from hpc_tools.train.fsdp.parallel import parallelize
    from hpc_tools.train.hf_causal_lm import apply_liger, forward_loss
    from hpc_tools.train.hf_causal_lm.model import build_empty
    from hpc_tools.train.hf_causal_lm.values import full_values

    notes: list[str] = []
    model = build_empty(r)
    fused = apply_liger(model, r, torch.device("cpu"), lambda fmt, *a: notes.append(fmt % a))
    model = parallelize(model, r, torch.device("cpu"), 1, fill=full_values(r, model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (2, 16), generator=gen)
        loss = forward_loss(model, tokens, torch.roll(tokens, -1, 1), fused)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    losses.notes = notes
    return out


@pytest.mark.slow  # inductor compiles two blocks' forward and backward on CPU: about a minute on 2 cores
def test_compiled_blocks_train_the_plain_losses(gloo):
    plain = losses(recipe())
    compiled = losses(recipe(compile=True))
    assert compiled[0] == pytest.approx(plain[0], rel=2e-5)  # the same forward, fp32 reductions fused otherwise
    assert compiled == pytest.approx(plain, rel=1e-4)  # then fp32 sums reassociated by inductor, amplified by SGD
    assert plain[-1] < plain[0]  # it trained: a wiring that froze the model would pass the equality


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed", "horovod"])
def test_liger_on_cpu_is_one_note_and_the_plain_losses(kind, gloo):
    from hpc_tools.recipe.rules import recipe_notes

    r = recipe(kind, liger=True)
    notes = [n for n in recipe_notes(r) if "liger" in n]
    assert notes == [f"note: backend.{kind}.liger=true does not apply on CPU ranks (Triton kernels need CUDA): this "
                     "run trains the plain PyTorch layers and loss (fine for a CPU rehearsal)"]
    if kind != "fsdp":
        return  # the rank-side note is the same function for every backend (apply_liger)
    assert losses(r) == losses(recipe())
    assert losses.notes == [] and len(notes) == 1
    losses(r)
    assert losses.notes == ["backend.fsdp.liger=true: Liger Kernel's Triton kernels run on CUDA only; this cpu run "
                            "keeps the plain PyTorch layers and loss"]


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed", "horovod"])
def test_liger_with_a_gpt_model_is_refused_in_one_line(kind):
    from hpc_tools.recipe.rules import check_recipe

    violations = check_recipe(recipe(kind, family="gpt", gpu=True, check=False, liger=True))
    lines = [str(v) for v in violations if "liger" in str(v)]
    assert lines == [f"backend.{kind}.liger=true patches Llama models only, not model.family=gpt (use family: llama, "
                     f"or backend.{kind}.liger=false)"]


def test_liger_off_is_silent_and_unfused():
    from hpc_tools.train.hf_causal_lm import apply_liger

    said = []
    assert apply_liger(object(), recipe(), torch.device("cuda"), lambda *a: said.append(a)) is False and said == []


def test_liger_patches_the_llama_model_where_it_imports():
    """On a CUDA device (named only: nothing runs) the model's norms, MLPs and forward are Liger's."""
    pytest.importorskip("liger_kernel")
    from hpc_tools.train.hf_causal_lm import apply_liger
    from hpc_tools.train.hf_causal_lm.model import build_empty

    model = build_empty(recipe(liger=True))
    said = []
    assert apply_liger(model, recipe(liger=True), torch.device("cuda"), lambda f, *a: said.append(f % a)) is True
    layer = model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP"
    assert "Liger" in type(layer.input_layernorm).forward.__qualname__ or \
        "Liger" in layer.input_layernorm.forward.__qualname__
    assert model.forward.__func__.__module__.startswith("liger_kernel")
    assert said == ["backend.fsdp.liger: Liger Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross entropy applied"]
