"""A sweep job's folder name: Hydra's override_dirname, kept under a file name's limit."""

from longctx.runs.folder import NAME_MAX, sweep_subdir


def test_a_short_name_is_hydras_own():
    assert sweep_subdir("data.seq_len=256,seed=0") == "data.seq_len=256,seed=0"
    assert sweep_subdir("") == ""


def test_a_long_name_fits_and_stays_apart_from_its_neighbours():
    head = ",".join(f"callbacks.ruler.tasks=[passkey,niah_single,copy{i}]" for i in range(6))
    a, b = sweep_subdir(head + ",seed=0"), sweep_subdir(head + ",seed=1")
    assert len(a.encode()) <= NAME_MAX and len(b.encode()) <= NAME_MAX
    assert a != b and a.startswith(head[:100])
    assert sweep_subdir(head + ",seed=0") == a  # a resumed job finds its folder again


def test_a_cut_never_splits_a_character():
    name = "data.name=" + "é" * 200
    assert sweep_subdir(name).encode().decode() == sweep_subdir(name)
    assert len(sweep_subdir(name).encode()) <= NAME_MAX
