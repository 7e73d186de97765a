"""examples/chain_study.py on a few rows: it prints its table, writes its figure, and the
chain prior does what the study reports (fewer separate runs of selected keys than 1.5-entmax
and than SparseMAP without transitions; exact zeros and ones)."""
from test_tools import load_script


def test_chain_study_runs(tmp_path):
    example = load_script("examples/chain_study.py")
    results = {row["mapping"]: row for row in example.main(["--rows", "150", "--out", str(tmp_path)])}
    assert (tmp_path / "chain_study.png").exists()
    chain = results["SparseMAP, chain T (c = 0.5)"]
    assert chain["runs"] < results["1.5-entmax"]["runs"]
    assert chain["runs"] < results["SparseMAP, T = 0 (clip)"]["runs"]
    assert chain["exact 0"] > 0.5 and results["SparseMAP, T = 0 (clip)"]["exact 1"] > 0
    assert results["CRF, chain T (c = 0.5)"]["exact 0"] == 0  # dense: every key gets a weight
