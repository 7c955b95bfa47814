"""A short churn drill in the suite: real `diloco run` processes SIGKILLed and restarted
(bench/churn.py runs the long one). Every target of the benchmark must hold."""

import argparse
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
CHURN = Path(__file__).resolve().parents[2] / "bench" / "churn.py"


def load_churn():
    spec = importlib.util.spec_from_file_location("bench_churn", CHURN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_kills_no_divergence_no_hang_no_leak_and_the_loss_goes_down():
    churn = load_churn()
    a = argparse.Namespace(kills=3, groups=3, steps=2000, h=10, heartbeat_timeout=2.0, collective_timeout=5.0,
                           gap_min=1.0, gap_max=2.0, pause_min=0.2, pause_max=1.0, seed=11, netns=False,
                           limit=240.0)
    r = churn.run(a)
    assert churn.check(r, a) == [], r
    assert r["kills"] == 3 and r["heals"] >= 1 and r["committed_rounds"] >= 100
