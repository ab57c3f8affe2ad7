"""A byte-level tokenizer (token id = UTF-8 byte) for tiny random-weight test models.

It has the same surface as backfill.engine.tokenizer.Tokenizer, so the scheduler, the server
and the harness run unchanged on a tiny model with a 256+ token vocabulary.
"""

from __future__ import annotations

import codecs

from backfill.errors import InvalidRequestError


class ByteTokenizer:
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int = 256) -> None:
        if vocab_size < 256:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 256")
        self.vocab_size = vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a lone UTF-16 surrogate
            raise InvalidRequestError(f"text cannot be tokenized: {exc}") from exc

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 3 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError("each message needs string 'role' and 'content'")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        return "".join(parts)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


class ByteDetokenizer:
    """Streams text from byte tokens; the incremental UTF-8 decoder holds back partial characters."""

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        return self._decoder.decode(bytes(i for i in token_ids if 3 <= i < 256))
