"""Resource bounds before any work (issue 33): a count in config.json or the config that used to make start-up grow
memory with no output is refused first, in one line naming the key and its bound, with nothing written. The
bounds are structural or against this machine, never a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain.cli import main
from megatrain.errors import MegatrainError
from test_inputs import error_of, setup, write_config  # noqa: F401  (setup: a fixture)

PREFIX = "megatrain: error: "
ROOT = Path(__file__).resolve().parents[1]


def _edit_config(model_dir: Path, **keys) -> Path:
    c = json.loads((model_dir / "config.json").read_text())
    c.update(keys)
    (model_dir / "config.json").write_text(json.dumps(c))
    return model_dir / "config.json"


def _cli_in_a_box(argv, timeout=120):
    """`megatrain ARGV` in a child with 4 GiB of address space: a bound that is missing fails by memory or by the
    timeout, never by hanging the suite."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from megatrain.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_line(r) -> str:
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stderr.count(PREFIX) == 1, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1][len(PREFIX):]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_grad_accum_steps_of_a_billion(setup, command):
    """train.grad_accum_steps of 10^9: the planner listed every micro-batch (memory growing, no output)."""
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    msg = _one_line(_cli_in_a_box([command, cfg, "train.grad_accum_steps=1000000000"]))
    assert msg.startswith("train.grad_accum_steps: 1,000,000,000 micro-batches per step") and "16,384" in msg, msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "plan"])
def test_micro_batch_larger_than_the_device(setup, command):
    """micro_batch_size of 10^9: the planner traced a head of billions of tokens. A micro-batch's hidden states
    alone are more than the device holds: refused naming the key and the memory."""
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    msg = _one_line(_cli_in_a_box([command, cfg, "train.micro_batch_size=1000000000", "train.device=cpu"]))
    assert msg.startswith("train.micro_batch_size: 1,000,000,000 rows of data.max_seq_len 32 tokens") \
        and "host RAM" in msg, msg


def test_a_step_of_token_ids_larger_than_host_ram(setup):
    from megatrain.config import load_config
    from megatrain.run.bounds import check_batch

    tmp_path, model_dir, data = setup
    cfg = load_config(write_config(tmp_path, model_dir, data), ["train.grad_accum_steps=1000"])
    with pytest.raises(MegatrainError) as e:  # 2 x 32 tokens x 1000 micro-batches x 16 bytes = 1 MiB > 512 KiB
        check_batch(cfg, 16, 0, "", 512 * 1024)
    assert str(e.value).startswith("train.grad_accum_steps: a step of 1,000 micro-batches of 64 tokens"), str(e.value)
    check_batch(cfg, 16, 0, "", 2 * 2**20)  # within: no error


@pytest.mark.parametrize("command", ["train", "plan"])
def test_num_hidden_layers_of_ten_million(setup, command):
    """num_hidden_layers of 10^7 built objects for every layer (memory growing, no output): refused as config.json
    is read, before a layer is listed, naming the file and the key; through the command line, in a child."""
    tmp_path, model_dir, data = setup
    cfg_file = _edit_config(model_dir, num_hidden_layers=10**7)
    msg = _one_line(_cli_in_a_box([command, write_config(tmp_path, model_dir, data)]))
    assert msg.startswith(f"{cfg_file}: num_hidden_layers: 10,000,000 is more than megatrain handles "
                          f"(at most 4,096"), msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,value,bound", [("num_hidden_layers", 10**7, "4,096"), ("vocab_size", 10**12, "16,777,216"),
                                             ("hidden_size", 10**9, "16,777,216"),
                                             ("intermediate_size", 10**12, "16,777,216"),
                                             ("num_attention_heads", 10**8, "16,777,216")])
def test_model_dimension_beyond_the_bound(setup, key, value, bound):
    """The class: any size of config.json beyond its bound is refused as the file is read (what every command
    does first, before transformers builds the config or a layer is listed), naming the file and the key."""
    from megatrain.models import load_hf_config

    tmp_path, model_dir, data = setup
    cfg_file = _edit_config(model_dir, **{key: value})
    with pytest.raises(MegatrainError) as e:
        load_hf_config(model_dir)
    msg = str(e.value)
    assert msg.startswith(f"{cfg_file}: {key}: {value:,} is more than megatrain handles (at most {bound}"), msg


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 0), ("hidden_size", -4), ("vocab_size", 12.5),
                                       ("num_attention_heads", "4"), ("num_key_value_heads", True)])
