"""validate against the world: the files a recipe names (one line each, naming the field) and the live Slurm cluster
(partition, nodes, GPUs and CPUs per node, time limit). The partition figures are injected where the test cluster
cannot show them (its one partition has no time limit and no GPUs); the real cluster answers the partition test."""

from __future__ import annotations

import json

import pytest
import yaml

from hpc_tools.recipe.load import resolve
from hpc_tools.world import (
    Partition,
    SlurmView,
    gres_gpus,
    is_local_image,
    parse_sinfo,
    path_violations,
    slurm_violations,
    world_violations,
)
from tests.helpers import run_cli

CPU = {"name": "world", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                  "vocab_size": 512},
       "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "cpus_per_task": 1, "time_limit": "00:10:00"}}


def recipe(*overrides: str, base: dict = CPU):
    return resolve(base, list(overrides), source="world (inline)")


def part(name="short", default=True, max_time_min=30.0, max_nodes=None, nodes=2, gpus=4, cpus=16, gres="gpu:4"):
    return Partition(name, default, "up", max_time_min, max_nodes, nodes, gpus, cpus, gres)


def messages(violations) -> list[str]:
    return [str(v) for v in violations]


def test_missing_local_paths_are_one_line_each_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("hello")
    (tmp_path / "wiki.bin").write_bytes(b"")  # .idx missing
    got = messages(path_violations(recipe(
        "data.source=files", "data.paths=[corpus.txt, missing/shard.jsonl]", "data.tokenizer=tok/missing",
        "checkpoint.load_path=ckpt/iter_0000010",
        "cluster.setup.container={kind: pyxis, image: images/pytorch.sqsh}")))
    assert got[0].startswith("data.paths[1]=missing/shard.jsonl does not exist")
    assert got[1].startswith("data.tokenizer=tok/missing is neither `byte` nor an existing folder")
    assert got[2].startswith("checkpoint.load_path=ckpt/iter_0000010 does not exist")
    assert got[3].startswith("cluster.setup.container.image=images/pytorch.sqsh is not an existing image file")
    assert len(got) == 4, got
    indexed = messages(path_violations(recipe("data.source=indexed", "data.blend=[{path: wiki}, {path: books}]")))
    assert indexed == [m for m in indexed if m.startswith("data.blend[")] and len(indexed) == 2
    assert "has no .idx file" in indexed[0] and "has no .bin or .idx file" in indexed[1]
    [hf] = messages(path_violations(recipe("checkpoint.init_from_hf=hf/missing")))
    assert hf.startswith("checkpoint.init_from_hf=hf/missing is not an existing folder")
    (tmp_path / "wiki.idx").write_bytes(b"")
    (tmp_path / "tok").mkdir()
    assert path_violations(recipe("data.source=indexed", "data.blend=[{path: wiki}]", "data.tokenizer=tok")) == []


def test_registry_images_and_unused_paths_are_not_checked():
    assert not is_local_image("nvcr.io#nvidia/pytorch:24.05-py3") and not is_local_image("docker://ubuntu:22.04")
    assert not is_local_image("ubuntu:22.04") and is_local_image("/images/x.sqsh") and is_local_image("img.sif")
    assert path_violations(recipe("data.paths=[nowhere.txt]")) == []  # source: synthetic never reads them
    assert path_violations(recipe("cluster.setup.container={kind: apptainer, image: 'docker://ubuntu:22.04'}")) == []


def test_partition_checks_against_injected_partitions():
    view = SlurmView((part(), part("big", default=False, max_time_min=None, max_nodes=64, nodes=64, gpus=8)))
    assert slurm_violations(recipe(), view) == []
    wrong = messages(slurm_violations(recipe("cluster.partition=nosuch"), view))
    assert wrong == ["cluster.partition=nosuch is not a partition of this Slurm cluster (use one of: short (the "
                     "default), big)"]
    over = messages(slurm_violations(recipe("cluster.time_limit=02:00:00", "cluster.nodes=3",
                                            "cluster.cpus_per_task=16"), view))
    assert over[0] == ("cluster.nodes=3 exceeds the 2 nodes of partition short (use at most 2 nodes, or another "
                       "partition)")
    assert over[1].startswith("cluster.cpus_per_task=16 x 2 ranks per node = 32 CPUs exceeds the 16 CPUs per node")
    assert over[2] == ("cluster.time_limit=02:00:00 exceeds the time limit of partition short (00:30:00) (use at "
                       "most 00:30:00, or another partition)")
    gpus = messages(slurm_violations(recipe("cluster.gpu_type=H100-SXM", "cluster.gpus_per_node=8",
                                            "cluster.partition=big", "cluster.nodes=65"), view))
    assert gpus == ["cluster.nodes=65 exceeds the 64-node job limit of partition big (use at most 64 nodes, or "
                    "another partition)"]
    no_gpus = SlurmView((part(gpus=0, gres="none"),))
    [line] = messages(slurm_violations(recipe("cluster.gpu_type=H100-SXM"), no_gpus))
    assert line.startswith("cluster.gpus_per_node=2 exceeds partition short: it has no GPUs")
    assert messages(slurm_violations(recipe(), SlurmView((part(default=False),)))) == [
        "cluster.partition is unset and this Slurm cluster has no default partition (set one of: short)"]


