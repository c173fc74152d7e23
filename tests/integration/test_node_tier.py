"""The node-local checkpoint tier of a multi-node run (``hpc_tools.train.checkpointing.node_tier``), through the real
``Saver`` and the real ``checkpointing.resume`` on 4 gloo ranks seen as 2 nodes x 2 ranks, each node with its own folder
(tests/integration/node_tier_driver.py: one launch for every case). The same tier on the real 2-node Slurm cluster,
with real training, is tests/integration/test_restarts_slurm.py's crash job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_driver

HERE = Path(__file__).resolve().parent
ALL = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "hpc_tools_meta.json"]
REPLICATED = sorted([*ALL, ".replica.json"])  # with the marker of a whole replica (node_tier.REPLICA_COMPLETE)

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_driver("node_tier_driver.py", tmp_path_factory.mktemp("node_tier") / "results.json", timeout=300)


def test_each_node_holds_its_own_files_and_the_previous_nodes(results):
    r = results["replicated"]
    assert r["nodes_count"] == 2 and r["leaders"] == [0, 2]
    assert [(x["iteration"], x["tier"], x["async"], x["verified"]) for x in r["records"]] == [
        (2, "local", False, True), (3, "shared", False, True), (4, "local", True, True)]
    assert "/node0/ckpt/run/iter_0000004" in r["records"][2]["path"]
    for node in r["nodes"]:  # 2 nodes: own + the peer's = every rank's shard on each node, the replica complete
        assert node == {"iter_0000002": REPLICATED, "iter_0000004": REPLICATED}


def test_a_wiped_node_gets_the_newest_local_checkpoint_back_from_its_peer(results):
    r = results["wiped"]
    assert r["resumed"] == 4  # the local step 4 over the shared step 3, although node 1 held nothing
    assert r["nodes"][1] == {"iter_0000004": ALL}  # copied from node 0's replica, meta included


def test_without_replication_a_lost_node_loses_its_newest_local_checkpoint(results):
    r = results["unreplicated"]
    before = r["nodes_before"]
    assert before[0]["iter_0000006"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "hpc_tools_meta.json"]
    assert before[1]["iter_0000006"] == ["__2_0.distcp", "__3_0.distcp", "hpc_tools_meta.json"]
    assert r["resumed"] == 4  # step 6's node-1 shards went with its disk: the newest step the nodes hold whole


def test_a_corrupt_copy_on_one_node_sets_the_checkpoint_aside_on_every_node(results):
    r = results["corrupt"]
    assert r["resumed"] == 3  # the shared tier's step 3
    for node in r["nodes"]:
        assert "iter_0000004" not in node and "SET_ASIDE.txt" in node["iter_0000004.bad-checksum"]


def test_a_local_dir_that_is_one_folder_for_every_node_is_refused(results):
    r = results["one_folder"]
    assert r == {"local": False, "due_at_2": None, "left": []}  # tier off, nothing due, the probes removed


def test_a_slow_replication_does_not_hold_the_ranks(results):
    r = results["slow"]
    [rec] = r["records"]
    assert (rec["iteration"], rec["tier"], rec["verified"]) == (8, "local", True)
    # the copy took ~1 s (26 chunks each way x 0.02 s); the save returned before it, the ranks stepped meanwhile
    assert r["stepping_s"] > 0.5 and rec["blocked_s"] < r["stepping_s"] / 2, r
    assert r["steps_while_replicating"] >= 5, r
    for node in r["nodes"]:
        assert node["iter_0000008"] == REPLICATED
    assert any(line.startswith("replica of local checkpoint step 8 complete on every node") for line in r["log"])


def test_a_stalled_replication_is_bounded_told_and_never_counted(results):
    r = results["stalled"]
    assert 2.5 < r["waited_s"] < 20, r  # the bound (the recipe's hang timeout: 3 s), not the 6 s pause per chunk
    assert r["replicator_off"] is True
    assert len(r["warnings"]) == 1 and "replica of local checkpoint step 10 not complete" in r["warnings"][0]
    for node in r["nodes"]:
        assert ".replica-partial.json" in node["iter_0000010"] and ".replica.json" not in node["iter_0000010"]
    # each node counts its own files of step 10 only: the cut replica is never used for recovery
    assert r["counted"] == [[".metadata", "__0_0.distcp", "__1_0.distcp"], ["__2_0.distcp", "__3_0.distcp"]]
