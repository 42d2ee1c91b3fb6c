"""Rollouts for online RL (issue 38, docs/grpo.md): a batched sampler over transformers' own modules with the
training weights, resident on the device or streamed layer by layer."""

from .params import Completions, SamplingParams, restore_sampler_rng, sampler_rng_state
from .sampler import Sampler
from .weights import DictWeights, StoreWeights, WeightSource

__all__ = ["Completions", "DictWeights", "Sampler", "SamplingParams", "StoreWeights", "WeightSource",
           "restore_sampler_rng", "sampler_rng_state"]
