"""NCCL's debug variables around preflight (issue 46 item 8): set for its own communicators only where unset, and
removed after it, so that NCCL's warnings during training go to the rank and batch logs, not to the preflight folder
(before, ``NCCL_DEBUG=INFO`` and ``NCCL_DEBUG_FILE`` stayed set for the whole run)."""

from __future__ import annotations

import os

import pytest

from hpc_tools.runtime.preflight import run

NAMES = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


@pytest.fixture
def clean(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def nccl_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in NAMES}


def test_set_while_preflight_runs_and_gone_after(tmp_path, clean):
    with run.nccl_info_to_file(tmp_path / "preflight"):
        inside = nccl_env()
    assert inside["NCCL_DEBUG"] == "INFO" and inside["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert inside["NCCL_DEBUG_FILE"].startswith(str(tmp_path / "preflight" / "nccl-"))
    assert nccl_env() == {}, "preflight's NCCL_DEBUG outlived it: the trainer's NCCL warnings would go to its file"


def test_gone_after_a_check_that_raised(tmp_path, clean):
    with pytest.raises(RuntimeError), run.nccl_info_to_file(tmp_path):
        raise RuntimeError("a check broke")
    assert nccl_env() == {}


def test_what_the_user_set_is_kept(tmp_path, clean, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    with run.nccl_info_to_file(tmp_path):
        assert nccl_env() == {"NCCL_DEBUG": "WARN"}
    assert nccl_env() == {"NCCL_DEBUG": "WARN"}
    monkeypatch.delenv("NCCL_DEBUG")
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/var/log/nccl-%h-%p.log")  # the user's file, without a level
    with run.nccl_info_to_file(tmp_path):
        assert nccl_env() == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                              "NCCL_DEBUG_FILE": "/var/log/nccl-%h-%p.log"}
    assert nccl_env() == {"NCCL_DEBUG_FILE": "/var/log/nccl-%h-%p.log"}


def test_cpu_ranks_set_nothing(clean):
    with run.nccl_info_to_file(None):
        assert nccl_env() == {}
