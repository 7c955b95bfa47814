"""A value each rank of a group read from the coordinator on its own (a healer's ``--codec/--h auto``
setting) is made rank 0's on every rank: ``GroupConnection.rank0_text`` over a real Gloo group of
two processes on 127.0.0.1; when rank 0 left the job while it waited, every rank leaves."""

import os
import subprocess
import sys

import pytest

RANK = r'''
import sys, types
import torch, torch.distributed as dist
from diloco.runtime.rank.connection import GroupConnection
store, rank, text = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
link = types.SimpleNamespace(group_size=2, rank=rank, process_group=None,
                             averager=types.SimpleNamespace(comm_device=torch.device("cpu")))
print("agreed:" + GroupConnection.rank0_text(link, text))
dist.destroy_process_group()
'''


def two_ranks(tmp_path, script: str, args: tuple[str, str]) -> list[str]:
    """Run ``script`` as ranks 0 and 1 of a Gloo group (argv: the store file, the rank, ``args[rank]``);
    each rank's output, once both exited 0."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "store"), str(r), args[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], outs
    return outs


@pytest.mark.parametrize("texts", [("m2-paced200-int2b1024", "slo-h30-d2.2-senders-clip"),  # changed between polls
                                   ("é-h30", "x"),  # not ASCII, a different length
                                   ("", "m2-h100")])
def test_every_rank_takes_rank_0s_text(tmp_path, texts):
    for out in two_ranks(tmp_path, RANK, texts):
        assert out.splitlines()[-1] == f"agreed:{texts[0]}", out[-2000:]


def test_a_group_of_one_rank_keeps_its_own_text_without_a_process_group():
    import types

    from diloco.runtime.rank.connection import GroupConnection

    link = types.SimpleNamespace(group_size=1, rank=0, process_group=None, averager=None)
    assert GroupConnection.rank0_text(link, "m2-h100") == "m2-h100"


HEALER = r'''
import sys, types
import torch, torch.distributed as dist
from diloco.coordinator.membership import Membership
from diloco.exchange.heartbeat import GroupEvicted
from diloco.runtime.rank import worker
from diloco.runtime.rank.connection import GroupConnection
store, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
waiting = Membership(epoch=2, members={0: ("a:1", "a:2"), 1: ("b:1",)}, ring=(0, 1), heal=True)
averager = types.SimpleNamespace(comm_device=torch.device("cpu"), incarnation="i",
                                 evicted_reason="evicted" if rank == 0 else None,
                                 departure=lambda: GroupEvicted("group 0: evicted while it waited"))
client = types.SimpleNamespace(join=lambda *a, **k: Membership(epoch=2, members=waiting.members, ring=(0, 1),
                                                                 heal=True, setting="m2-h100"))
link = types.SimpleNamespace(group_size=2, rank=rank, process_group=None, membership=waiting, averager=averager,
                             client=client, transport=types.SimpleNamespace(address="a:1"))
link.rank0_text = types.MethodType(GroupConnection.rank0_text, link)
try:
    print("setting:", worker._running_auto_setting(None, link, 0))
except GroupEvicted as e:
    print("left:", e)
dist.destroy_process_group()
'''


def test_when_rank_0_leaves_while_waiting_for_the_setting_every_rank_leaves(tmp_path):
    """Rank 0 is evicted while it waits for the job's setting; rank 1 read one: both leave (exit 75
    in the worker), rather than rank 1 building an engine its group's rank 0 never will."""
    outs = two_ranks(tmp_path, HEALER, ("", ""))
    assert outs[0].splitlines()[-1] == "left: group 0: evicted while it waited", outs[0][-2000:]
    said = "left: group 0: its rank 0 left the job while waiting for its --codec/--h auto setting"
    assert outs[1].splitlines()[-1] == said, outs[1][-2000:]