def test_spare_nodes_over_the_partition_name_the_value_written_and_a_fix_not_already_true():
    view = SlurmView((part(nodes=4),))
    restarts = ("cluster.restarts=1",)
    # the spare makes the difference: named, and the fix is not "at most 2 nodes" (already true)
    assert messages(slurm_violations(recipe(*restarts, "cluster.nodes=4", "cluster.spare_nodes=1"), view)) == [
        "cluster.spare_nodes=1 with cluster.nodes=4 asks for 5 nodes, beyond the 4 nodes of partition short (use "
        "spare_nodes: 0 (no in-job node replacement), fewer nodes, or another partition)"]
    assert messages(slurm_violations(recipe(*restarts, "cluster.nodes=2", "cluster.spare_nodes=3"), view)) == [
        "cluster.spare_nodes=3 with cluster.nodes=2 asks for 5 nodes, beyond the 4 nodes of partition short (use at "
        "most 2 spare nodes, or another partition)"]
    # the nodes alone are over: cluster.nodes as written, the room left for them beside the spares
    assert messages(slurm_violations(recipe(*restarts, "cluster.nodes=5", "cluster.spare_nodes=1"), view)) == [
        "cluster.nodes=5 with cluster.spare_nodes=1 (6 nodes in all) exceeds the 4 nodes of partition short (use at "
        "most 3 nodes, or another partition)"]


def test_no_slurm_means_not_checked():
    view = SlurmView(None, "Slurm unreachable (sinfo did not answer within 3 s)")
    assert world_violations(recipe("cluster.partition=nosuch"), view=view) == []
    assert view.summary() == "not checked against Slurm: Slurm unreachable (sinfo did not answer within 3 s)"


def test_sinfo_output_is_parsed_per_partition():
    text = ("gpu*|up|2-00:00:00|1-16|gpu:h100:8(S:0-1)|64|g1\ngpu*|up|2-00:00:00|1-16|gpu:h100:4|64|g2\n"
            "cpu|up|infinite|1-infinite|(null)|32|c1\ncpu|up|infinite|1-infinite|(null)|48|c2\n"
            "debug|up|30:00|1-infinite|(null)|4|c1\n")
    gpu, cpu, debug = parse_sinfo(text)
    assert (gpu.name, gpu.default, gpu.max_time_min, gpu.max_nodes, gpu.nodes, gpu.gpus_per_node) == \
        ("gpu", True, 2880, 16, 2, 4)
    assert (cpu.default, cpu.max_time_min, cpu.max_nodes, cpu.gpus_per_node, cpu.cpus_per_node) == \
        (False, None, None, 0, 32)
    assert debug.max_time_min == 30
    assert gres_gpus("gpu:a100:2,gpu:v100:1") == 3 and gres_gpus("(null)") == 0
    with pytest.raises(ValueError):
        parse_sinfo("a|b\n")


def test_validate_names_each_missing_path_and_exits_2(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**CPU, "data": {"source": "files", "paths": [str(tmp_path / "nope1.txt"),
                                                                                 str(tmp_path / "nope2.txt")]},
                                    "checkpoint": {"load_path": str(tmp_path / "nope_ckpt")}}))
    out = run_cli("validate", str(path))
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert [e.split(": ", 2)[2].split("=")[0] for e in errors] == ["data.paths[0]", "data.paths[1]",
                                                                   "checkpoint.load_path"], errors
    offline = run_cli("validate", str(path), "--offline", "--json")
    assert offline.returncode == 0 and json.loads(offline.stdout)["ok"] is True


@pytest.mark.slurm
def test_validate_against_the_real_cluster_refuses_a_missing_partition(slurm, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**CPU, "cluster": {**CPU["cluster"], "partition": "no_such_partition"}}))
    out = run_cli("validate", str(path), "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 2 and data["slurm"]["checked"] is True
    [error] = data["results"][0]["errors"]
    assert error["path"] == "cluster.partition" and error["value"] == "no_such_partition"
    assert "not a partition of this Slurm cluster" in error["rule"] and data["slurm"]["partitions"][0] in error["fix"]
    # the same recipe on the default partition, 3 nodes of a 2-node cluster: one line naming cluster.nodes
    path.write_text(yaml.safe_dump({**CPU, "cluster": {**CPU["cluster"], "nodes": 3}}))
    out = run_cli("validate", str(path))
    assert out.returncode == 2 and f"cluster.nodes=3 exceeds the {slurm} nodes of partition" in out.stderr


def test_submit_refuses_a_missing_path_before_writing_anything(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**CPU, "data": {"source": "files", "paths": [str(tmp_path / "gone.jsonl")]}}))
    out = run_cli("submit", str(path), "--dry-run", "--executor", "local", "--runs-dir", str(tmp_path / "runs"))
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "data.paths[0]=" in lines[0] and "does not exist" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_init_from_hf_folder_of_another_shape_is_caught_before_queueing(tmp_path, monkeypatch):
    from hpc_tools.hf.mapping import hf_config_fields

    monkeypatch.chdir(tmp_path)
    r = recipe("backend.kind=megatron", "checkpoint.init_from_hf=hf")
    (tmp_path / "hf").mkdir()
    config = hf_config_fields(r.model)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert not [v for v in path_violations(r) if v.path == "checkpoint.init_from_hf"]
    key = "n_layer" if config["model_type"] == "gpt2" else "num_hidden_layers"
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, key: 3}))
    got = [str(v) for v in path_violations(r) if v.path == "checkpoint.init_from_hf"]
    assert len(got) == 1 and f"{key}=3" in got[0] and "model.num_layers=2" in got[0], got
    (tmp_path / "hf" / "config.json").write_text("{not json")
    got = [str(v) for v in path_violations(r) if v.path == "checkpoint.init_from_hf"]
    assert len(got) == 1 and "not readable JSON" in got[0], got
