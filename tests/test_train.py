"""Smoke test of `python -m entmax_fast.train` on a tiny configuration (seconds): the task
generator, the table, determinism, the heat-map PNGs (matplotlib and the zlib fallback)."""
import builtins
import struct
import zlib

import pytest
import torch

from entmax_fast import train

TINY = ["--steps", "3", "--pairs", "4", "--queries", "2", "--keys", "8", "--values", "4", "--d-model", "8",
        "--heads", "2", "--layers", "1", "--batch", "4", "--eval-batch", "8", "--long-pairs", "7",
        "--no-progress"]


def test_recall_batch_targets_are_the_queried_values():
    config = train.Config(pairs=6, queries=3, keys=10, values=5)
    keys, values, query_keys, targets = train.recall_batch(config, 16, torch.Generator().manual_seed(0))
    assert keys.shape == values.shape == (16, 6) and query_keys.shape == targets.shape == (16, 3)
    for b in range(16):
        assert len(set(keys[b].tolist())) == 6  # distinct keys: every query has one answer
        lookup = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert [lookup[k] for k in query_keys[b].tolist()] == targets[b].tolist()


def _read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(data):
        length, = struct.unpack(">I", data[position:position + 4])
        tag = data[position + 4:position + 8]
        body = data[position + 8:position + 8 + length]
        crc, = struct.unpack(">I", data[position + 8 + length:position + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        chunks[tag] = chunks.get(tag, b"") + body
        position += 12 + length
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    return width, height, chunks


def test_main_tiny_run_is_deterministic_and_writes_heatmaps(tmp_path, capsys):
    first = train.main(TINY + ["--out", str(tmp_path / "a")])
    second = train.main(TINY + ["--out", str(tmp_path / "b")])
    printed = capsys.readouterr().out
    assert [r["attention"] for r in first["rows"]] == ["softmax", "sparsemax", "entmax15", "learned"]
    assert "wall time" in printed and "mean support" in printed and "accuracy @7 pairs" in printed
    without_timing = lambda rows: [{k: v for k, v in r.items() if k != "ms/step"} for r in rows]  # noqa: E731
    assert without_timing(first["rows"]) == without_timing(second["rows"])
    for label, r in first["results"].items():
        assert r["loss"] == second["results"][label]["loss"] and r["alpha"] == second["results"][label]["alpha"]
        assert all(torch.equal(a, b) for a, b in zip(r["example_weights"], second["results"][label]["example_weights"]))
    results = first["results"]
    sequence = 4 + 2
    assert torch.all(results["softmax"]["support"] == sequence)
    assert torch.all(results["sparsemax"]["support"] <= sequence)
    learned_alpha = torch.tensor(results["learned"]["alpha"])
    assert torch.all((learned_alpha >= 1.01) & (learned_alpha <= 2.0))
    for r in results.values():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0
    try:
        import matplotlib  # noqa: F401
        expected_files = 1  # one figure, every kind
    except ImportError:
        expected_files = 4  # the zlib fallback writes one grey PNG per kind
    assert len(first["heatmaps"]) == expected_files
    for path in first["heatmaps"]:
        width, height, _ = _read_png(path)
        assert width > 40 and height > 40


def test_heatmaps_without_matplotlib(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib in this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = train.main(TINY + ["--attention", "sparsemax", "1.5", "--out", str(tmp_path)])
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert len(result["heatmaps"]) == 2
    weights = result["results"]["sparsemax"]["example_weights"][-1]  # (heads, L, L)
    heads, length = weights.shape[0], weights.shape[-1]
    width, height, chunks = _read_png(result["heatmaps"][0])
    assert (width, height) == (8 * heads * (length + 1), 8 * length)
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + width)
    first_row = list(pixels[1:1 + 8 * length:8])  # row 0 of head 0, one sample per weight
    expected = [round((1 - w) * 255) for w in weights[0, 0].tolist()]
    assert first_row == expected


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--keys", "3", "--pairs", "4"], "--keys must be >= --pairs", id="keys"),
    pytest.param(["--keys", "30", "--long-pairs", "40"], "--keys must be >= --long-pairs", id="long_pairs"),
    pytest.param(["--queries", "5", "--pairs", "4"], "--queries must be <= --pairs", id="queries"),
    pytest.param(["--d-model", "10", "--heads", "4"], "--d-model must be divisible", id="heads"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err


def test_progress_without_tqdm(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm in this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    progress = train._Progress(20, "sparsemax")
    for step in range(20):
        progress.update(f"loss {step}")
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"sparsemax: {n}/20 loss {n - 1}" for n in range(2, 21, 2)]