def test_model_dimension_not_a_positive_whole_number(setup, key, value):
    tmp_path, model_dir, data = setup
    cfg_file = _edit_config(model_dir, **{key: value})
    msg = error_of(tmp_path, write_config(tmp_path, model_dir, data))
    assert msg.startswith(f"{cfg_file}: ") and key in msg, msg


@pytest.mark.parametrize("keys,culprit", [({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide "
                                                                        "num_attention_heads (4)"),
                                          ({"head_dim": None, "num_attention_heads": 6}, "num_attention_heads: 6 "
                                                                                        "does not divide hidden_size"),
                                          ({"head_dim": 31}, "head_dim: 31 is odd")])
def test_bad_head_count_is_an_input_error(setup, keys, culprit):
    """A bad head count failed inside attention at step 1, after output.dir was written: it is an input error,
    nothing written."""
    tmp_path, model_dir, data = setup
    c = json.loads((model_dir / "config.json").read_text())
    for k, v in keys.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (model_dir / "config.json").write_text(json.dumps(c))
    msg = error_of(tmp_path, write_config(tmp_path, model_dir, data))
    assert msg.startswith(f"{model_dir / 'config.json'}: {culprit}"), msg


def test_every_real_model_config_passes_the_bounds(tmp_path):
    """The bounds refuse nothing a released model has (every config the planner is benchmarked on)."""
    import shutil

    from megatrain.models import get_adapter, load_hf_config

    files = sorted((ROOT / "bench" / "model-configs").glob("*/config.json"))
    assert files
    for f in files:
        d = tmp_path / f.parent.name
        d.mkdir()
        shutil.copy(f, d / "config.json")
        get_adapter(load_hf_config(d))


# ---- a row's size before tokenising -----------------------------------------------------------------------------
def _long_row_setup(setup, monkeypatch, text: str, *overrides):
    """The examples of a data file with one row of `text` among short ones, every text the tokenizer was handed
    recorded."""
    import transformers

    from megatrain.config import load_config
    from megatrain.data import load_tokenizer
    from megatrain.data.examples import build_examples

    tmp_path, model_dir, data = setup
    data.write_text(data.read_text() + json.dumps({"text": text}) + "\n")
    cfg = load_config(write_config(tmp_path, model_dir, data), [f"data.cache_dir={tmp_path / 'cache'}",
                                                                "data.max_seq_len=64", *overrides])
    seen = []
    real = transformers.PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *a, **kw):
        seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return real(self, text, *a, **kw)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", spy)
    tok = load_tokenizer(model_dir)
    return tok, build_examples(cfg.data, tok), seen


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_huge_row_is_cut_before_tokenising(setup, monkeypatch, overlong):
    """A 50 MB row was tokenised whole (~23 GB) before truncation. It is now tokenised only as far as
    tokenizer.row_tokens tokens (this tokenizer: a character a token, so the first prefix tried holds them): the
    tokenizer never sees the rest; the cut is counted and reported; truncation and dropping decide as on the whole
    row."""
    from megatrain.data.preview import count_lines
    from megatrain.data.tokenizer import CHARS_PER_TOKEN_FIRST, row_tokens

    text = "hello world " * 400_000  # 4.8 MB
    tok, ex, seen = _long_row_setup(setup, monkeypatch, text, f"data.overlong={overlong}")
    bound = CHARS_PER_TOKEN_FIRST * row_tokens(64)
    assert seen and max(seen) <= bound < len(text) // 100, (max(seen), bound)
    c = ex.counts
    assert c.cut == 1 and c.cut_to == row_tokens(64) == 4096
    assert (c.truncated, c.dropped) == ((1, 0) if overlong == "truncate" else (0, 1))
    assert "1 rows tokenised only to their first 4,096 tokens" in "\n".join(count_lines(ex, 64))
    if overlong == "truncate":
        k = int(np.argmax(ex.lengths == 64))
        ids, _ = ex.get(k)
        assert ids.tolist() == tok(text[:2000])["input_ids"][:64]  # what truncating the whole row gave


def test_a_huge_row_is_split_in_pieces_none_lost(setup, monkeypatch):
    """data.overlong split keeps every token: the long row is tokenised in pieces, never whole."""
    from megatrain.data.tokenizer import CHARS_PER_TOKEN_FIRST, row_tokens

    text = "hello world " * 100_000
    tok, ex, seen = _long_row_setup(setup, monkeypatch, text, "data.overlong=split")
    assert max(seen) <= CHARS_PER_TOKEN_FIRST * row_tokens(64)
    assert ex.counts.cut == 0 and ex.counts.split == 1
    short = 8 * (len("hello world " * 3) + 1)  # the fixture's rows, one token a character and EOS
    assert int(ex.lengths.sum()) >= short + len(text) - 1
