"""The FSDP backend builds its model without memory (parameters on the meta device, filled after sharding): filled on
one process it is the model a plain build gives, weight for weight, tied embeddings still tied."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpc_tools.recipe.load import resolve  # noqa: E402

MODELS = {"llama": {"family": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                    "num_query_groups": 2, "ffn_hidden_size": 64, "seq_length": 32, "vocab_size": 512},
          "gpt": {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
                  "vocab_size": 512}}


def recipe(family: str, **checkpoint):
    return resolve({"name": "m", "model": MODELS[family], "backend": {"kind": "fsdp"}, "checkpoint": checkpoint,
                    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu"}})


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_empty_build_filled_is_the_plain_build(family):
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import ATTENTION, hf_config
    from hpc_tools.train.deepspeed.model import initialize_weights
    from hpc_tools.train.hf_causal_lm.model import build_empty
    from hpc_tools.train.hf_causal_lm.values import full_values, materialize

    r = recipe(family)
    model = build_empty(r)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"), full_values(r, model))
    plain = AutoModelForCausalLM.from_config(hf_config(r), attn_implementation=ATTENTION, dtype=torch.float32)
    initialize_weights(plain, r)
    mine, theirs = model.state_dict(), plain.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == (family == "gpt")
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.equal(model(input_ids=tokens).logits, plain(input_ids=tokens).logits)  # RoPE buffers kept too


def test_init_from_hf_of_another_shape_is_refused_naming_the_field(tmp_path):
    """(Filling from the folder's weights is checked by tests/integration/test_fsdp_train.py, whose FSDP, DDP and
    Megatron runs start from one folder.)"""
    from hpc_tools.errors import UserError
    from hpc_tools.hf.config import hf_config
    from hpc_tools.train.hf_causal_lm.model import build_empty

    hf_config(recipe("llama")).save_pretrained(tmp_path / "hf")  # config.json is what the check reads
    r = recipe("llama", init_from_hf=str(tmp_path / "hf"))
    wider = r.model_copy(update={"model": r.model.model_copy(update={"ffn_hidden_size": 96})})
    with pytest.raises(UserError, match=r"checkpoint.init_from_hf=.* has intermediate_size=64, the recipe's model "
                                        r"section gives 96"):
        build_empty(wider)
    assert all(p.is_meta for p in build_empty(r).parameters())
