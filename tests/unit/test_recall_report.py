"""studies.recall_report pairs two arms over the training seeds both have: a study split over
sessions (one arm at five seeds, another at three) still reports every difference, paired on
the three, with the point and seed-level interval of those three seeds alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from studies.recall_report import read_scores, report

SCORES = Path(__file__).resolve().parents[2] / "docs" / "results" / "recall" / "scores"


@pytest.fixture(scope="module")
def frame():
    frame = read_scores(SCORES)
    arms = frame.groupby("arm")["seed"].unique()
    if len(arms) < 2 or min(len(s) for s in arms) < 2:
        pytest.fail(f"the committed scores in {SCORES} hold fewer than two arms of two seeds")
    return frame


def test_a_difference_pairs_the_seeds_both_arms_have(frame):
    reset = frame[(frame["arm"] == "masked, reset")]
    continuous = frame[(frame["arm"] == "masked, continuous")]
    common = sorted(set(reset["seed"]) & set(continuous["seed"]))
    extra = reset[~reset["seed"].isin(common)]  # seeds one arm has and the other lacks
    both = frame[frame["arm"].isin(["masked, reset", "masked, continuous"])]
    only_common = both[both["seed"].isin(common)]
    key = "masked, continuous - masked, reset"

    with_extra = report(both)["cells"]["in_distribution"]
    alone = report(only_common)["cells"]["in_distribution"]
    assert len(extra) > 0 or set(reset["seed"]) == set(common)
    assert with_extra["differences"][key]["seeds"] == len(common)
    paired, expected = with_extra["differences"][key], alone["differences"][key]
    # the point and the seed-level interval are those of the shared seeds alone (the bootstrap's
    # draws follow the arms' own, which consume the report's one generator differently)
    assert paired["delta"] == expected["delta"]
    assert paired["seed_level"] == expected["seed_level"]
    assert paired["ci"][0] <= paired["delta"] <= paired["ci"][1]
    # the arm itself keeps all its seeds
    assert with_extra["arms"]["masked, reset"]["seeds"] == reset["seed"].nunique()


def test_no_difference_from_fewer_than_two_shared_seeds(frame):
    one_each = ((frame["arm"] == "masked, reset") & (frame["seed"] == 0)) | (
        (frame["arm"] == "masked, continuous") & (frame["seed"] == 1)
    )
    cells = report(frame[one_each])["cells"]["in_distribution"]
    assert cells["differences"] == {}


def test_same_weights_agreement_counts_per_instance_and_refuses_strangers(frame):
    from longctx.errors import LongctxError
    from studies.recall_report import same_weights_agreement

    masked = frame[frame["document_mask"].astype(bool) & (frame["seed"] == 0)]
    swapped = masked.copy()
    changed = swapped.index[:5]  # five instances read differently: wrong where they were right
    swapped.loc[changed, "prediction"] = -1
    swapped.loc[changed, "correct"] = 0
    result = same_weights_agreement(masked, swapped)
    assert result["all"]["instances"] == len(masked)
    assert result["all"]["agree"] == len(masked) - 5
    assert result["all"]["accuracy"] == pytest.approx(masked["correct"].mean())
    assert result["all"]["accuracy_swapped"] == pytest.approx(swapped["correct"].mean())
    assert sum(r["instances"] for k, r in result.items() if k != "all") == len(masked)
    with pytest.raises(LongctxError, match="unmasked run"):
        same_weights_agreement(frame, frame[frame["seed"] == 0])
    stranger = swapped[swapped["run"] == "recall_mt_rt_s0"].assign(run="recall_mt_rt_s99")
    with pytest.raises(LongctxError, match="recall_mt_rt_s99"):
        same_weights_agreement(masked, stranger)
