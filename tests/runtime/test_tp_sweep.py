"""A tensor-parallel rank 0 killed with SIGKILL leaves its rendezvous folder in the temp folder and, killed
before every rank mapped it, its /dev/shm segment; the next rank 0 to start sweeps both
(runtime/tp_follower.py sweep_stale_tp_folders), and never a live process's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pdserve.runtime.tp_follower import OWNER_FILE, PREFIX, sweep_stale_tp_folders

# A rank 0 of one rank: it makes its folder and segment as every rank 0 does, says where, and waits.
RANK_ZERO = """
import sys, time
from pdserve.config import RuntimeConfig
from pdserve.runtime.tp_follower import spawn_followers
folder, _ = spawn_followers(RuntimeConfig(device="cpu"))
with open(folder + "/allreduce") as f:
    print(folder, f.read(), flush=True)
time.sleep(300)
"""


def start_rank_zero(tmp: str) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", RANK_ZERO],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": tmp, "PDSERVE_TP_ALLREDUCE": "shm"},
    )
    assert proc.stdout is not None
    folder, _, segment = proc.stdout.readline().strip().partition(" ")
    assert folder.startswith(os.path.join(tmp, PREFIX)), folder
    return proc, folder, segment


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_killed_rank_zeros_folder_and_segment_are_swept_a_live_ones_kept(tmp_path) -> None:
    tmp = str(tmp_path)
    killed, dead_folder, dead_segment = start_rank_zero(tmp)
    live, live_folder, live_segment = start_rank_zero(tmp)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert os.path.isdir(dead_folder) and os.path.exists(dead_segment)  # what SIGKILL leaves behind
        removed = sweep_stale_tp_folders(tmp)
        assert removed == [dead_folder]
        assert not os.path.exists(dead_folder) and not os.path.exists(dead_segment)
        assert os.path.isdir(live_folder) and os.path.exists(live_segment)
    finally:
        live.kill()
        live.wait(30)
    # the next rank 0 to start sweeps the other one itself
    again, again_folder, _ = start_rank_zero(tmp)
    again.kill()
    again.wait(30)
    assert not os.path.exists(live_folder) and not os.path.exists(live_segment)
    sweep_stale_tp_folders(tmp)
    assert not os.path.exists(again_folder)


def owned(tmp_path, name: str, owner: str | None) -> str:
    folder = tmp_path / f"{PREFIX}{name}"
    folder.mkdir(mode=0o700)
    (folder / "allreduce").write_text("")
    if owner is not None:
        (folder / OWNER_FILE).write_text(owner)
    return str(folder)


def test_only_folders_of_dead_owners_of_this_user_and_namespace_go(tmp_path) -> None:
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = f.read().rpartition(")")[2].split()[19]
    ns = os.readlink("/proc/self/ns/pid")
    live = owned(tmp_path, "live", f"{os.getpid()} {start} {ns}")
    reused = owned(tmp_path, "reused", f"{os.getpid()} {int(start) + 1} {ns}")  # same pid, a later process
    other_ns = owned(tmp_path, "other-ns", f"{os.getpid()} {int(start) + 1} pid:[1]")
    no_owner = owned(tmp_path, "no-owner", None)
    torn = owned(tmp_path, "torn", f"{os.getpid()}")
    not_a_folder = tmp_path / f"{PREFIX}file"
    not_a_folder.write_text("")
    kept = [live, other_ns, no_owner, torn, str(not_a_folder)]
    if os.getuid() == 0:  # root can make a folder of another user, which is never touched
        theirs = owned(tmp_path, "theirs", f"{os.getpid()} {int(start) + 1} {ns}")
        os.chown(theirs, 65534, 65534)
        kept.append(theirs)
    assert sweep_stale_tp_folders(str(tmp_path)) == [reused]
    assert all(os.path.exists(p) for p in kept)


def test_the_segment_named_is_removed_only_when_it_is_a_tp_segment(tmp_path) -> None:
    dead = owned(tmp_path, "dead", f"999999999 1 {os.readlink('/proc/self/ns/pid')}")
    victim = tmp_path / "not-a-segment"
    victim.write_text("keep me")
    (tmp_path / f"{PREFIX}dead" / "allreduce").write_text(str(victim))
    assert sweep_stale_tp_folders(str(tmp_path)) == [dead]
    assert victim.read_text() == "keep me"
