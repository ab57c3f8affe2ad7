"""Text <-> token ids for a served model, its chat template, and streaming detokenization.

A Tokenizer wraps a `tokenizers.Tokenizer`, built either from an HF directory's tokenizer.json or
from the vocabulary a GGUF file stores in its metadata (llama.cpp key names, byte-level BPE).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from backfill.errors import CorruptModelError, InvalidRequestError, UnsupportedModelError

# llama.cpp's token_type values (gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Chat formats end an assistant turn with one of these; generation stops on them as on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# The "llama-bpe" split (Llama 3 and relatives): contractions, letters, numbers of up to 3 digits,
# punctuation runs, newlines, whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split ("qwen2", also Qwen2.5 and Qwen3): Llama 3's with every digit on its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer a GGUF's `tokenizer.ggml.pre` names (how the vocabulary was trained)."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in (None, "default", "gpt2", "gpt-2"):
        return gpt2
    if pre_type == "smollm":
        # SmolLM's tokenizer.json: every digit is its own pre-token, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre_type in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre_type == "qwen2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise UnsupportedModelError(f"tokenizer pre-type {pre_type!r} is not supported "
                                "(supported: default/gpt2, smollm, llama-bpe, qwen2)")


def _render_error(message: str) -> None:
    raise InvalidRequestError(f"chat template rejected the conversation: {message}")


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON (as transformers renders).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Sandboxed: the template comes from the model file, which is untrusted input.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _render_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise CorruptModelError(f"the model's chat template does not compile: {exc}") from exc


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': str, 'content': str}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"messages[{index}].{key} must be a string")


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None = None, add_bos_token: bool = False) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._template = _compile_chat_template(chat_template) if chat_template else None
        for token in (bos_token, eos_token):
            if token is not None and backend.token_to_id(token) is None:
                raise CorruptModelError(f"special token {token!r} is not in the vocabulary")

    @classmethod
    def from_gguf_vocab(cls, *, tokens: list[str], merges: list[str], token_types: list[int],
                        pre_type: str | None, bos_token_id: int | None, eos_token_id: int | None,
                        add_bos_token: bool, chat_template: str | None) -> "Tokenizer":
        """Byte-level BPE from GGUF metadata (tokenizer.ggml.model == "gpt2")."""
        vocab = {token: index for index, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise CorruptModelError("GGUF tokenizer vocabulary has duplicate tokens")
        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise CorruptModelError(f"GGUF tokenizer merge {merge!r} is not two space-separated pieces")
            pairs.append((parts[0], parts[1]))
        try:
            backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        except Exception as exc:
            raise CorruptModelError(f"GGUF tokenizer vocabulary/merges are inconsistent: {exc}") from exc
        backend.pre_tokenizer = _pre_tokenizer(pre_type)
        backend.decoder = decoders.ByteLevel()
        types = token_types if len(token_types) == len(tokens) else [0] * len(tokens)
        # Control tokens (<|im_start|> ...) must match whole in text and are dropped when decoding
        # with skip_special_tokens; user-defined tokens match whole but are ordinary text.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _TOKEN_TYPE_USER_DEFINED])

        def token_of(token_id: int | None) -> str | None:
            if token_id is None:
                return None
            if not 0 <= token_id < len(tokens):
                raise CorruptModelError(f"GGUF special token id {token_id} is outside the vocabulary")
            return tokens[token_id]

        bos = token_of(bos_token_id)
        if add_bos_token and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)])
        else:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        return cls(backend, bos_token=bos, eos_token=token_of(eos_token_id), chat_template=chat_template,
                   add_bos_token=add_bos_token)

    @classmethod
    def from_hf_dir(cls, directory: Path) -> "Tokenizer":
        """tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
        try:
            backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:
            raise CorruptModelError(f"{directory}/tokenizer.json cannot be loaded: {exc}") from exc
        config: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CorruptModelError(f"{config_path} is not valid JSON: {exc}") from exc
        template = config.get("chat_template")
        template_path = directory / "chat_template.jinja"
        if template is None and template_path.is_file():
            template = template_path.read_text()
        if isinstance(template, list):  # several named templates: the "default" one serves chat
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)

        def token_text(value) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        return cls(backend, bos_token=token_text(config.get("bos_token")),
                   eos_token=token_text(config.get("eos_token")), chat_template=template,
                   add_bos_token=bool(config.get("add_bos_token", False)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS plus every end-of-turn token the vocabulary has, in that order, without repeats."""
        ids = [self.eos_token_id] + [self.token_to_id(t) for t in END_OF_TURN_TOKENS]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except (UnicodeEncodeError, TypeError, ValueError) as exc:  # e.g. a lone UTF-16 surrogate
            raise InvalidRequestError(f"text cannot be tokenized: {exc}") from exc

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """tools (OpenAI's shape) reach templates that render them, as transformers passes them."""
        _validate_messages(messages)
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        extra = {"tools": tools} if tools else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed on this conversation: {exc}") from exc

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The rendered template spells special tokens out as text; they are matched whole there,
        # so no extra BOS is added here (the template decides).
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decoding token by token breaks both multi-byte UTF-8 characters split across tokens and
    tokenizers whose spacing depends on the neighbouring token, so each push decodes a short
    window of recent tokens and emits only the text past what was already emitted. A window that
    ends in U+FFFD ends in an incomplete character: it is held back until the next push.
    """

    _PROMPT_CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self._PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        emitted = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        delta = window[len(emitted):]
        # Tokens up to the old read offset become the next window's context; older ids are
        # dropped, so each push decodes a bounded window.
        self._ids = self._ids[self._prefix:]
        self._prefix, self._read = self._read - self._prefix, len(self._ids)
        return delta

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), with U+FFFD for it."""
        emitted = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return window[len(emitted):] if len(window) > len(emitted) else ""
