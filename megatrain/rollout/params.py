"""What a rollout asks for (SamplingParams), what it returns (Completions), the token draw, and the sampler's RNG
state as a checkpoint holds it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: completion tokens at most; temperature > 0 divides the logits; top_p in (0, 1]: the smallest
    set of tokens whose probability reaches it (1: off); top_k: the k most likely tokens (0: off; top_k=1 is greedy);
    n: completions per prompt; stop: strings that end a completion (the string kept); eos_token_ids: tokens that end
    it (kept); seed: the generator's seed when generate() is given none. A bad value: ValueError naming the field."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        def integer(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"SamplingParams.{name}: {v!r} is not an integer >= {lo}")

        integer("max_new_tokens", 1)
        integer("top_k", 0)
        integer("n", 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed: {self.seed!r} is not an integer")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"SamplingParams.temperature: {t!r} is not a number > 0 (top_k=1 is greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p: {p!r} is not in (0, 1]")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop: {self.stop!r} is not a list of non-empty strings")
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in self.eos_token_ids):
            raise ValueError(f"SamplingParams.eos_token_ids: {self.eos_token_ids!r} is not a list of token ids")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


@dataclass
class Completions:
    """N = prompts x n completions, grouped by prompt (prompt 0's n first). completion_ids: EOS kept when it ended on
    EOS, cut after a stop string's last token; logprobs: the sampling policy's log-prob of each token (log_softmax of
    its logits divided by the temperature, before top-k and top-p); finished: ended on EOS or a stop string (False:
    hit max_new_tokens)."""

    prompt_index: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    stats: dict = field(default_factory=dict)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits [B, V] (fp32) the token is drawn from, as transformers' warpers make them in this order:
    divided by the temperature, then all but the top_k set to -inf, then all outside the top_p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p; at least one kept)."""
    x = logits / params.temperature if params.temperature != 1.0 else logits
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob under the logits divided by the temperature [B], before top-k and top-p: the
    policy that GRPO's loss differentiates, as TRL's) for logits [B, V]: greedy (top_k=1) takes the argmax (the first
    on ties, as generate) and draws nothing; else one multinomial draw per row from the filtered softmax."""
    logits = logits.float()
    if params.greedy:
        tok = logits.argmax(-1)
    else:
        probs = filtered_logits(logits, params).softmax(-1)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = torch.log_softmax(scaled, -1).gather(-1, tok[:, None]).squeeze(-1)
    return tok, logp


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    dev = torch.device(device)
    return torch.Generator(device=dev).manual_seed(seed)


def sampler_rng_state(generator: torch.Generator) -> dict:
    """The generator's state as a checkpoint keeps it: {"device": str, "state": uint8 CPU tensor}."""
    return {"device": str(generator.device), "state": generator.get_state().clone()}


def restore_sampler_rng(state: dict, generator: torch.Generator | None = None) -> torch.Generator:
    """A generator (the one given, or a new one on the state's device) set to `state` (sampler_rng_state's)."""
    g = generator or torch.Generator(device=torch.device(state["device"]))
    g.set_state(state["state"].cpu())
    return g
