"""Online RL (train.objective grpo): the grpo config section and the rewards.

    config.py    GRPOConfig, RewardSpec: the `grpo:` section (megatrain.config.Config.grpo); Section, the base of every
                 config section (unknown keys, nan and booleans refused), here because rl is the leaf every
                 module that defines a section may import (docs/design.md's layout)
    rewards.py   load_rewards(specs, base_dir) -> [Reward]; score(rewards, prompts, completions, rows) ->
                 (total [N], {name: [N]}); the built-ins exact_match, regex, numeric; numeric_answer(text)
The prompts are data (megatrain/data/prompts.py); the sampler is megatrain/rollout; the loss runtime/objective.py.
"""

from .config import BUILTIN_REWARDS, GRPOConfig, RewardSpec

_REWARDS = ("Reward", "load_rewards", "numeric_answer", "row_problem", "score")


def __getattr__(name: str):
    """rewards.py's names, imported when first used: it imports torch, which the config (megatrain.config reads the
    grpo section from .config) does not need, so a config is read and checked without it."""
    if name in _REWARDS:
        from . import rewards

        return getattr(rewards, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["BUILTIN_REWARDS", "GRPOConfig", "Reward", "RewardSpec", "load_rewards", "numeric_answer", "row_problem",
           "score"]
