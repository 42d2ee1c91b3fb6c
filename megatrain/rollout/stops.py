"""Stop strings, checked on the decoded text as tokens arrive: after each new token, the last few tokens are decoded
with and without it; a stop string that appears only with it ends the completion there (after the token that
completed the string, which is kept)."""

from __future__ import annotations


class StopStrings:
    # tokens decoded beyond the longest stop string's characters: a token decodes to at least one character except
    # for byte pieces of one character, which a few extra tokens cover
    SLACK = 8

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.window = max((len(s) for s in self.stops), default=0) + self.SLACK

    def hit(self, ids: list[int]) -> bool:
        """Whether the last token of `ids` (a completion so far) completes a stop string."""
        if not self.stops:
            return False
        tail = ids[-self.window:]
        now = self.tokenizer.decode(tail, skip_special_tokens=False)
        if not any(s in now for s in self.stops):
            return False
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        return any(now.count(s) > before.count(s) for s in self.stops)
