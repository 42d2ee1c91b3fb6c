"""Checks on a config beyond its schema: a YAML document's size before it is built, `~` in paths, and the folders
a run writes against the paths it reads.

- An alias bomb (a few lines of YAML whose aliases expand to billions of values) is refused in time linear in the
  file, before it is built.
- `~` is expanded once, when the config is validated, in every path the run reads or writes, so that the checks
  and the writes see the same folder (never one named `~` in the working directory).
- No folder the run writes is, holds or lies inside a path it reads.
- train.objective and the data agree: a preference objective trains on preference pairs and pairs need one; the
  reference keys belong to the objectives with a reference (dpo, ipo); grpo trains on prompts and prompts need it,
  with rewards, room for a prompt beside grpo.max_new_tokens and a rollout batch of whole optimizer steps, and
  without held-out data (grpo evaluates nothing but train.exact_match_path).
- No key is set that the objective never reads (preference.beta with orpo, grpo.* with dpo, ...): the run would
  silently train something other than what the user asked. A key left at its default value is not a choice.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import MegatrainError, user_path

MAX_CONFIG_NODES = 100_000  # values after aliases are expanded: a real config has hundreds
MAX_CONFIG_DEPTH = 64


class TooLarge(yaml.YAMLError):
    """A YAML document whose value would be too large or too deep to build."""


def check_yaml_size(node) -> None:
    """Count the values a composed YAML document expands to (an aliased node counts at each use, but is measured
    once), and refuse one of more than MAX_CONFIG_NODES values or MAX_CONFIG_DEPTH levels."""
    sizes: dict[int, int] = {}

    def size(n, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise TooLarge(f"nested deeper than {MAX_CONFIG_DEPTH} levels")
        if id(n) in sizes:
            return sizes[id(n)]
        children = [c for kv in n.value for c in kv] if isinstance(n, yaml.MappingNode) else \
            n.value if isinstance(n, yaml.SequenceNode) else []
        total = 1
        for c in children:
            total += size(c, depth + 1)
            if total > MAX_CONFIG_NODES:
                raise TooLarge(f"expands to more than {MAX_CONFIG_NODES:,} values (aliases repeat what they name); "
                               f"a config needs far fewer")
        sizes[id(n)] = total
        return total

    size(node, 0)


def expand_home(cfg) -> None:
    """Expand a leading `~` in every path field of a validated `megatrain.config.Config`, in place."""

    d = cfg.data
    fields = [("model.path", cfg.model, "path"), ("model.tokenizer", cfg.model, "tokenizer"),
              ("train.exact_match_path", cfg.train, "exact_match_path"), ("output.dir", cfg.output, "dir"),
              ("preference.reference_path", cfg.preference, "reference_path"), ("export.dir", cfg.export, "dir"),
              ("memory.disk_path", cfg.memory, "disk_path"), ("plan.profile", cfg.plan, "profile"),
              ("data.path", d, "path"), ("data.eval_path", d, "eval_path"), ("data.dataset_info", d, "dataset_info"),
              ("data.cache_dir", d, "cache_dir"),
              *((f"data.datasets[{i}].path", e, "path") for i, e in enumerate(d.datasets or [])),
              *((f"data.eval_datasets[{i}].path", e, "path") for i, e in enumerate(d.eval_datasets or []))]
    if d.chat_template and "{" not in d.chat_template:  # a file, not the template itself
        fields.append(("data.chat_template", d, "chat_template"))
    if cfg.resume != "auto":
        fields.append(("resume", cfg, "resume"))
    for name, obj, key in fields:
        v = getattr(obj, key)
        if isinstance(v, str) and v:  # (no re-validation: the value's type is unchanged)
            p = user_path(v, name)
            object.__setattr__(obj, key, str(p) if v.startswith("~") else v)


def check_overlaps(cfg) -> None:
    """Of a `megatrain.config.Config`: no folder the run writes is, holds or lies inside a path it reads (writing
    there would replace the model, its tokenizer or the data), and an export never goes among output.dir's
    checkpoints (a later save's clean-up would take it). MegatrainError naming both keys."""
    d = cfg.data
    inputs = [("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer),
              ("train.exact_match_path", cfg.train.exact_match_path), ("data.path", d.path),
              ("preference.reference_path", cfg.preference.reference_path),
              ("data.eval_path", d.eval_path), ("data.dataset_info", d.dataset_info),
              *((f"data.datasets[{i}].path", e.path) for i, e in enumerate(d.datasets or [])),
              *((f"data.eval_datasets[{i}].path", e.path) for i, e in enumerate(d.eval_datasets or []))]
    out = Path(cfg.output.dir).resolve()
    outputs = [("output.dir", out)]
    if cfg.export.at_end:
        export = Path(cfg.export.dir).resolve() if cfg.export.dir else out / "export"
        outputs.append(("export.dir", export))
        ckpts = out / "checkpoints"
        if export == ckpts or ckpts in export.parents:
            raise MegatrainError(f"export.dir: {export} lies inside output.dir's checkpoints folder, where saves "
                                 f"replace and remove folders; choose a folder outside {ckpts}")
        if export == out or export in out.parents:  # the export replaces its folder whole, at the end of the run
            raise MegatrainError(f"export.dir: {export} {'is' if export == out else 'holds'} output.dir ({out}); the "
                                 f"export would replace the run's folder: choose a folder beside it, or leave "
                                 f"export.dir unset ({out / 'export'})")
    if d.cache_dir:  # the tokenised data is written there while the inputs are still being checked
        cache = Path(d.cache_dir).resolve()
        kept = [(k, o, "the run's own files") for k, o in outputs]
        kept += [(k, Path(v).resolve(), "the model") for k, v in (("model.path", cfg.model.path),
                                                                  ("model.tokenizer", cfg.model.tokenizer)) if v]
        for okey, o, what in kept:
            if cache == o or o in cache.parents:
                raise MegatrainError(f"data.cache_dir: {cache} {'is' if cache == o else 'lies inside'} {okey} ({o}), "
                                     f"which holds {what} alone; choose a cache folder outside it")
    for okey, o in outputs:
        for ikey, value in inputs:
            if not value:
                continue
            i = Path(value).resolve()
            if o == i or o in i.parents or i in o.parents:
                how = "is" if o == i else ("holds" if o in i.parents else "lies inside")
                raise MegatrainError(f"{okey}: {o} {how} {ikey} ({i}): the run would write over what it reads; "
                                     f"choose an {okey} that does not overlap its inputs")


REFERENCE_OBJECTIVES = ("dpo", "ipo")  # the objectives whose loss holds the reference model's log-probs
ROW_OBJECTIVES = ("sft", "grpo")  # the objectives that do not train on preference pairs


def objective_problems(cfg, pairs: bool, prompts: bool = False) -> list[tuple[tuple, str]]:
    """Of a validated `megatrain.config.Config` whose data is preference pairs or not (`pairs`:
    megatrain.data.is_preference) and prompts or not (`prompts`: megatrain.data.is_prompt): (the key's path, one line)
    for each disagreement between train.objective, the data, the preference section and the grpo section (none: an
    empty list)."""
    t, p, out = cfg.train, cfg.preference, []
    if t.objective not in ROW_OBJECTIVES and not pairs:
        out.append((("train", "objective"), f"train.objective: {t.objective} trains on preference pairs (prompt, "
                    f"chosen, rejected), but data.format is '{cfg.data.format}'; set data.format: preference (or a "
                    f"dataset_info.json entry with \"ranking\": true), or train.objective: sft"))
    if t.objective == "sft" and pairs:
        out.append((("data", "format"), "data: preference pairs (prompt, chosen, rejected) need a preference "
                                        "objective; set train.objective: dpo, ipo, simpo or orpo"))
    for key, unset in (("reference", "auto"), ("reference_path", None)):
        if getattr(p, key) != unset and t.objective not in REFERENCE_OBJECTIVES:
            whose = ("grpo's KL reference (grpo.beta) is the policy at step 0" if t.objective == "grpo" else
                     f"train.objective {t.objective} has none")
            out.append((("preference", key), f"preference.{key}: only dpo and ipo have a reference model of this "
                                             f"section; {whose}: remove the key"))
    if t.objective == "grpo" or prompts:
        out += grpo_problems(cfg, prompts)
    return out + unread_problems(cfg, pairs, prompts)


# the preference keys each objective reads (runtime/objective.py's pair_loss; the reference: run/reference.py)
PREFERENCE_KEYS = {"dpo": ("beta", "label_smoothing", "reference", "reference_path"),
                   "ipo": ("beta", "reference", "reference_path"),
                   "simpo": ("beta", "simpo_gamma", "label_smoothing"),
                   "orpo": ("orpo_lambda",)}
PREFERENCE_ROLES = {"beta": "the preference loss's beta", "label_smoothing": "dpo and simpo's label smoothing",
                    "simpo_gamma": "simpo's target margin", "orpo_lambda": "orpo's weight of the odds-ratio term"}


def set_keys(section) -> list[str]:
    """The keys of a config section (a pydantic model) that the user wrote (model_fields_set) with a value other
    than the default, in the schema's order."""
    fields = type(section).model_fields
    return [k for k in fields if k in section.model_fields_set
            and getattr(section, k) != fields[k].get_default(call_default_factory=True)]


def unread_problems(cfg, pairs: bool, prompts: bool) -> list[tuple[tuple, str]]:
    """(the key's path, one line) for each key of the preference and grpo sections that train.objective never
    reads. Skipped where the objective and the data disagree (the objective is then likely the mistake, said once
    by objective_problems), and for the reference keys, which objective_problems names with why."""
    obj, out = cfg.train.objective, []
    reads = PREFERENCE_KEYS.get(obj)
    if reads is not None or not pairs:
        for key in set_keys(cfg.preference):
            if reads is None:
                if key in ("reference", "reference_path"):
                    continue
                hint = ", grpo's KL weight is grpo.beta" if key == "beta" and obj == "grpo" else ""
                out.append((("preference", key), f"preference.{key}: the preference section is read by dpo, ipo, "
                                                 f"simpo and orpo only, not train.objective {obj}{hint}; remove it"))
            elif key not in reads and key not in ("reference", "reference_path"):
                if obj == "orpo" and key == "beta":
                    why = ("orpo does not read it: orpo's weight of the odds-ratio term (TRL's ORPOConfig.beta, the "
                           "paper's lambda) is preference.orpo_lambda")
                else:
                    why = (f"{PREFERENCE_ROLES[key]}, which train.objective {obj} does not read (it reads "
                           f"{', '.join('preference.' + k for k in reads if k in PREFERENCE_ROLES)})")
                out.append((("preference", key), f"preference.{key}: {why}; remove it"))
    if obj != "grpo" and not prompts:
        for key in set_keys(cfg.grpo):
            hint = " (the preference objectives' beta is preference.beta)" if key == "beta" and reads else ""
            out.append((("grpo", key), f"grpo.{key}: the grpo section is read by train.objective grpo only, not "
                                       f"{obj}{hint}; remove it"))
    return out


def grpo_problems(cfg, prompts: bool) -> list[tuple[tuple, str]]:
    """The disagreements of train.objective grpo with its data, batch and grpo section (or of prompt data with
    another objective): (the key's path, one line) each."""
    t, d, g, out = cfg.train, cfg.data, cfg.grpo, []
    if t.objective != "grpo":
        return [(("data", "format"), f"data: prompts (data.format prompt: rows without a completion) train with "
                                     f"train.objective: grpo, not {t.objective}")]
    if not prompts:
        out.append((("train", "objective"), f"train.objective: grpo samples completions for prompts, but "
                                            f"data.format is '{d.format}'; set data.format: prompt (rows "
                                            f"{{\"prompt\": ...}} or {{\"messages\": [...]}})"))
    if not g.rewards:
        out.append((("grpo", "rewards"), "grpo.rewards: give one or more rewards (exact_match, regex, numeric, or "
                                         "path.py:function), e.g. [{name: exact_match, field: answer}]"))
    if g.max_new_tokens >= d.max_seq_len:
        out.append((("grpo", "max_new_tokens"), f"grpo.max_new_tokens: {g.max_new_tokens} leaves no room for a "
                                                f"prompt in data.max_seq_len={d.max_seq_len} (prompt + completion); "
                                                f"raise data.max_seq_len or lower grpo.max_new_tokens"))
    if problem := batch_problem(cfg):
        out.append((("grpo", "prompts_per_rollout"), problem))
    if d.packing:
        out.append((("data", "packing"), "data.packing: grpo's rows (a prompt and one completion) are right-padded, "
                                         "not packed; set data.packing: false"))
    if d.train_on_prompt:
        out.append((("data", "train_on_prompt"), "data.train_on_prompt: grpo's loss is on the sampled completions "
                                                 "only; set data.train_on_prompt: false"))
    # grpo evaluates no held-out prompts (docs/grpo.md): held-out rows would be taken from training and never used
    for key, given in (("eval_fraction", d.eval_fraction > 0), ("eval_path", bool(d.eval_path)),
                       ("eval_datasets", bool(d.eval_datasets))):
        if given:
            out.append((("data", key), f"data.{key}: grpo evaluates no held-out prompts (only "
                                       f"train.exact_match_path's greedy answers), so they would never be used"
                                       + (", and are taken from the training prompts" if key == "eval_fraction"
                                          else "") + "; remove it"))
    if t.eval_every and not t.exact_match_path:
        out.append((("train", "eval_every"), f"train.eval_every: {t.eval_every}, but grpo evaluates only "
                                             f"train.exact_match_path's greedy answers, which is not set; remove it "
                                             f"or set train.exact_match_path"))
    return out


def batch_problem(cfg, world: int = 1) -> str | None:
    """Why a rollout batch (grpo.prompts_per_rollout x grpo.num_generations completions) does not split into whole
    optimizer steps of train.micro_batch_size x train.grad_accum_steps completions on each of `world` ranks, or
    its prompts between the ranks (None: it does)."""
    t, g = cfg.train, cfg.grpo
    step = t.micro_batch_size * t.grad_accum_steps * world
    n = g.prompts_per_rollout * g.num_generations
    ranks = f" x {world} ranks" if world > 1 else ""
    if n % step:
        return (f"grpo.prompts_per_rollout: a rollout batch of {g.prompts_per_rollout} x {g.num_generations} = {n} "
                f"completions does not split into optimizer steps of train.micro_batch_size x "
                f"train.grad_accum_steps{ranks} = {step} completions; make it a multiple")
    if g.prompts_per_rollout % world:
        return (f"grpo.prompts_per_rollout: {g.prompts_per_rollout} prompts do not split between {world} ranks; "
                f"make it a multiple of {world}")
    return None


def key_name(loc: tuple) -> str:
    """('data', 'datasets', 0, 'weight') -> 'data.datasets[0].weight'."""
    out = ""
    for k in loc:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out

