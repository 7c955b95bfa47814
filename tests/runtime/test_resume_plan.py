"""Which step a job started from checkpoints continues at: the groups' newest steps travel in one
exact exchange, the job resumes from the newest, and a group behind it (or with none) heals.
Pure cases and in-process groups; the processes themselves: test_resume_behind.py."""

import pytest
import torch
from diloco_helpers import run_in_threads

from diloco.engine.averaging import InProcessGroups
from diloco.runtime.checkpoints import resume_plan
from diloco.runtime.checkpoints.rank_state import STEP_BITS


def test_the_job_resumes_from_the_newest_step_and_the_groups_behind_heal():
    plan = resume_plan.plan({0: 40, 1: 60, 2: None, 3: 60})
    assert plan.step == 60
    assert [g for g in range(4) if plan.heals(g)] == [0, 2]
    assert plan.describe() == "group 0: step 40, group 1: step 60, group 2: none, group 3: step 60"


def test_no_checkpoint_anywhere_is_a_fresh_start_where_nobody_heals():
    plan = resume_plan.plan({0: None, 1: None})
    assert plan.step is None and not plan.heals(0) and not plan.heals(1)


def test_step_zero_is_a_step_not_a_missing_checkpoint():
    plan = resume_plan.plan({0: 0, 1: None})
    assert plan.step == 0 and not plan.heals(0) and plan.heals(1)


@pytest.mark.parametrize("step", [0, 1, 40, 2**31 + 7, 2**STEP_BITS - 1, None])
def test_encode_decode_round_trip_through_a_mean(step):
    groups = 3
    vectors = [resume_plan.encode(step if g == 1 else 5 * g, g, groups) for g in range(groups)]
    mean = torch.stack(vectors).mean(0)
    assert resume_plan.decode(mean, groups) == {0: 0, 1: step, 2: 10}


def test_a_weighted_mean_decodes_too():
    vectors = [resume_plan.encode(s, g, 2) for g, s in enumerate([40, 20])]
    mean = 0.9 * vectors[0] + 0.1 * vectors[1]
    assert resume_plan.decode(mean, 2) == {0: 40, 1: 20}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="outside"):
        resume_plan.encode(2**STEP_BITS, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        resume_plan.encode(-1, 0, 2)
    with pytest.raises(ValueError, match="group 2 outside"):
        resume_plan.encode(5, 2, 2)
    with pytest.raises(ValueError, match="expected 98"):
        resume_plan.decode(torch.zeros(49), 2)


def _agree(newest, **kw):
    groups = InProcessGroups(len(newest))
    plans, errors = {}, {}

    def work(i):
        try:
            plans[i] = resume_plan.agree(groups.member(i), newest[i], group=i, groups=len(newest), **kw)
        except ValueError as e:
            errors[i] = str(e)

    run_in_threads(work, len(newest))
    return plans, errors


def test_every_group_computes_the_same_plan():
    plans, errors = _agree([20, 40, None])
    assert not errors and len(plans) == 3
    assert all(p == plans[0] for p in plans.values())
    assert plans[0].step == 40 and plans[0].newest == {0: 20, 1: 40, 2: None}
    assert [g for g in range(3) if plans[0].heals(g)] == [0, 2]


def test_a_named_step_folder_must_be_every_groups_step():
    plans, errors = _agree([40, 40], exact_step=True)
    assert not errors and plans[0].step == 40
    plans, errors = _agree([40, 20], exact_step=True)
    assert not plans and len(errors) == 2
    assert all("not at the same step (group 0: step 40, group 1: step 20)" in e for e in errors.values())


def test_one_group_needs_no_exchange():
    class NoExchange:
        num_groups = 1

        def start(self, *a, **k):  # pragma: no cover - the test fails if it is called
            raise AssertionError("a one-group job exchanged its resume step")

    assert resume_plan.agree(NoExchange(), 40, group=0, groups=1).step == 40
