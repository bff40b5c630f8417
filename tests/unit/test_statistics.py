"""studies.statistics: the hierarchical, seed-paired bootstrap on data of known
structure."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from studies import statistics as st

SEEDS, INSTANCES = 5, 200


def shared_structure(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Arm A: a large seed effect (sd 1) plus instance noise (sd 0.3); arm B = A + 0.1 on
    every instance (the same seeds, the same instances)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1.0, (SEEDS, 1)) + rng.normal(0, 0.3, (SEEDS, INSTANCES))
    return a, a + 0.1


def test_paired_difference_is_narrow_and_covers_the_shift_unpaired_is_wide():
    a, b = shared_structure()
    arm_a, arm_b = st.ArmSample.of(a), st.ArmSample.of(b)
    paired = st.difference(arm_b, arm_a, 2000, np.random.default_rng(0))
    unpaired = st.difference(arm_b, arm_a, 2000, np.random.default_rng(0), paired=False)
    assert paired["delta"] == pytest.approx(0.1, rel=1e-9)
    low, high = paired["ci"]
    # every draw sees the same shift: the interval is 0.1 up to round-off
    assert low == pytest.approx(0.1, rel=1e-9) and high == pytest.approx(0.1, rel=1e-9)
    wide = unpaired["ci"][1] - unpaired["ci"][0]
    assert unpaired["ci"][0] < 0 < unpaired["ci"][1] and wide > 0.5  # the seed sd 1 dominates
    assert paired["paired"] and not unpaired["paired"]


def test_paired_difference_with_instance_noise_between_arms():
    """B = A + 0.1 + its own instance noise (sd 0.1): the paired interval holds 0.1 and its
    width is the instance noise's, ~2 x 1.96 x 0.1 / sqrt(S x N), not the seeds'."""
    a, _ = shared_structure()
    b = a + 0.1 + np.random.default_rng(9).normal(0, 0.1, a.shape)
    ci = st.difference(st.ArmSample.of(b), st.ArmSample.of(a), 4000, np.random.default_rng(1))["ci"]
    assert ci[0] < 0.1 < ci[1]
    assert 0.005 < ci[1] - ci[0] < 0.04


def test_one_seed_reflects_instances_only():
    rng = np.random.default_rng(3)
    values = rng.normal(0, 1.0, (1, 400))
    low, high = st.interval(st.bootstrap(st.ArmSample.of(values), 4000, np.random.default_rng(0)))
    # the standard error of a mean of 400 draws of sd 1: 0.05, so a 95% interval ~0.2 wide
    assert 0.15 < high - low < 0.25
    assert low < values.mean() < high


def test_seeds_widen_the_interval_beyond_instances():
    rng = np.random.default_rng(4)
    seedless = rng.normal(0, 0.3, (SEEDS, INSTANCES))
    seedy = seedless + rng.normal(0, 1.0, (SEEDS, 1))
    width = [np.subtract(*st.interval(st.bootstrap(st.ArmSample.of(v), 2000,
                                                   np.random.default_rng(0))))
             for v in (seedless, seedy)]  # fmt: skip
    assert abs(width[1]) > 10 * abs(width[0])


def test_ratio_of_sums_weights_instances():
    """The held-out loss: loss sums over tokens; a long document weighs more."""
    arm = st.ArmSample.of([[10.0, 2.0]], weights=[10.0, 1.0])
    assert arm.estimate == pytest.approx(12.0 / 11.0)
    draws = st.Draws(np.zeros((1, 1), int), np.array([[[1, 1]]]))
    assert st.replicates(arm, draws)[0] == pytest.approx(2.0)


def test_replicates_follow_the_hierarchy():
    """Draw seeds [1, 1], instances [[0, 2], [2, 2]]: the mean of those four cells."""
    values = np.array([[0.0, 0.0, 0.0], [1.0, 5.0, 7.0]])
    draws = st.Draws(np.array([[1, 1]]), np.array([[[0, 2], [2, 2]]]))
    assert st.replicates(st.ArmSample.of(values), draws)[0] == pytest.approx((1 + 7 + 7 + 7) / 4)


def test_deterministic_under_a_fixed_rng():
    a, b = shared_structure(5)
    b = b + np.random.default_rng(2).normal(0, 0.2, b.shape)
    arm_a, arm_b = st.ArmSample.of(a), st.ArmSample.of(b)
    first = st.bootstrap_difference(arm_a, arm_b, 500, np.random.default_rng(7))
    again = st.bootstrap_difference(arm_a, arm_b, 500, np.random.default_rng(7))
    other = st.bootstrap_difference(arm_a, arm_b, 500, np.random.default_rng(8))
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_chunked_replicates_equal_one_gather(monkeypatch):
    a, _ = shared_structure(6)
    arm = st.ArmSample.of(a)
    draws = st.Draws.sample(SEEDS, INSTANCES, 50, np.random.default_rng(0))
    whole = st.replicates(arm, draws)
    monkeypatch.setattr(st, "_CHUNK_CELLS", SEEDS * INSTANCES * 3)
    assert np.allclose(st.replicates(arm, draws), whole, rtol=1e-12, atol=0)


def test_arms_that_claim_pairing_must_share_seeds_and_instances():
    values = np.zeros((2, 3))
    base = st.ArmSample.of(values, seeds=[0, 1], instances=["x", "y", "z"])
    other_seeds = st.ArmSample.of(values, seeds=[0, 2], instances=["x", "y", "z"])
    other_items = st.ArmSample.of(values, seeds=[0, 1], instances=["x", "y", "w"])
    rng = np.random.default_rng(0)
    with pytest.raises(st.PairingError, match=r"different training seeds \(\[0, 1\] vs \[0, 2\]\)"):
        st.bootstrap_difference(base, other_seeds, 10, rng)
    with pytest.raises(st.PairingError, match="different instances") as err:
        st.bootstrap_difference(base, other_items, 10, rng)
    assert "\n" not in str(err.value)
    # unpaired, they compare
    assert st.bootstrap_difference(base, other_seeds, 10, rng, paired=False).shape == (10,)


def test_bad_samples_are_refused_in_one_line():
    with pytest.raises(ValueError, match="non-finite"):
        st.ArmSample.of([[1.0, np.nan]])
    with pytest.raises(ValueError, match="labels"):
        st.ArmSample.of([[1.0, 2.0]], seeds=[0, 1])


def test_arm_sample_from_a_tidy_frame_lines_instances_up():
    rows = [{"seed": s, "task": t, "sample": i, "score": s + i, "w": 1.0}
            for s in (1, 0) for t in ("b", "a") for i in (0, 1)]  # fmt: skip
    arm = st.arm_sample(pd.DataFrame(rows), "score", "w", ["task", "sample"])
    assert arm.seeds == (0, 1) and arm.instances == (("a", 0), ("a", 1), ("b", 0), ("b", 1))
    assert arm.values.tolist() == [[0, 1, 0, 1], [1, 2, 1, 2]]
    assert arm.per_seed() == {0: 0.5, 1: 1.5}
    missing = pd.DataFrame(rows[:-1])
    with pytest.raises(st.PairingError, match=r"seeds \[0\] lack some instances"):
        st.arm_sample(missing, "score", "w", ["task", "sample"])


def test_seed_level_t_interval_is_the_hand_computation():
    """[1, 2, 3]: mean 2, sd 1, half-width t_{0.975, 2} x 1 / sqrt(3) = 4.303 x 0.577 = 2.484."""
    level = st.seed_level([1.0, 2.0, 3.0])
    assert level["mean"] == 2.0 and level["n"] == 3
    assert level["t_ci"] == pytest.approx([2 - 4.302653 / 3**0.5, 2 + 4.302653 / 3**0.5])
    assert (level["positive"], level["negative"]) == (3, 0)
    assert st.seed_level([-1.0, 0.0, 2.0])["positive"] == 1  # 0 counts on neither side


def test_three_seeds_the_t_interval_reaches_beyond_the_bootstrap():
    """Per-seed differences 1, 2, 3 (no instance noise): the percentile bootstrap stays within
    [1, 3], the seed-level interval reaches below 0 and above 4.4: claims take the wider."""
    a = np.zeros((3, 50))
    b = a + np.array([[1.0], [2.0], [3.0]])
    row = st.difference(st.ArmSample.of(b), st.ArmSample.of(a), 2000, np.random.default_rng(0))
    assert row["ci"][0] >= 1.0 and row["ci"][1] <= 3.0
    level = row["seed_level"]
    assert level["mean"] == pytest.approx(row["delta"]) and level["n"] == 3
    assert level["t_ci"][0] < 0 < 4.4 < level["t_ci"][1]
    assert st.seed_level_text(row, "+.2f") == "[-0.48, +4.48] (3+ 0−)"


def test_seed_level_needs_paired_seeds_and_finite_numbers():
    a, b = shared_structure()
    unpaired = st.difference(st.ArmSample.of(b), st.ArmSample.of(a), 100,
                             np.random.default_rng(0), paired=False)  # fmt: skip
    assert unpaired["seed_level"] is None and st.seed_level_text(unpaired) == "n/a"
    one = st.seed_level([0.5])
    assert (
        one["t_ci"] is None and one["n"] == 1 and st.seed_level_text({"seed_level": one}) == "n/a"
    )
    hostile = ([], [1.0, float("nan")], [1.0, float("inf")], [[1.0, 2.0]], ["a", "b"], None,
               [1e308, 1e308], [1e308, -1e308])  # fmt: skip
    for bad in hostile:
        with pytest.raises(ValueError, match="finite number per training seed") as info:
            st.seed_level(bad)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("n_boot", [0, -3])
def test_a_bootstrap_of_no_replicates_is_refused(n_boot):
    arm = st.ArmSample.of(np.ones((2, 3)))
    with pytest.raises(st.LongctxError, match=f"--bootstrap {n_boot}; expected a count"):
        st.bootstrap(arm, n_boot, np.random.default_rng(0))
