"""The node-local tier's background replication (``checkpointing.replica``): a replica cut short by a crash is
never marked complete nor counted at resume, a whole one is; a stalled one is given up within its bound; the hang
watchdog's step clock stops during a save while a save without progress is still a hang; the recipe field's rule.
The same on 4 gloo ranks as 2 nodes (slowed replication while the ranks step on, a stall):
tests/integration/test_node_tier.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.runtime import watchdog as wd
from hpc_tools.train.checkpointing import node_tier, replica
from tests.helpers import REPO
from tests.unit.test_input_classes import refused

OWN = {"__2_0.distcp": b"b" * 3000, "__3_0.distcp": b"c" * 3001}
THEIRS = {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 2000, "__1_0.distcp": b"y" * 2001}


def committed(root: Path) -> Path:
    """Node 1's local step 4 as its commit leaves it: its own files, a meta recording every node's."""
    dirs = CheckpointDirs(root)
    partial = dirs.begin(4)
    for name, data in {**OWN, **THEIRS}.items():
        (partial / name).write_bytes(data)
    final = dirs.commit(4)
    for name in THEIRS:  # the replica has not arrived yet
        (final / name).unlink()
    return final


def moves() -> list[node_tier.Move]:
    own = [{n: len(d) for n, d in THEIRS.items()}, {n: len(d) for n, d in OWN.items()}]
    return node_tier.replica_moves(own)


CRASH = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from hpc_tools.train.checkpointing import node_tier, replica

    folder, data = Path(sys.argv[1]), {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 2000}

    def transfer(nodes, moves, *, source, target, group=None, moved=None, delay_s=0.0):
        (target / ".metadata").write_bytes(data[".metadata"])       # the first file arrived whole
        (target / "__0_0.distcp.incoming").write_bytes(b"x" * 700)  # the second one is on its way
        os._exit(9)                                                 # the process dies (a node crash, a kill)

    node_tier.transfer = transfer
    nodes = node_tier.Nodes(node=1, count=2, leaders=[0, 2], local_index=0, local_count=2)
    r = replica.Replication(nodes, None, 4, folder, [tuple(m) for m in eval(sys.argv[2])])
    r._run()
""")


