"""docs/benchmarks.md is generated from the reference runs (bench/make_benchmarks_page.py): it must be what the
generator writes now, and every reference run's result.json must say what ran, where, at which revision and when."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from make_benchmarks_page import PAGE, page, problems  # noqa: E402
from refruns import REQUIRED, RESULTS, names  # noqa: E402


def test_the_page_is_what_the_generator_writes():
    assert PAGE.read_text() == page(), "docs/benchmarks.md is stale: run python3 bench/make_benchmarks_page.py"


def test_every_result_says_command_kind_revision_and_date():
    assert len(names()) >= 20
    for name in names():
        payload = json.loads((RESULTS / name / "result.json").read_text())
        for key in ("command", "kind", "revision", "date"):
            assert isinstance(payload.get(key), str) and payload[key].strip(), (name, key)
    assert problems() == []


def test_a_result_without_its_revision_is_reported(tmp_path, monkeypatch):
    import make_benchmarks_page
    import refruns  # the page reads through refruns, which finds the runs under RESULTS

    (tmp_path / "some-run").mkdir()
    payload = {k: "x" for k in REQUIRED}
    del payload["revision"]
    (tmp_path / "some-run" / "result.json").write_text(json.dumps(payload))
    monkeypatch.setattr(refruns, "RESULTS", tmp_path)
    assert make_benchmarks_page.problems() == ["some-run: no revision"]


def test_every_folder_under_results_is_a_reference_run():
    for folder in RESULTS.iterdir():
        assert (folder / "result.json").is_file(), folder
