"""The batched rollout sampler (issue 38): n completions per prompt from transformers' own model with the
training weights, a KV cache, left-padded prompts prefilled in one batch, then one decode step per token over the
live rows; finished rows leave the batch.

Modes (RolloutModel): "resident", every weight on the device for the rollout (freed by close()); "streamed",
the decoder layers streamed through two device slots once per forward, every live row running through layer i
before layer i + 1, so a decode step moves the layers' bytes once whatever the batch (its rate: the bus / the
live rows). The KV cache (kvcache.py) on the device, or in pinned host memory with kv_on_host.

A row's tokens, in order: drawn from the filtered logits (params.draw), its log-prob taken from the log_softmax
of the logits divided by the temperature (the sampling policy's, what GRPO's loss differentiates, as TRL), then
EOS and stop strings checked. Rows that finish stay in the batch until they are an eighth of it (COMPACT_FRACTION:
dropping copies the whole cache), their later tokens ignored. Which rows a step draws for depends only on the tokens
so far, so a given batch and seed give the same completions in either mode, with the cache on the device or the host.
"""

from __future__ import annotations

import statistics
import time

import torch

from .kvcache import cache_bytes, chunked_prefill, make_cache, slabs_only
from .model import RolloutModel
from .params import Completions, SamplingParams, draw, make_generator
from .stops import StopStrings
from .weights import WeightSource

MODES = ("resident", "streamed")
COMPACT_FRACTION = 8  # finished rows are dropped once they are 1/8 of the batch (or at once in batches under 16)
# A prefill runs over row chunks of at most this many tokens (the MLP's activations of a whole GRPO batch at once
# would outgrow the device beside the cache); families with sliding-window layers prefill the batch at once.
PREFILL_TOKENS = 32768


class Sampler:
    def __init__(self, hf_config, weights: WeightSource, device, mode: str = "resident",
                 dtype: torch.dtype = torch.bfloat16, kv_on_host: bool = False, compile: bool = False):
        if mode not in MODES:
            raise ValueError(f"Sampler mode: {mode!r} is not one of {', '.join(MODES)}")
        self.hf_config, self.device, self.mode = hf_config, torch.device(device), mode
        self.kv_on_host, self.dtype = kv_on_host, dtype
        self.model = RolloutModel(hf_config, weights, self.device, mode, dtype)
        self.compile = bool(compile) and self.device.type == "cuda"
        if self.compile:
            self._compile_layers()
        text = hf_config.get_text_config(decoder=True)
        self.pad_id = getattr(text, "pad_token_id", None) or 0

    def _compile_layers(self) -> None:
        """torch.compile each decoder layer's forward (dynamic shapes: the batch and the cache length vary)."""
        from .model import decoder_layers

        for layer in decoder_layers(self.model.model):
            layer.forward = torch.compile(layer.forward, dynamic=True)

    def _forward(self, ids, mask, pos, cache) -> torch.Tensor:
        # the last position's logits only; as an index, so the head's input is a contiguous copy (CPU bf16 matmuls
        # of the strided slice that an int selects run ~300x slower)
        keep = torch.tensor([ids.shape[1] - 1], device=ids.device) if ids.shape[1] > 1 else 1
        out = self.model.forward(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                                 logits_to_keep=keep)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, tokenizer=None,
                 generator: torch.Generator | None = None) -> Completions:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: {type(params).__name__} is not SamplingParams")
        if not prompt_ids or not all(isinstance(p, (list, tuple)) and p for p in prompt_ids):
            raise ValueError("prompt_ids: need one or more non-empty lists of token ids")
        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer")
        vocab = self.hf_config.get_text_config(decoder=True).vocab_size
        bad = [i for i, p in enumerate(prompt_ids) if min(p) < 0 or max(p) >= vocab]
        if bad:
            raise ValueError(f"prompt_ids[{bad[0]}]: a token id outside the vocabulary of {vocab}")
        g = generator if generator is not None else make_generator(self.device, params.seed)
        stops = StopStrings(tokenizer, params.stop)
        eos = set(params.eos_token_ids)
        t0 = time.perf_counter()

        index = [i for i, _ in enumerate(prompt_ids) for _ in range(params.n)]
        N, P = len(index), max(len(p) for p in prompt_ids)
        ids = torch.full((N, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, P), dtype=torch.long)
        for r, i in enumerate(index):
            p = prompt_ids[i]
            ids[r, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, P - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = make_cache(self.hf_config, P + params.max_new_tokens, self.kv_on_host)

        per = max(1, PREFILL_TOKENS // P)
        if N > per and slabs_only(cache):
            chunks = [(r, min(N, r + per)) for r in range(0, N, per)]
            logits = torch.cat(chunked_prefill(cache, N, P, chunks, lambda a, b: self._forward(
                ids[a:b], mask[a:b], pos[a:b], cache)))
        else:
            logits = self._forward(ids, mask, pos, cache)
        if cache.get_seq_length() != P:  # the model ran without this cache: its decode steps would see no past
            raise RuntimeError(f"rollout: the prefill left {cache.get_seq_length()} of {P} positions in the KV cache")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_prefill = time.perf_counter() - t0
        pos = pos[:, -1:]
        rows = list(range(N))  # batch position -> completion row
        done = [False] * N
        finished = [False] * N
        out_ids: list[list[int]] = [[] for _ in range(N)]
        out_lp: list[list[float]] = [[] for _ in range(N)]
        peak, steps = N, 0
        step_s, t_step = [], None  # each decode step's wall time: from one draw's .tolist() (a sync) to the next
        while True:
            tok, lp = draw(logits, params, g)
            tokens_now, lps_now = tok.tolist(), lp.tolist()
            now = time.perf_counter()
            if t_step is not None:
                step_s.append(now - t_step)
            t_step = now
            for b, (t, l) in enumerate(zip(tokens_now, lps_now)):
                r = rows[b]
                if done[r]:
                    continue
                out_ids[r].append(t)
                out_lp[r].append(l)
                if t in eos or stops.hit(out_ids[r]):
                    done[r] = finished[r] = True
                elif len(out_ids[r]) >= params.max_new_tokens:
                    done[r] = True
            keep = [b for b, r in enumerate(rows) if not done[r]]
            if not keep:
                break
            if len(rows) - len(keep) >= max(1, len(rows) // COMPACT_FRACTION):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                rows = [rows[b] for b in keep]
                tok, mask, pos = tok[idx], mask[idx], pos[idx]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], -1)
            pos = pos + 1
            logits = self._forward(tok[:, None], mask, pos, cache)
            steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c) for c in out_ids)
        stats = dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9), prefill_s=t_prefill,
                     decode_s=seconds - t_prefill, mode=self.mode, kv_bytes=cache_bytes(cache), peak_live=peak,
                     decode_steps=steps, decode_step_median_s=statistics.median(step_s) if step_s else 0.0,
                     decode_step_max_s=max(step_s, default=0.0), resident_bytes=self.model.resident_bytes,
                     streamed_bytes=self.model.streamed_bytes, kv_on_host=self.kv_on_host)
        del cache
        return Completions(index, out_ids, out_lp, finished, stats)

    def close(self) -> None:
        """Frees the device weights (resident), the slots (streamed); the KV cache is freed by generate()."""
        self.model.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
