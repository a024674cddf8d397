"""A request's prompt as token ids, and the routing inputs the artifact predicts from it.

Routing before (or without) a prefill signature needs the prompt's token ids: a decode-first
request is routed before its prefill runs, a short prompt has no prefill at all, and a
stock vLLM prefill (no eldr plugin) answers no expert counts. The router then tokenizes the
prompt itself, as vLLM's OpenAI server does (docs/serve.md, "Routing on the prompt"):

- ``/v1/completions``: a text prompt is encoded with the model's tokenizer, special tokens
  added unless the body says ``"add_special_tokens": false``; a prompt of token ids
  (``[1, 2, 3]`` or ``[[1, 2, 3]]``) is taken as it is, with no tokenizer;
- ``/v1/chat/completions``: the messages are rendered with the chat template (jinja2, in a
  sandbox, as ``transformers`` and vLLM render it: ``add_generation_prompt`` true unless
  the body says otherwise, ``chat_template_kwargs`` passed through), then encoded without
  special tokens (the template writes its own).

A batch of prompts, prompt embeddings, non-text message parts, or a chat with no template
give no token ids: such a request is routed by load, and counted
(``eldr_prompt_predictions_total{result}``). Nothing here makes an HTTP call.

:class:`PromptTokenizer` loads ``tokenizer.json`` (the ``tokenizers`` library) and the
template lazily, once per process; :class:`PromptRouting` is what a routing snapshot
holds: the tokenizer (or None) and the artifact's ``route_inputs_from_prompt``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr.proxy.bodies import ints_only

__all__ = ["PREDICTION_RESULTS", "PromptRouting", "PromptTokenizer", "RequestPrompt",
           "Untokenizable", "prompt_token_ids", "tokenizer_dir_for"]

# outcomes of one attempt to predict a request's routing inputs from its prompt
# (eldr_prompt_predictions_total{result}): "ok", or why not
# ("busy": the prompt work queue was full, "timeout": its job took too long, "failed": the
# tokenizer process died; eldr.proxy.request.offload)
PREDICTION_RESULTS = ("ok", "no_predictor", "no_tokenizer", "no_chat_template",
                      "untokenizable", "invalid", "busy", "timeout", "failed")
_MAX_TOKENIZER_BYTES = 256 << 20  # a tokenizer.json larger than this is refused
_MAX_TEMPLATE_BYTES = 1 << 20


class Untokenizable(ValueError):
    """A prompt the router cannot turn into one list of token ids; ``reason`` is one of
    :data:`PREDICTION_RESULTS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _read_text(path: Path, limit: int, what: str) -> str:
    from eldr.fileio import open_regular

    with open_regular(path, max_bytes=limit, what=what) as fh:
        try:
            return fh.read().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: {what} is not UTF-8 text") from None


class PromptTokenizer:
    """The model's tokenizer and chat template, for the prompts of routed requests.

    ``directory``: a folder holding ``tokenizer.json`` (and, optionally,
    ``tokenizer_config.json`` with ``chat_template``, ``bos_token``, ``eos_token``, or a
    ``chat_template.jinja``); ``chat_template``: a template file that overrides the
    folder's (as ``vllm serve --chat-template`` does). ``ValueError`` naming the problem
    for a missing or unreadable file, or when ``tokenizers`` / ``jinja2`` is not installed.
    """

    def __init__(self, directory: str | os.PathLike, *,
                 chat_template: str | os.PathLike | None = None) -> None:
        try:
            import tokenizers
        except ModuleNotFoundError:
            raise ValueError("routing on the prompt needs the tokenizers package: pip "
                             "install -e '.[serve]'") from None
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{self.directory}: no tokenizer.json (give the model's folder "
                             f"with --tokenizer DIR)")
        from eldr.fileio import open_regular

        with open_regular(path, max_bytes=_MAX_TOKENIZER_BYTES, what="tokenizer.json") as fh:
            raw = fh.read()
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the library's own error type: one clear line
            raise ValueError(f"{path}: not a tokenizers file ({exc})") from None
        self.fingerprint = _fingerprint(raw)  # as the artifact's predictor records it
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config = self._config()
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = None
        if chat_template is not None:
            template = _read_text(Path(chat_template), _MAX_TEMPLATE_BYTES, "a chat template")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif (self.directory / "chat_template.jinja").is_file():
            template = _read_text(self.directory / "chat_template.jinja",
                                  _MAX_TEMPLATE_BYTES, "a chat template")
        self.chat_template = template  # jinja2 source, or None: chats are not tokenized
        self._compiled = None

    def _config(self) -> dict:
        path = self.directory / "tokenizer_config.json"
        if not path.is_file():
            return {}
        try:
            doc = json.loads(_read_text(path, _MAX_TEMPLATE_BYTES * 8, "tokenizer_config.json"))
        except (ValueError, RecursionError):
            raise ValueError(f"{path}: not valid JSON") from None
        return doc if isinstance(doc, dict) else {}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render(self, messages: list, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        """The chat's text as the engine renders it (``Untokenizable`` without a template
        or when the template refuses the messages)."""
        if self.chat_template is None:
            raise Untokenizable("no_chat_template", "no chat template (give --chat-template)")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        try:
            return self._compiled.render(
                **(kwargs or {}), messages=messages, bos_token=self.bos_token,
                eos_token=self.eos_token, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)
        except Exception as exc:  # a template error: that request is routed by load
            raise Untokenizable("untokenizable", f"the chat template failed: {exc}") from None


def _fingerprint(raw: bytes) -> str:
    """The tokenizer's fingerprint as the prompt predictor records it
    (``eldr.fit.prompt.tokenizer_fingerprint``)."""
    try:
        from eldr.fit.prompt import tokenizer_fingerprint
    except ImportError:  # an eldr without prompt predictors: the interface's definition
        import hashlib

        return hashlib.sha256(raw).hexdigest()
    return tokenizer_fingerprint(raw)


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _compile(source: str):
    """A chat template compiled as ``transformers`` compiles it: a sandbox, blocks trimmed,
    loop controls, ``raise_exception`` and a ``tojson`` that keeps non-ASCII text."""
    try:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError:
        raise ValueError("routing chats on the prompt needs jinja2: pip install -e "
                         "'.[serve]'") from None

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                              indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except Exception as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and ints_only(value)


def _flat_messages(messages: object) -> list[dict]:
    """Messages with list-of-text-part contents joined by newlines (vLLM's "string"
    content format); ``Untokenizable`` for images, audio or malformed messages."""
    if not isinstance(messages, list) or not messages:
        raise Untokenizable("untokenizable", "no messages")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise Untokenizable("untokenizable", "a message is not an object")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str) or part.get("type", "text") != "text":
                    raise Untokenizable("untokenizable", "a message part is not text")
                texts.append(text)
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def prompt_token_ids(body: dict, kind: str, tokenizer: PromptTokenizer | None) -> np.ndarray:
    """(P,) int64 token ids of one request's prompt (``kind``: "completions" or "chat").

    ``Untokenizable`` (with its reason) for a batch, embeddings, an empty prompt, non-text
    content, or text with no tokenizer to encode it.
    """
    if kind == "chat":
        if tokenizer is None:
            raise Untokenizable("no_tokenizer", "a chat needs the tokenizer")
        kwargs = body.get("chat_template_kwargs")
        text = tokenizer.render(
            _flat_messages(body.get("messages")),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=body.get("continue_final_message") is True,
            kwargs=kwargs if isinstance(kwargs, dict) else None)
        ids = tokenizer.encode(text, add_special_tokens=body.get("add_special_tokens") is True)
    else:
        if body.get("prompt_embeds") not in (None, []):
            raise Untokenizable("untokenizable", "prompt embeddings")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if _is_ids(prompt):
            return np.asarray(prompt, dtype=np.int64)
        if not isinstance(prompt, str) or not prompt:
            raise Untokenizable("untokenizable", "not one prompt (empty, a batch, not text)")
        if tokenizer is None:
            raise Untokenizable("no_tokenizer", "a text prompt needs the tokenizer")
        ids = tokenizer.encode(prompt,
                               add_special_tokens=body.get("add_special_tokens") is not False)
    if not ids:
        raise Untokenizable("untokenizable", "the prompt has no tokens")
    return np.asarray(ids, dtype=np.int64)


def tokenizer_dir_for(model: str | None) -> str | None:
    """The tokenizer folder of an artifact's model, when it is known: the model name itself
    if it is a folder with ``tokenizer.json``, the shipped tiny MoE for ``tiny_moe``."""
    if model and (Path(model) / "tokenizer.json").is_file():
        return model
    if model == "tiny_moe":
        try:
            from eldr.capture import tiny_moe_dir

            return str(tiny_moe_dir())
        except (ImportError, ValueError):
            return None
    return None


@dataclass(frozen=True, slots=True)
class PromptRouting:
    """What a routing snapshot needs to route on the prompt."""

    # (P,) int token ids -> ((d,) float32 unit signature, (L, E) float32 profile); raises
    # ValueError for an empty prompt or ids outside the predictor's vocabulary
    predict: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    tokenizer: PromptTokenizer | None  # None: only prompts given as token ids are predicted
    fingerprint: str  # the predictor's tokenizer fingerprint ("" when it recorded none)


class RequestPrompt:
    """One request's prompt, tokenized at most once, when a decision first needs it (a
    retry's decision reuses the ids). Tokenized by one prediction job at a time
    (:mod:`eldr.proxy.request.offload`): ``job`` is the request's last one."""

    __slots__ = ("_done", "_ids", "_reason", "body", "job", "kind")

    def __init__(self, body: dict, kind: str) -> None:
        self.body, self.kind = body, kind
        self._done = False
        self._ids: np.ndarray | None = None
        self._reason = "ok"
        self.job = None  # the asyncio future of the request's last prediction job, or None

    @property
    def is_done(self) -> bool:
        """Whether the ids (or why there are none) are known."""
        return self._done

    def needs_tokenizer(self) -> bool:
        """Whether the prompt is text (or a chat) to encode, not token ids."""
        if self.kind == "chat":
            return True
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return isinstance(prompt, str)

    def set_token_ids(self, ids: np.ndarray | None, reason: str) -> None:
        """Record ids (or why none) found elsewhere (a tokenizer process)."""
        self._done, self._ids, self._reason = True, ids, reason

    def token_ids(self, tokenizer: PromptTokenizer | None) -> tuple[np.ndarray | None, str]:
        """((P,) int64 ids or None, "ok" or why not: a :data:`PREDICTION_RESULTS` value)."""
        if not self._done:
            self._done = True
            try:
                self._ids = prompt_token_ids(self.body, self.kind, tokenizer)
            except Untokenizable as exc:
                self._reason = exc.reason
            except RecursionError:  # a message nested deeper than the template recurses
                self._reason = "untokenizable"
        return self._ids, self._reason
