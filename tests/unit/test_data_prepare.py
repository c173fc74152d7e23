"""`data prepare` -> Megatron indexed datasets, read back by megatron itself; bad inputs; the indexed source's checks
and Samples; the vectorised synthetic chain against a token-by-token reference. Everything is built locally."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hpc_tools.data.prepare import plan_outputs, prepare, read_meta
from hpc_tools.data.tokenizer import BYTE_EOS_ID, load_tokenizer
from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.load import resolve
from hpc_tools.train.data import (
    SYNTHETIC_BRANCHES,
    build_samples,
    global_batch_indices,
    synthetic_samples,
    validation_samples,
)

WORDS = "the quick brown fox jumps over a lazy dog while pipelines shard tensors across many ranks".split()


def make_docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + (" ünï" if i % 7 == 0 else "")
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two jsonl inputs, a parquet and a text file, and a BPE tokenizer trained on them here."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("corpus")
    docs = {"web": make_docs(700, 1), "books": make_docs(400, 2)}
    for name, items in docs.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"body": d, "n": i}) + "\n"
                                                   for i, d in enumerate(items)))
    pq.write_table(pa.table({"body": docs["books"][:50]}), root / "shelf.parquet")
    (root / "note.txt").write_text("a single text document\n")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs["web"], vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    return root, docs


def read_back(prefix: str) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, multimodal=False)
    return [np.array(ds[i], dtype=np.int64) for i in range(len(ds))]  # copies: the memory map closes with ds


def test_prepare_with_two_workers_writes_what_megatron_reads(corpus, tmp_path):
    root, docs = corpus
    out = tmp_path / "prepared"
    done = prepare([str(root / "web.jsonl"), str(root / "books.jsonl")], str(out), tokenizer=str(root / "tok"),
                   text_field="body", workers=2, batch_docs=64)
    tok = load_tokenizer(str(root / "tok"))
    assert [d.documents for d in done] == [700, 400]
    for d, name in zip(done, ("web", "books")):
        got = read_back(d.prefix)
        want = [tok.encode(doc) + [tok.eos_id] for doc in docs[name]]
        assert len(got) == len(want) and all(g.tolist() == w for g, w in zip(got, want))
        assert d.tokens == sum(map(len, want))
        meta = read_meta(d.prefix)
        assert (meta["vocab_size"], meta["eos_id"], meta["documents"]) == (tok.vocab_size, tok.eos_id, d.documents)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}{s}" for n in ("web", "books")
                                                        for s in (".bin", ".idx", ".meta.json"))


def test_byte_tokenizer_parquet_and_text(corpus, tmp_path):
    root, docs = corpus
    done = prepare([str(root / "shelf.parquet"), str(root / "note.txt")], str(tmp_path), text_field="body")
    shelf, note = (read_back(d.prefix) for d in done)
    assert [g.tolist() for g in shelf] == [list(d.encode()) + [BYTE_EOS_ID] for d in docs["books"][:50]]
    assert [g.tolist() for g in note] == [list(b"a single text document\n") + [BYTE_EOS_ID]]


def test_cli_prepares_and_reports(corpus, tmp_path, capsys):
    from hpc_tools.cli import main

    root, _ = corpus
    rc = main(["data", "prepare", str(root / "note.txt"), "--out", str(tmp_path / "o"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["documents"] == 1 and report["tokens"] == 24 and report["tokens_per_s"] > 0


def test_a_worker_that_dies_mid_prepare_is_one_line_exit_1_and_nothing_written(corpus, tmp_path, capsys,
                                                                                 monkeypatch):
    """A worker killed under the prepare (the OOM killer, a crash in the tokenizer's native code): the command ends
    at once with one line naming the worker's end, not a hang or a traceback, and leaves nothing behind."""
    import hpc_tools.data.prepare as prep
    from hpc_tools.cli import main

    root, _ = corpus
    real = prep.encode_batch

    def dies_on_a_late_batch(texts):
        if texts.first > 300:  # a jsonl batch reaches a worker as raw lines from line `first` on
            os._exit(9)
        return real(texts)

    monkeypatch.setattr(prep, "encode_batch", dies_on_a_late_batch)
    out = tmp_path / "o"
    rc = main(["data", "prepare", str(root / "web.jsonl"), "--text-field", "body", "--out", str(out),
               "--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("error: worker process ") and err[0].endswith("exited with code 9"), err
    assert not out.exists(), _snapshot(out)


def _snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


def test_bad_inputs_are_one_line_and_write_nothing(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "o"
    cases = [
        ([str(root / "missing.jsonl")], {}, r"input .*missing.jsonl does not exist"),
        ([str(root / "web.jsonl")], {"text_field": "text"}, r"--text-field=text is not a field of .*web.jsonl.*body"),
        ([str(root / "shelf.parquet")], {"text_field": "nope"}, r"--text-field=nope is not a field"),
        ([str(root / "web.jsonl")], {"text_field": "body", "tokenizer": str(root / "tok"), "max_vocab": 300},
         r"model.vocab_size=300 is smaller than the tokenizer's \d+ tokens"),
        ([str(root / "web.jsonl"), str(root / "web.jsonl")], {"text_field": "body"}, r"would both be written"),
        ([str(root)], {}, r"is a folder but not a saved Hugging Face dataset"),
    ]
    for inputs, kwargs, message in cases:
        with pytest.raises(UserError, match=message) as err:
            prepare(inputs, str(out), **kwargs)
        assert "\n" not in str(err.value)
        assert not out.exists(), (message, _snapshot(out))
    bad = tmp_path / "bad.jsonl"  # the field missing half-way: found by a worker, still nothing written
    bad.write_text("".join(json.dumps({"body": "ok"} if i != 70 else {"other": 1}) + "\n" for i in range(100)))
    with pytest.raises(UserError, match=r"--text-field=body is missing from line 71 of .*bad.jsonl"):
        prepare([str(bad)], str(out), text_field="body", workers=2, batch_docs=16)
    assert not out.exists()
    prepare([str(root / "note.txt")], str(out))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(UserError, match=r"note.bin already exists \(pass --overwrite"):
        prepare([str(root / "note.txt")], str(out))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert len(plan_outputs([str(root / "note.txt")], str(out), "text", overwrite=True)) == 1


def test_an_interrupted_run_leaves_nothing_under_the_final_name(corpus, tmp_path, monkeypatch):
    import hpc_tools.data.prepare as prep

    root, _ = corpus
    calls = {"n": 0}
    real = prep.encode_batch

    def interrupted(texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(texts)

    monkeypatch.setattr(prep, "encode_batch", interrupted)
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        prepare([str(root / "books.jsonl"), str(root / "web.jsonl")], str(out), text_field="body", batch_docs=32)
    assert not out.exists()  # temporaries deleted, the folder it created removed


def test_saved_dataset_folder(corpus, tmp_path):
    from hpc_tools.data.inputs import offline_datasets

    root, docs = corpus
    datasets = offline_datasets()
    datasets.Dataset.from_dict({"text": docs["web"][:20]}).save_to_disk(str(tmp_path / "saved"))
    (done,) = prepare([str(tmp_path / "saved")], str(tmp_path / "o"))
    assert done.documents == 20 and done.prefix.endswith("/saved")
    assert read_back(done.prefix)[3].tolist() == list(docs["web"][3].encode()) + [BYTE_EOS_ID]


# --- the indexed source --------------------------------------------------------------------------------------------

def indexed_recipe(blend, split="90,5,5", seq=32, vocab=512, **data):
    return resolve({"name": "t", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                           "seq_length": seq, "vocab_size": vocab},
                    "training": {"micro_batch_size": 2, "global_batch_size": 8, "seed": 7},
                    "cluster": {"gpus_per_node": 2, "gpu_type": "cpu"},
                    "data": {"source": "indexed", "blend": blend, "split": split, **data}})


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    root, _ = corpus
    out = tmp_path_factory.mktemp("prepared")
    prepare([str(root / "web.jsonl"), str(root / "books.jsonl")], str(out), text_field="body")
    return out


def test_indexed_samples_are_windows_of_the_data_and_deterministic(prepared):
    blend = [{"path": str(prepared / "web"), "weight": 0.7}, {"path": str(prepared / "books"), "weight": 0.3}]
    recipe = indexed_recipe(blend)
    train, valid = build_samples(recipe), validation_samples(recipe)
    assert len(train) > 100 and valid is not None and len(valid) > 0
    stream = np.concatenate([np.fromfile(prepared / f"{n}.bin", dtype=np.uint16) for n in ("web", "books")])
    text = stream.astype(np.int64).tobytes()
    idx = global_batch_indices(train, 5, 8)
    rows = train.rows(idx)
    assert rows.shape == (8, 33) and rows.dtype == np.int64
    for row in rows[:3]:  # every window is a contiguous run of one dataset's tokens
        assert row.astype(np.int64).tobytes() in text
    cache = next((prepared / "cache").iterdir())
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    from hpc_tools.data import indexed

    indexed._BUILT.clear()
    again = build_samples(recipe)  # a cache hit: nothing rewritten, the same rows
    assert np.array_equal(again.rows(idx), rows)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    # later epochs are permutations too, without a per-rank array of the corpus' size
    n = len(train)
    order = train.order_at(1, np.arange(n))
    assert sorted(order.tolist()) == list(range(n)) and not np.array_equal(order, np.arange(n))


def test_indexed_refusals_name_the_field(prepared, tmp_path):
    with pytest.raises(RecipeError, match=r"data.blend.0.weight=heavy input should be a valid number"):
        indexed_recipe([{"path": "x", "weight": "heavy"}])
    with pytest.raises(RecipeError, match=r"data.split=90/10 is not a train,valid,test split"):
        indexed_recipe([{"path": "x"}], split="90/10")
    with pytest.raises(UserError, match=r"data.blend\[1\].path=.*nothere.bin does not exist .*data prepare"):
        build_samples(indexed_recipe([{"path": str(prepared / "web")}, {"path": str(tmp_path / "nothere")}]))
    for suffix in (".bin", ".idx", ".meta.json"):
        (tmp_path / f"cut{suffix}").write_bytes((prepared / f"books{suffix}").read_bytes())
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "cut.bin") - 10)
    with pytest.raises(UserError, match=r"data.blend\[0\].path=.*cut.bin holds \d+ bytes but .*cut.idx describes"):
        build_samples(indexed_recipe([{"path": str(tmp_path / "cut")}]))
    meta = json.loads((prepared / "web.meta.json").read_text())
    (tmp_path / "big.meta.json").write_text(json.dumps({**meta, "vocab_size": 50000}))
    for suffix in (".bin", ".idx"):
        os.link(prepared / f"web{suffix}", tmp_path / f"big{suffix}")
    with pytest.raises(UserError, match=r"model.vocab_size=512 is smaller than the 50000 tokens .*data.blend\[0\]"):
        build_samples(indexed_recipe([{"path": str(tmp_path / "big")}]))
    with pytest.raises(UserError, match=r"data.split=99.9,0.1 leaves the valid split of data.blend\[0\]"):
        build_samples(indexed_recipe([{"path": str(prepared / "books")}], split="99.9,0.1", seq=512))


# --- the synthetic source --------------------------------------------------------------------------------------------

def test_vectorised_synthetic_chain_equals_the_token_by_token_recurrence():
    """Each token is relabel[state], state' = state + offsets[pick] (mod vocab) or a uniform noise state: the array
    version (cumulative sums, a running maximum) must equal that loop exactly."""
    s = synthetic_samples(seq_length=300, vocab_size=512, seed=11)
    rows = s.rows(np.array([0, 5, 65535, 17]))
    assert np.array_equal(rows[1], s[5]) and np.array_equal(rows[2], s[65535])
    # recover the hidden chain through the inverse relabelling and check every transition
    table = np.random.default_rng([11, 0x7AB1E])
    offsets = table.integers(0, 256, size=SYNTHETIC_BRANCHES)
    relabel = table.permutation(256)
    inverse = np.argsort(relabel)
    states = inverse[rows]
    steps = (states[:, 1:] - states[:, :-1]) % 256
    follows = np.isin(steps, offsets % 256)
    assert follows.mean() > 0.93  # 5 % noise resets (some land on a successor by chance)
    # a batch is the same whatever other rows are built with it, and held-out chains are new ones
    assert np.array_equal(s.rows(np.array([17]))[0], rows[3])
    held = synthetic_samples(seq_length=300, vocab_size=512, seed=11, num_samples=8, first=1 << 16)
    assert not any(np.array_equal(held[0], rows[k]) for k in range(4))


def test_workers_end_when_the_parent_ignores_sigterm(corpus, tmp_path):
    """A submitit job's process handles SIGTERM by logging it and carrying on, and forked workers inherit that handler:
    the pool's workers must still end when the prepare is done (the Slurm prepare job hung there, RUNNING forever)."""
    import subprocess
    import sys

    root, _ = corpus
    script = ("import signal, sys\n"
              "signal.signal(signal.SIGTERM, lambda *a: print('bypassed', file=sys.stderr))  # as submitit does\n"
              "from hpc_tools.data.prepare import prepare\n"
              f"done = prepare([{str(root / 'web.jsonl')!r}], {str(tmp_path / 'out')!r}, text_field='body',\n"
              "               workers=2, batch_docs=16)\n"
              "print(done[0].documents)\n")
    # the hang this guards against is forever; the prepare itself is ~20 s here, most of it importing megatron.core
    # (its indexed-dataset builder), and several times that on a loaded machine
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0 and out.stdout.split() == ["700"], out.stderr
    assert "bypassed" not in out.stderr

