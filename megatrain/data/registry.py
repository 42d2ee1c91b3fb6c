"""LLaMA-Factory `dataset_info.json` registries: an entry -> the fields of a source (format, path, columns, roles).

An entry is checked as strictly as an inline `data.datasets` entry: a value of the wrong kind, a `formatting` other
than alpaca or sharegpt, a column or tag megatrain does not read, a `num_samples` that is not a whole number above 0
is one error naming the registry file, the entry and its key; nothing is read as something else silently.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MegatrainError, inside, load_json

REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
FORMATTINGS = ("alpaca", "sharegpt")
# the columns megatrain reads of each kind of entry (LLaMA-Factory's names); any other is refused, not ignored
COLUMNS = {("alpaca", False): ("prompt", "query", "response", "system", "history"),
           ("alpaca", True): ("prompt", "query", "chosen", "rejected", "system", "history", "tools"),
           ("sharegpt", False): ("messages", "system", "tools"),
           ("sharegpt", True): ("messages", "chosen", "rejected", "system", "tools")}
TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")


def load_registry(dataset_info: str) -> tuple[Path, dict]:
    """(the registry file, its entries) of `data.dataset_info` (a dataset_info.json or its folder)."""
    p = Path(dataset_info).expanduser()
    f = p / "dataset_info.json" if p.is_dir() else p
    if not f.is_file():
        raise MegatrainError(f"data.dataset_info: {f} does not exist")
    reg = load_json(f)
    if not isinstance(reg, dict):
        raise MegatrainError(f"{f}: expected a JSON object of dataset entries")
    return f, reg


def _names(entry: dict, key: str, allowed: tuple, where: str, what: str) -> dict:
    """entry[key] (columns or tags): absent or null -> {}; else an object of allowed keys -> non-empty strings."""
    v = entry.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise MegatrainError(f"{where}: {key}: expected an object, got {type(v).__name__}")
    for k, name in v.items():
        if k not in allowed:
            raise MegatrainError(f"{where}: {key}: '{k}' is not read by megatrain ({what}: {', '.join(allowed)})")
        if not isinstance(name, str) or not name:
            raise MegatrainError(f"{where}: {key}.{k}: expected a {'column' if key == 'columns' else 'tag'} name (a "
                                 f"non-empty string), got {name!r}")
    return v


def _checked(entry, where: str) -> tuple[str, bool, dict, dict]:
    """(formatting, ranking, columns, tags) of an entry, each checked (see the module docstring)."""
    if not isinstance(entry, dict):
        raise MegatrainError(f"{where}: expected an object")
    remote = [k for k in REMOTE_KEYS if k in entry]
    if "file_name" not in entry:
        what = f" ({remote[0]})" if remote else ""
        raise MegatrainError(f"{where}: has no local file_name{what}; megatrain reads local data only")
    if entry.get("load_from", "file") != "file":
        raise MegatrainError(f"{where}: load_from '{entry['load_from']}' is not supported (local files only)")
    fmt = entry.get("formatting", "alpaca")
    if fmt not in FORMATTINGS:
        raise MegatrainError(f"{where}: formatting: {fmt!r} is not one of {', '.join(FORMATTINGS)}")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise MegatrainError(f"{where}: ranking: expected true or false, got {ranking!r}")
    kind = f"{'a ranking' if ranking else 'an'} {fmt} entry's columns"
    cols = _names(entry, "columns", COLUMNS[fmt, ranking], where, kind)
    tags = _names(entry, "tags", TAGS, where, "its tags")
    if tags and fmt != "sharegpt":
        raise MegatrainError(f"{where}: tags: are read for sharegpt entries only (formatting: sharegpt)")
    if "split" in entry and not (isinstance(entry["split"], str) and entry["split"]):
        raise MegatrainError(f"{where}: split: expected a split name (a non-empty string), got {entry['split']!r}")
    n = entry.get("num_samples")
    if "num_samples" in entry and not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        raise MegatrainError(f"{where}: num_samples: expected a whole number above 0, got {n!r}")
    return fmt, ranking, cols, tags


def from_registry(reg_file: Path, entry, name: str) -> dict:
    """A LLaMA-Factory dataset_info.json entry -> our source fields (format, path, columns, roles, ...)."""
    where = f"{reg_file}: dataset '{name}'"
    fmt, ranking, cols, tags = _checked(entry, where)
    # a registry names files in its own folder, as LLaMA-Factory's data/ does: never one outside it
    out: dict = {"path": str(inside(reg_file.parent, entry["file_name"], f"{where}: file_name"))}
    if ranking:  # preference pairs (preference.py): chosen and rejected beside the prompt
        out.update(_ranking(cols, tags, fmt == "sharegpt"))
    elif fmt == "sharegpt":
        out["format"] = "sharegpt"
        out["columns"] = {k: cols[k] for k in ("messages", "system", "tools") if k in cols}
        for lf, ours in (("role_tag", "role"), ("content_tag", "content")):
            if lf in tags:
                out["columns"][ours] = tags[lf]
        out["roles"] = _tag_roles(tags)
    elif "prompt" in cols and "response" not in cols and "query" not in cols:
        out["format"], out["columns"] = "text", {"text": cols["prompt"]}  # LLaMA-Factory's pretraining entries
    else:
        out["format"] = "alpaca"
        names = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                 "history": "history"}
        out["columns"] = {names[k]: v for k, v in cols.items() if k in names}
    if "split" in entry:
        out["split"] = entry["split"]
    if "num_samples" in entry:
        out["num_samples"] = entry["num_samples"]
    return out


def _ranking(cols: dict, tags: dict, sharegpt: bool) -> dict:
    """A LLaMA-Factory ranking entry -> format 'preference': the prompt is the conversation (sharegpt layout; chosen
    and rejected are message objects) or the instruction with its input (alpaca layout; chosen, rejected strings)."""
    ours = {"chosen": cols.get("chosen", "chosen"), "rejected": cols.get("rejected", "rejected")}
    ours.update({k: cols[k] for k in ("system", "tools") if k in cols})
    if not sharegpt:
        ours.update(prompt=cols.get("prompt", "instruction"), input=cols.get("query", "input"))
        if "history" in cols:
            ours["history"] = cols["history"]
        return {"format": "preference", "columns": ours}
    ours.update(prompt=cols.get("messages", "conversations"), role=tags.get("role_tag", "from"),
                content=tags.get("content_tag", "value"))
    return {"format": "preference", "columns": ours, "roles": _tag_roles(tags)}


def as_prompts(fields: dict) -> dict:
    """A registry entry read as prompts (data.format prompt, train.objective grpo): its prompt side, the user turn of
    an alpaca entry (instruction and input, with system and history), the conversation of a sharegpt entry (its last
    assistant turn dropped), the text of a pretraining entry; the row's other columns stay for the rewards."""
    cols, fmt = fields.get("columns", {}), fields["format"]
    if fmt == "alpaca":
        ours = {"prompt": cols.get("instruction", "instruction"), "input": cols.get("input", "input")}
        ours.update({k: cols[k] for k in ("system", "history") if k in cols})
    elif fmt == "sharegpt":
        ours = {"messages": cols.get("messages", "conversations"), "role": cols.get("role", "from"),
                "content": cols.get("content", "value"), **{k: cols[k] for k in ("system", "tools") if k in cols}}
    elif fmt == "text":
        ours = {"prompt": cols["text"]}
    else:  # a ranking entry: its prompt columns are the prompt format's own
        ours = {k: v for k, v in cols.items() if k not in ("chosen", "rejected")}
    return {**fields, "format": "prompt", "columns": ours}


def _tag_roles(tags: dict) -> dict[str, str]:
    """LLaMA-Factory's role tags (sharegpt layout) -> data role name -> canonical role."""
    return {tags[lf]: r for lf, r in (("user_tag", "user"), ("assistant_tag", "assistant"), ("observation_tag", "tool"),
                                      ("function_tag", "assistant"), ("system_tag", "system")) if lf in tags}
