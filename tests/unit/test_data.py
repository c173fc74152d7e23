"""The shared data pipeline: determinism, data-parallel shards, epochs, local files, tokenizers, no network."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from hpc_tools.data.tokenizer import BYTE_EOS_ID, ByteTokenizer, load_tokenizer
from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve
from hpc_tools.train.data import (
    SYNTHETIC_NOISE,
    build_samples,
    global_batch_indices,
    microbatches_for_step,
    rank_batch_indices,
    synthetic_samples,
    windows,
)


def make_recipe(*, data=None, seed=1234, seq=16, vocab=512, micro=2, global_batch=8, ranks=2, pipeline=1):
    raw = {"name": "t", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": seq,
                                  "vocab_size": vocab},
           "parallel": {"pipeline_size": pipeline},
           "training": {"micro_batch_size": micro, "global_batch_size": global_batch, "seed": seed},
           "cluster": {"gpus_per_node": ranks, "gpu_type": "cpu"}, "data": data or {}}
    return resolve(raw)


def test_synthetic_is_deterministic_per_seed():
    a, b = build_samples(make_recipe()), build_samples(make_recipe())
    other = build_samples(make_recipe(seed=99))
    assert len(a) == len(b) > 0
    for i in (0, 7, len(a) - 1):
        assert a[i].dtype == np.int64 and a[i].shape == (17,)
        assert np.array_equal(a[i], b[i])
    assert not np.array_equal(a[0], other[0])
    assert not np.array_equal(a[0], a[1])


def test_synthetic_tokens_follow_a_learnable_pattern():
    """Most transitions come from a small successor table, so a model can beat the uniform loss."""
    s = synthetic_samples(seq_length=256, vocab_size=512, seed=3)
    seen: dict[int, set[int]] = {}
    for i in range(40):
        row = s[i]
        assert row.min() >= 0 and row.max() < 256
        for x, y in zip(row[:-1], row[1:]):
            seen.setdefault(int(x), set()).add(int(y))
    # 4 successors per token plus 5 % noise: far fewer distinct successors than the 256 a uniform stream would show
    mean_successors = np.mean([len(v) for v in seen.values()])
    assert mean_successors < 4 + SYNTHETIC_NOISE * 256, mean_successors


def test_microbatch_shapes_and_shift():
    r = make_recipe(micro=2, global_batch=8, ranks=2)
    lay = ParallelLayout.from_recipe(r)
    s = build_samples(r)
    mbs = microbatches_for_step(s, 3, 1, lay)
    assert len(mbs) == lay.num_microbatches == 2
    idx = rank_batch_indices(s, 3, 1, lay)
    for k, mb in enumerate(mbs):
        assert tuple(mb["tokens"].shape) == (2, 16) and str(mb["tokens"].dtype) == "torch.int64"
        assert (mb["tokens"][:, 1:] == mb["labels"][:, :-1]).all()
        for row in range(2):
            full = s[int(idx[k * 2 + row])]
            assert np.array_equal(mb["tokens"][row].numpy(), full[:-1])
            assert np.array_equal(mb["labels"][row].numpy(), full[1:])


@pytest.mark.parametrize("ranks,pipeline,micro,global_batch", [(2, 1, 2, 8), (4, 1, 1, 8), (4, 2, 2, 8), (1, 1, 4, 8)])
def test_dp_shards_are_disjoint_and_cover_the_global_batch(ranks, pipeline, micro, global_batch):
    r = make_recipe(micro=micro, global_batch=global_batch, ranks=ranks, pipeline=pipeline)
    lay = ParallelLayout.from_recipe(r)
    s = build_samples(r)
    for step in (1, 2, 50):
        shards = [rank_batch_indices(s, step, d, lay) for d in range(lay.data_size)]
        assert all(len(x) == global_batch // lay.data_size for x in shards)
        joined = np.concatenate(shards)
        assert np.array_equal(joined, global_batch_indices(s, step, global_batch))
        assert len(set(joined.tolist())) == global_batch  # disjoint


def test_global_batch_is_layout_independent():
    """DP2 and DP4 (and PP2xDP2) see the same samples in a step: only the split differs."""
    layouts = [make_recipe(ranks=2), make_recipe(ranks=4, micro=1), make_recipe(ranks=4, pipeline=2)]
    s = build_samples(layouts[0])
    for step in (1, 9):
        rows = []
        for r in layouts:
            lay = ParallelLayout.from_recipe(r)
            rows.append(np.concatenate([mb["tokens"].numpy() for d in range(lay.data_size)
                                        for mb in microbatches_for_step(s, step, d, lay)]))
        assert all(np.array_equal(rows[0], x) for x in rows[1:])


def test_epochs_wrap_and_reshuffle():
    s = windows(np.arange(101), seq_length=10, seed=5)  # 10 windows
    assert len(s) == 10
    first = np.concatenate([global_batch_indices(s, step, 5) for step in (1, 2)])
    second = np.concatenate([global_batch_indices(s, step, 5) for step in (3, 4)])
    assert sorted(first.tolist()) == list(range(10)) == sorted(second.tolist())
    assert not np.array_equal(first, second)
    # a global batch that straddles an epoch boundary
    straddle = global_batch_indices(s, 2, 6)  # slots 6..11
    assert np.array_equal(straddle[:4], s.epoch_order(0)[6:10])
    assert np.array_equal(straddle[4:], s.epoch_order(1)[:2])
    # consecutive windows share one boundary token
    assert np.array_equal(s[0], np.arange(11)) and s[1][0] == 10


def test_steps_are_one_based():
    with pytest.raises(ValueError, match="1-based"):
        global_batch_indices(windows(np.arange(50), 10, 1), 0, 2)


# --- tokenizers ---------------------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Hello, ZeRO — 3D parallel: é ü 漢字 🚀\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(ids + [BYTE_EOS_ID]) == text
    assert tok.vocab_size == 257 and load_tokenizer("byte").eos_id == 256


def _save_hf_tokenizer(folder):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)


def test_local_hf_tokenizer_round_trip(tmp_path):
    _save_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    text = "the lazy fox jumps"
    ids = tok.encode(text)
    assert len(ids) < len(text)  # merges learned: fewer tokens than bytes
    assert tok.decode(ids) == text
    assert tok.eos_id not in ids and tok.vocab_size <= 300 + 1


def test_tokenizer_errors_name_the_field(tmp_path):
    with pytest.raises(UserError, match=r"data.tokenizer=.*nope"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="data.tokenizer="):
        load_tokenizer(str(tmp_path / "empty"))


# --- local files --------------------------------------------------------------------------------------------------

DOCS = ["First document about pipelines.", "Second one: ZeRO stage 3 shards parameters.", "Third, ünïcode ok."]


def _write(tmp_path, fmt):
    if fmt == "text":
        paths = []
        for i, doc in enumerate(DOCS):
            p = tmp_path / f"doc{i}.txt"
            p.write_text(doc)
            paths.append(p)
        return [str(tmp_path)]  # a folder: every .txt in it, sorted
    if fmt == "jsonl":
        p = tmp_path / "docs.jsonl"
        p.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
        return [str(p)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": DOCS, "id": list(range(3))}), p)
    return [str(p)]


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_local_files_tokenize_concatenate_and_chunk(tmp_path, fmt, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the data pipeline tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    paths = _write(tmp_path, fmt)
    field = "text" if fmt == "text" else "body"
    r = make_recipe(data={"source": "files", "paths": paths, "text_field": field}, seq=8)
    s = build_samples(r)
    tok = ByteTokenizer()
    stream = [t for d in DOCS for t in tok.encode(d) + [BYTE_EOS_ID]]
    assert len(s) == (len(stream) - 1) // 8
    rebuilt = np.concatenate([s[0]] + [s[i][1:] for i in range(1, len(s))])
    assert np.array_equal(rebuilt, np.asarray(stream[: len(rebuilt)]))
    assert tok.decode(rebuilt).startswith(DOCS[0] + DOCS[1][:5])


def test_explicit_format_overrides_extension(tmp_path):
    p = tmp_path / "corpus.data"
    p.write_text("x" * 40)
    with pytest.raises(UserError, match=r"data.format"):
        build_samples(make_recipe(data={"source": "files", "paths": [str(p)]}, seq=8))
    s = build_samples(make_recipe(data={"source": "files", "paths": [str(p)], "format": "text"}, seq=8))
    assert len(s) == 5 and s[0][0] == ord("x")


def test_file_errors_name_the_field(tmp_path):
    with pytest.raises(UserError, match=r"data.paths\[0\]=.*does not exist"):
        build_samples(make_recipe(data={"source": "files", "paths": [str(tmp_path / "missing.txt")]}))
    jsonl = _write(tmp_path, "jsonl")
    with pytest.raises(UserError, match=r"data.text_field=text is not a column .*body"):
        build_samples(make_recipe(data={"source": "files", "paths": jsonl}))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(UserError, match=r"fewer than one sample of model.seq_length\+1=17"):
        build_samples(make_recipe(data={"source": "files", "paths": [str(tiny)]}))


def test_tokenizer_larger_than_vocab_is_refused(tmp_path):
    _save_hf_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("the quick brown fox " * 20)
    data = {"source": "files", "paths": [str(tmp_path / "a.txt")], "tokenizer": str(tmp_path / "tok")}
    vocab = load_tokenizer(str(tmp_path / "tok")).vocab_size
    with pytest.raises(UserError, match=rf"model.vocab_size=100 is smaller than the tokenizer's {vocab} tokens"):
        build_samples(make_recipe(data=data, vocab=100))
    s = build_samples(make_recipe(data=data, vocab=512, seq=8))
    assert len(s) > 0 and max(int(s[i].max()) for i in range(len(s))) < vocab
