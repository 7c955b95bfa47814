"""A value each rank of a group read from the coordinator on its own (a healer's ``--codec/--h auto``
setting) is made rank 0's on every rank: ``GroupConnection.rank0_text`` over a real Gloo group of
two processes on 127.0.0.1."""

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


@pytest.mark.parametrize("texts", [("m2-paced200-int2b1024", "slo-h30-d2.2-senders-clip"),  # changed between polls
                                   ("é-h30", "x"),  # not ASCII, a different length
                                   ("", "m2-h100")])
def test_every_rank_takes_rank_0s_text(tmp_path, texts):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "store"), str(r), texts[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, out in zip(ranks, outs):
        assert p.returncode == 0, out[-2000:]
        assert out.splitlines()[-1] == f"agreed:{texts[0]}", out[-2000:]


def test_a_group_of_one_rank_keeps_its_own_text_without_a_process_group():
    import types

    from diloco.runtime.rank.connection import GroupConnection

    link = types.SimpleNamespace(group_size=1, rank=0, process_group=None, averager=None)
    assert GroupConnection.rank0_text(link, "m2-h100") == "m2-h100"
