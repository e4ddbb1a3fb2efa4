"""`hsx bench` smoke test on CPU (not a timing test): every run reports, and (c) writes real, loadable output."""

import json

import hsx
from hsx.cli import main


def test_bench_tiny_reports_all_runs_and_keeps_output(tmp_path, capsys):
    report, out = tmp_path / "bench.json", tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--count", "40", "--max-length", "256", "--subset-a", "6",
               "--subset-b", "40", "--json", str(report), "--output-dir", str(out), "--keep"])
    assert rc == 0
    r = json.loads(report.read_text())
    for run in ("a", "b", "c"):
        assert r[run]["tok_per_s"] > 0 and 0 < r[run]["mfu"] < 1, run
    c = r["c"]
    assert c["rows"] == 40 and c["tokens"] == r["tokens"]
    assert c["padding"] < r["b"]["padding"]  # length buckets vs dataset-order batches of 32
    assert 0 <= c["gpu_idle"] <= 1 and c["output_bytes"] > 0 and c["compile_warmup_seconds"] > 0
    assert r["c_over_a"] == c["tok_per_s"] / r["a"]["tok_per_s"]
    assert "| (c) hsx extract |" in capsys.readouterr().out
    assert len(hsx.load(str(out))) == 40  # the real Arrow output of (c)


def test_bench_deletes_its_temp_output_unless_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "--shape", "tiny", "--count", "20", "--max-length", "128", "--skip", "a,b"]) == 0
    assert not any(p.name.startswith("hsx-bench-") for p in tmp_path.iterdir())
