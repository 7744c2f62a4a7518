"""A fake target whose replies a test writes: tool-calling output on demand, without weights."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.backends.fake import FakeBackend

ASSISTANT = "<|im_start|>assistant\n"
END = 1  # <|im_end|>


class ScriptedBackend(FakeBackend):
    """FakeBackend whose logits, after a prompt's last `<|im_start|>assistant\\n`, put all the
    weight on the next token of a scripted reply, then on <|im_end|>. The reply is the value of
    the first key of `scripts` that the prompt's text holds; a prompt with none, or a reply that
    has left its script (a grammar chose otherwise), gets FakeBackend's own logits."""

    def __init__(self, scripts: dict[str, str], **kwargs):
        super().__init__(**kwargs)
        self.scripts = {key: self.tokenize(text) for key, text in scripts.items()}  # marker pieces as tokens
        self._marker = self.tokenize(ASSISTANT)

    def _row(self, history: Sequence[int]) -> np.ndarray:
        logits = super()._row(history)
        script, generated = self._script(history)
        if script is None or list(generated) != script[:len(generated)]:
            return logits
        logits[script[len(generated)] if len(generated) < len(script) else END] = 1e4
        return logits

    def _script(self, history: Sequence[int]):
        history = list(history)
        width = len(self._marker)
        for start in range(len(history) - width, -1, -1):
            if history[start:start + width] == self._marker:
                prompt = b"".join(self.pieces[token] for token in history[:start]).decode("utf-8", "replace")
                for key, script in self.scripts.items():
                    if key in prompt:
                        return script, history[start + width:]
                return None, ()
        return None, ()
