"""bench/device_call.sh, the runner of the GPU device calls, on this machine (no GPU, no wheels): run_logged's
status lines and exit status, and run_detached, which carries a run longer than one device command across calls of
the same script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def call(tmp_path: Path, script: str, wait_s: int) -> tuple[int, str, Path]:
    call_script = tmp_path / "call.sh"
    call_script.write_text(script)
    out = tmp_path / f"out{wait_s}"
    env = {**os.environ, "WHEELS": "", "OUT": str(out), "WAIT_S": str(wait_s), "POLL_S": "0.2",
           "DETACHED": str(tmp_path / "detached"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(ROOT / "bench" / "device_call.sh"), str(call_script)], env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr, out


def test_run_logged_records_each_exit_status(tmp_path):
    rc, text, out = call(tmp_path, "run_logged ok 10 true\nrun_logged bad 10 sh -c 'echo oops; exit 4'\n"
                                   "run_logged ok2 10 true\n", 5)
    status = (out / "status.txt").read_text().splitlines()
    assert status == ["ok rc=0", "bad rc=4", "ok2 rc=0"]
    assert (out / "bad.log").read_text() == "oops\n"
    assert rc == 1, text  # the script ended well, but a command run with run_logged failed
    assert (out / "run.sh").read_text().startswith("run_logged ok")


def test_run_detached_outlives_a_call_and_is_collected_by_the_next(tmp_path):
    script = ("detached_started long && echo 'already started'\n"
              "run_detached long sh -c 'echo started; sleep 3; echo finished; exit 3'\n")
    rc, text, out = call(tmp_path, script, 1)  # this call's deadline comes first: the run goes on
    assert rc == 0, text
    assert "rc: running" in text and "already started" not in text
    assert (out / "status.txt").read_text().startswith("long launched (setsid")
    assert "started" in (out / "long.log").read_text()
    rc, text, out2 = call(tmp_path, script, 30)  # the same script again: waits for the run, does not restart it
    assert "already started" in text
    assert (out2 / "status.txt").read_text().splitlines() == ["long rc=3"]
    assert (out2 / "long.log").read_text() == "started\nfinished\n"
    assert rc == 3, text


def test_detached_done_and_bundle_results(tmp_path):
    """detached_done: only once this call has seen the run end; bundle_results: a folder's logs and JSONs in one
    tarball (a device command brings back at most 8 files)."""
    import tarfile

    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("a.log", "b.json", "c.txt"):
        (runs / name).write_text(name)
    script = ("detached_done quick && echo 'done before'\n"
              "run_detached quick sh -c 'exit 0'\n"
              f"detached_done quick && bundle_results quick_runs {runs} && echo bundled\n")
    rc, text, out = call(tmp_path, script, 30)
    assert rc == 0, text
    assert "done before" not in text and "bundled" in text
    with tarfile.open(out / "quick_runs.tar.gz") as t:
        assert sorted(t.getnames()) == ["a.log", "b.json"]

