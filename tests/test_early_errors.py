"""The mistakes a user makes first are answered before torch is imported (seconds on a GPU host): a config key that
does not exist, a data file that is not there. One line naming the culprit, exit status 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CODE = """
import sys
from megatrain.cli import main
rc = main(sys.argv[1:])
print("rc", rc, "torch" in sys.modules, "datasets" in sys.modules)
"""


def _train(tmp_path, *overrides) -> tuple[str, str]:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tmp_path / 'model'}, init: random}}\n"
                   f"data: {{path: {tmp_path / 'data.jsonl'}}}\n"
                   f"output: {{dir: {tmp_path / 'out'}}}\n")
    p = subprocess.run([sys.executable, "-c", CODE, "train", str(cfg), *overrides], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1], p.stderr.strip()


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "megatrain: error: command line: train.stepz: unknown key; did you mean 'train.steps'?"),
    (None, "megatrain: error: data.path: {tmp}/data.jsonl does not exist"),
])
def test_answered_before_torch_is_imported(tmp_path, override, message):
    out, err = _train(tmp_path, *([override] if override else []))
    assert out == "rc 2 False False", (out, err)
    assert err == message.format(tmp=tmp_path)
    assert not (tmp_path / "out").exists()