def test_a_crash_during_replication_leaves_no_replica_marked_complete(tmp_path):
    final = committed(tmp_path / "node1")
    proc = subprocess.run([sys.executable, "-c", CRASH, str(final), repr(moves())], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert not (final / node_tier.REPLICA_COMPLETE).exists()
    marker = json.loads((final / node_tier.REPLICA_PARTIAL).read_text())
    assert marker == {"from_node": 0, "files": {n: len(d) for n, d in THEIRS.items()}}
    assert (final / ".metadata").exists()  # a whole file of the cut replica is on disk ...
    files, present = node_tier.holdings(CheckpointDirs(final.parent), skip=[])[4]
    counted = sorted(n for n in present if n in files or n == "hpc_tools_meta.json")
    assert counted == sorted([*OWN, "hpc_tools_meta.json"])  # ... and not counted: only the node's own
    # node 0 lost: its files of step 4 exist nowhere whole, so step 4 is not a local candidate
    assert node_tier.plan([None, node_tier.holdings(CheckpointDirs(final.parent), skip=[])]) is None


def test_a_whole_replica_is_marked_complete_and_counted(tmp_path, monkeypatch):
    final = committed(tmp_path / "node1")

    def transfer(nodes, mv, *, source, target, group=None, moved=None, delay_s=0.0):
        assert (target / node_tier.REPLICA_PARTIAL).exists()  # the marker precedes the first file
        for name, _, dst, size in mv:
            if dst == nodes.node:
                (target / name).write_bytes(THEIRS[name])
                moved(size)

    monkeypatch.setattr(node_tier, "transfer", transfer)
    nodes = node_tier.Nodes(node=1, count=2, leaders=[0, 2], local_index=0, local_count=2)
    r = replica.Replication(nodes, None, 4, final, moves())
    r._run()
    assert r.error is None and r.moved == sum(len(d) for d in THEIRS.values())
    assert not (final / node_tier.REPLICA_PARTIAL).exists()
    done = json.loads((final / node_tier.REPLICA_COMPLETE).read_text())
    assert done["from_node"] == 0 and done["bytes"] == r.moved
    _, present = node_tier.holdings(CheckpointDirs(final.parent), skip=[])[4]
    assert set(THEIRS) | set(OWN) <= set(present)
    cand = node_tier.plan([None, node_tier.holdings(CheckpointDirs(final.parent), skip=[])])
    assert cand is not None and cand.step == 4 and {to for _, _, to, _ in cand.moves} == {0}


def test_a_stalled_replication_is_given_up_within_its_bound():
    nodes = node_tier.Nodes(node=0, count=2, leaders=[0, 2], local_index=0, local_count=2)
    rep = replica.Replicator(nodes, None, stall_s=0.3)
    release = threading.Event()
    r = replica.Replication(nodes, None, 6, Path("."), [])
    r.thread = threading.Thread(target=release.wait, daemon=True)  # a send that never returns
    r.thread.start()
    rep.current = r
    calls: list[float] = []
    t0 = time.monotonic()
    out = rep.wait(lambda: calls.append(time.monotonic()))
    waited = time.monotonic() - t0
    release.set()
    assert out is not None and out.step == 6 and out.error.startswith("no byte moved for")
    assert 0.3 <= waited < 2.0 and calls  # bounded, and the watchdog was told while within the bound
    assert rep.current is None


@pytest.fixture
def dog(tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "CHECK_S", 0.02)
    hangs: list[tuple[float, str | None]] = []
    d = wd.Watchdog(0.3, tmp_path, 0)
    monkeypatch.setattr(d, "_hang", lambda idle, section=None: hangs.append((idle, section)) or d._stop.set())
    d._started_step = 1
    d.start()
    yield d, hangs
    d.stop()


def test_a_save_that_progresses_is_outside_the_step_clock(dog):
    d, hangs = dog
    d.beat(1)
    with d.outside_step("checkpoint save"):
        for _ in range(40):  # 0.8 s of save, longer than the 0.3 s timeout, with progress
            time.sleep(0.02)
            d.progress()
    time.sleep(0.1)
    assert hangs == []
    assert time.monotonic() - d._last < 0.3  # the save did not count toward the step


def test_a_save_without_progress_is_still_a_hang(dog):
    d, hangs = dog
    d.beat(1)
    with d.outside_step("checkpoint save"):
        time.sleep(0.8)
    assert hangs and hangs[0][1] == "checkpoint save" and hangs[0][0] > 0.3
    assert wd._stalled(hangs[0][0], hangs[0][1]).startswith("no progress in the checkpoint save for")


@pytest.mark.parametrize("value", ["eth 0", "ib0;rm", "a" * 16, "ib0,,eth1", "eth0/1"])
def test_a_replication_interface_that_is_no_interface_name_is_refused(capsys, tmp_path, value):
    line = refused(capsys, tmp_path, "validate", "--set", f"checkpoint.local_replicate_interface={value}")
    assert "checkpoint.local_replicate_interface=" in line and "is not a network interface name" in line, line


def test_a_replication_interface_a_node_lacks_is_named():
    assert replica.missing_interface(None) is None
    assert replica.missing_interface("lo") is None
    why = replica.missing_interface("lo,nosuchif9")
    assert why is not None and "no interface nosuchif9" in why and "lo" in why


def test_the_replication_group_is_made_on_the_named_interface(monkeypatch):
    seen: list[str | None] = []
    fake = SimpleNamespace(new_group=lambda **kw: seen.append(os.environ.get("GLOO_SOCKET_IFNAME"))
                           or ("group", kw["timeout"].total_seconds()))
    monkeypatch.setattr(replica, "live_dist", lambda: fake)
    monkeypatch.setattr(replica, "gather", lambda obj: [obj])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    replica._GROUPS.clear()
    nodes = node_tier.Nodes(node=0, count=2, leaders=[0, 2], local_index=0, local_count=2)
    ctx = SimpleNamespace(recipe=SimpleNamespace(checkpoint=SimpleNamespace(local_replicate_interface="lo"),
                                                 cluster=SimpleNamespace(hang_timeout_min=2.0)))
    rep = replica.Replicator.of(ctx, nodes)
    assert seen == ["lo"] and rep.group == ("group", 120.0) and rep.stall_s == 120.0
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0"  # the run's own groups keep theirs
    replica._GROUPS.clear()
