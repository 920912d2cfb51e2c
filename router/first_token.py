"""A handoff's first token from P: what the router sends D after P answered, and how it joins
P's token and D's continuation into the one answer a single engine would give.

P computes the prompt and samples the first token anyway (the router asks it for `max_tokens: 1`).
With `first_token="prefill"` the router sends that token to the client at once and asks D to
continue from the prompt plus that token: D's request is a completion whose prompt is P's prompt
token ids followed by P's token id, with P's handoff. D reads every prompt block from P (the
ticket covers the prompt; D's longer prompt extends it) and computes only the new token's KV, so
the client's time to first token no longer holds the router's second hop, D's claim, read and
engine steps.

A request whose first token ends it (EOS, a stop string or token, `max_tokens: 1`) ends on P:
D is never called and the ticket is abandoned at once.

Exactness. For greedy sampling the text, token ids, finish reason and usage equal one engine's.
What cannot be continued from a token-id prompt is refused here, and such a request takes the
`decode` path (D computes the first token itself, as before): several choices (`n`, `best_of`,
beam search), echo and prompt logprobs, presence and frequency penalties and bad words (they
count output tokens, and D would see P's token as prompt), structured outputs and tool calls (the
grammar and the parser start at the first token), multimodal prompts (D's digest would not name
the media), custom `vllm_xargs` (logits processors may keep state), watermarking, repetition
detection, thinking budgets, token offsets, per-chunk usage and chat logprobs (chat's logprob
format cannot be rebuilt exactly from a completion's). After P answers, a first token whose
text could begin a stop string (a stop spanning P's token and D's would go unseen by D) or ends
in an incomplete UTF-8 sequence also takes the decode path, with the same ticket.

Seeded sampling: P samples the first token with the request's seed and D the rest with the same
seed from a fresh generator, so outputs are reproducible for a seed, but beyond the first token
they differ from one engine's (which draws every token from one generator).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import msgspec

MODES = ("prefill", "decode")
CONTINUE_ENDPOINT = "/v1/completions"

# Fields that only shape a chat request's prompt (P applied them; D gets the token ids) or are
# rewritten for D's completion request.
_CHAT_PROMPT_FIELDS = frozenset({
    "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "media_io_kwargs", "mm_processor_kwargs", "tools", "tool_choice", "parallel_tool_calls",
    "return_prompt_text", "max_completion_tokens", "logprobs", "top_logprobs", "include_reasoning",
    "reasoning_effort",
})
# Fields of the client's request that D's token-id continuation must not carry.
_PROMPT_FIELDS = frozenset({"prompt", "prompt_embeds", "suffix", "echo", "truncate_prompt_tokens",
                            "truncation_side", "add_special_tokens", "request_id", "kv_transfer_params"})
# Options whose effect depends on the output so far, or that P and D cannot split; any value
# other than these "off" values sends the request down the decode path.
_OFF = (None, False, 0, 0.0, "", [], {})
_OUTPUT_STATEFUL = ("presence_penalty", "frequency_penalty", "bad_words", "structured_outputs", "guided_json",
                    "guided_regex", "guided_choice", "guided_grammar", "watermarking", "repetition_detection",
                    "thinking_token_budget", "return_token_offsets", "routed_experts_prompt_start", "mm_payload",
                    "prompt_embeds", "suffix", "echo", "prompt_logprobs", "use_beam_search", "vllm_xargs")


def refusal(endpoint: str, body: dict) -> str | None:
    """Why this request's first token cannot come from P (a short reason, a metric label), or
    None when it can."""

    n = body.get("n")
    if n not in (None, 1):
        return "n"
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)
        if value is not None and type(value) is not int:
            return "budget_not_an_int"  # the engine coerces "1" or 1.0; the router would misread them
    for name in ("prompt_logprobs", "thinking_token_budget"):  # 0 turns these on
        if body.get(name) is not None:
            return name
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        return "best_of"
    for name in _OUTPUT_STATEFUL:
        if body.get(name) not in _OFF:
            return name
    response_format = body.get("response_format")
    if response_format is not None and not (isinstance(response_format, dict)
                                            and response_format.get("type", "text") == "text"):
        return "response_format"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage_stats"
    if endpoint != CONTINUE_ENDPOINT:
        if body.get("tools") and body.get("tool_choice", "auto") != "none":
            return "tools"
        if body.get("logprobs") or body.get("top_logprobs"):
            return "chat_logprobs"
        if body.get("echo"):
            return "echo"
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():  # (a bad shape: P answers 400)
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(part, dict) or part.get("type") != "text"
                                                 for part in content):
                return "multimodal"
    return None


def prefill_body(body: dict, token_ids: bool = True) -> dict:
    """What P computes for a handoff: the client's request, one token, not streamed, one choice,
    with the handoff asked for and, with `token_ids`, the prompt's and the token's ids returned
    (the router's, stripped before the client sees P's answer)."""

    p_body = dict(body)
    p_body.update({"max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}})
    if token_ids:
        p_body["return_token_ids"] = True
    p_body.pop("best_of", None)
    p_body.pop("stream_options", None)
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    if isinstance(p_body.get("min_tokens"), int) and p_body["min_tokens"] > 1:
        p_body["min_tokens"] = 1  # the engine refuses min_tokens above max_tokens; D keeps the rest
    return p_body


def client_max_tokens(endpoint: str, body: dict) -> int | None:
    """The client's output budget (None: up to the context), as the engine reads it."""

    if endpoint == CONTINUE_ENDPOINT:
        value = body.get("max_tokens", 16)  # vLLM's and OpenAI's default for completions
    else:
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    return value if type(value) is int else None


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str) and s]
    return []


@dataclass
class FirstToken:
    """P's answer, read: the prompt it computed, the token it sampled, and whether that ends the
    request."""

    endpoint: str
    answer: dict  # P's whole answer (its id, created, model and usage start the client's)
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: dict | None
    finish_reason: str | None
    ends: bool  # the request is over on P: EOS, a stop, or the client's budget was one token
    wants_token_ids: bool

    @property
    def choice(self) -> dict:
        return self.answer["choices"][0]

    @property
    def offset_shift(self) -> int:
        """Where D's logprob text offsets start in the joined answer: vLLM counts the lengths of
        the logprob token strings (not of the output text), so past P's last one."""

        logprobs = self.logprobs or {}
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if (isinstance(offsets, list) and isinstance(tokens, list) and offsets and tokens
                and type(offsets[-1]) is int and isinstance(tokens[-1], str)):
            return offsets[-1] + len(tokens[-1])
        return len(self.text)


def read_first_token(endpoint: str, body: dict, answer, context_limit: int | None = None) -> FirstToken | str:
    """P's answer as a FirstToken, or why the request must take the decode path instead. With
    the engines' `context_limit` (max_model_len), a prompt that P's token filled to the limit
    ends on P ("length"), as one engine ends it, instead of sending D a prompt it must refuse."""

    try:
        choice = answer["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") if endpoint == CONTINUE_ENDPOINT else answer.get("prompt_token_ids")
        token_ids = choice["token_ids"]
        if endpoint == CONTINUE_ENDPOINT:
            text = choice["text"]
        else:
            message = choice["message"]
            if message.get("tool_calls") or message.get("reasoning") or message.get("reasoning_content"):
                return "parsed_output"  # a tool-call or reasoning parser runs on the engines
            text = message["content"]
    except (KeyError, IndexError, TypeError, AttributeError):
        return "prefill_answer"
    if (not isinstance(prompt_ids, list) or not prompt_ids or not all(type(t) is int for t in prompt_ids)
            or not isinstance(token_ids, list) or len(token_ids) != 1 or type(token_ids[0]) is not int
            or not isinstance(text, str)):
        return "prefill_answer"
    finish = choice.get("finish_reason")
    budget = client_max_tokens(endpoint, body)
    full = context_limit is not None and len(prompt_ids) + len(token_ids) >= context_limit
    ends = finish == "stop" or (finish == "length" and ((budget is not None and budget <= 1) or full))
    if not ends:
        if text.endswith("\ufffd"):
            return "partial_utf8"  # D's text of the next token completes the character: D decodes both
        if any(text.endswith(stop[:k]) for stop in stop_strings(body) for k in range(1, len(stop))):
            return "stop_prefix"  # a stop string could span P's token and D's: only D's own check sees it
    logprobs = choice.get("logprobs") if endpoint == CONTINUE_ENDPOINT else None
    return FirstToken(endpoint, answer, prompt_ids, token_ids, text, logprobs if isinstance(logprobs, dict) else None,
                      finish, ends, bool(body.get("return_token_ids")))


def continuation_body(body: dict, first: FirstToken) -> dict:
    """D's request: a completion of P's prompt token ids plus P's token, for the rest of the
    client's budget, with the client's sampling options (P's handoff is added by the caller)."""

    d_body = {k: v for k, v in body.items()
              if k not in _PROMPT_FIELDS and (first.endpoint == CONTINUE_ENDPOINT or k not in _CHAT_PROMPT_FIELDS)}
    d_body["prompt"] = first.prompt_token_ids + first.token_ids
    budget = client_max_tokens(first.endpoint, body)
    d_body["max_tokens"] = None if budget is None else budget - len(first.token_ids)
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 0:
        d_body["min_tokens"] = max(0, min_tokens - len(first.token_ids))
    d_body["return_token_ids"] = bool(body.get("return_token_ids"))
    if body.get("stream"):
        d_body["stream_options"] = {"include_usage": True}  # merged with P's, sent if the client asked
    return d_body


def merged_usage(first: FirstToken, d_usage, streamed: bool = False) -> dict | None:
    """One engine's usage: P's prompt (and its cache details), P's token plus D's tokens. A
    stream's usage takes the shape of D's stream usage (vLLM leaves unset fields out there)."""

    p_usage = first.answer.get("usage")
    if not isinstance(p_usage, dict):
        return d_usage if isinstance(d_usage, dict) else None
    if streamed:
        usage = dict(d_usage) if isinstance(d_usage, dict) else {k: v for k, v in p_usage.items() if v is not None}
        if p_usage.get("prompt_tokens_details") is not None:
            usage["prompt_tokens_details"] = p_usage["prompt_tokens_details"]
    else:
        usage = dict(p_usage)
    prompt = p_usage.get("prompt_tokens") if type(p_usage.get("prompt_tokens")) is int else len(first.prompt_token_ids)
    d_tokens = d_usage.get("completion_tokens") if isinstance(d_usage, dict) else None
    completion = len(first.token_ids) + (d_tokens if type(d_tokens) is int else 0)
    usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return usage


def _merged_logprobs(first: FirstToken, d_logprobs) -> dict | None:
    """A completion's logprobs: P's token's, then D's with their text offsets moved past P's text."""

    if first.logprobs is None:
        return d_logprobs if isinstance(d_logprobs, dict) else None
    merged = {key: list(value) for key, value in first.logprobs.items() if isinstance(value, list)}
    if isinstance(d_logprobs, dict):
        shift = first.offset_shift
        for key, value in d_logprobs.items():
            if not isinstance(value, list):
                continue
            if key == "text_offset":
                value = [offset + shift if type(offset) is int else offset for offset in value]
            merged.setdefault(key, []).extend(value)
    return merged


def _client_choice_fields(first: FirstToken, choice: dict, d_token_ids) -> None:
    """Token ids in a choice only when the client asked for them (P and D were always asked)."""

    if first.wants_token_ids:
        choice["token_ids"] = first.token_ids + (d_token_ids if isinstance(d_token_ids, list) else [])
    else:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)


def answer_from_prefill(first: FirstToken) -> dict:
    """The client's answer when the request ended on P: P's, less the handoff and the fields the
    router asked for."""

    answer = dict(first.answer)
    answer.pop("kv_transfer_params", None)
    choice = dict(first.choice)
    _client_choice_fields(first, choice, [])
    answer["choices"] = [choice]
    if not first.wants_token_ids:
        answer.pop("prompt_token_ids", None)
    return answer


def joined_answer(first: FirstToken, d_answer) -> dict | None:
    """One engine's answer from P's token and D's continuation (a completion), in the client's
    endpoint's shape; None when D's answer is not a completion."""

    try:
        d_choice = d_answer["choices"][0]
        d_text = d_choice["text"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(d_text, str):
        return None
    answer = answer_from_prefill(first)
    choice = dict(answer["choices"][0])
    if first.endpoint == CONTINUE_ENDPOINT:
        choice["text"] = first.text + d_text
        choice["logprobs"] = _merged_logprobs(first, d_choice.get("logprobs"))
    else:
        message = dict(choice.get("message") or {})
        message["content"] = first.text + d_text
        choice["message"] = message
    choice["finish_reason"] = d_choice.get("finish_reason")
    choice["stop_reason"] = d_choice.get("stop_reason")
    _client_choice_fields(first, choice, d_choice.get("token_ids"))
    answer["choices"] = [choice]
    answer["usage"] = merged_usage(first, d_answer.get("usage"))
    return answer


class ContinuedStream:
    """The client's stream: P's token first, then D's completion chunks, each rewritten as one
    engine's chunk of the client's endpoint (one id, one `created`, chat deltas for chat, text
    offsets moved past P's text, token ids only when asked, one usage chunk when asked)."""

    def __init__(self, first: FirstToken, body: dict) -> None:
        self.first = first
        options = body.get("stream_options")
        self.wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        answer = first.answer
        self.id = answer.get("id") or f"cmpl-{int(time.time() * 1e3)}"
        self.created = answer.get("created") or int(time.time())
        self.model = answer.get("model")
        self.chat = first.endpoint != CONTINUE_ENDPOINT
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self._fast: tuple[bytes, bytes] | None = None  # (D's quoted id, P's), once D's first chunk is read
        self._created_bytes = b'"created":' + str(int(self.created)).encode()

    def _chunk(self, choices: list, **extra) -> bytes:
        payload = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                   "choices": choices, **extra}
        return b"data: " + _ENCODE.encode(payload) + b"\n\n"

    def _choice(self, text: str, finish_reason, stop_reason, logprobs, token_ids) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
        if self.first.wants_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def opening(self) -> list[bytes]:
        """P's token (after chat's role chunk), and, when it ended the request, the end."""

        first = self.first
        out = []
        if self.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            out.append(self._chunk([role]))
        finish = first.finish_reason if first.ends else None
        stop_reason = first.choice.get("stop_reason") if first.ends else None
        choice = self._choice(first.text, finish, stop_reason, first.logprobs, first.token_ids)
        if first.wants_token_ids and not self.chat:
            choice["prompt_token_ids"] = first.prompt_token_ids
        extra = {"prompt_token_ids": first.prompt_token_ids} if first.wants_token_ids and self.chat else {}
        out.append(self._chunk([choice], **extra))
        if first.ends:
            out.extend(self.closing(None))
        return out

    def closing(self, d_usage) -> list[bytes]:
        out = []
        if self.wants_usage:
            out.append(self._chunk([], usage=merged_usage(self.first, d_usage, streamed=True)))
        out.append(b"data: [DONE]\n\n")
        return out

    def rewrite(self, payload: dict) -> bytes | None:
        """One of D's chunks as the client's (None: nothing for the client in it)."""

        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices:
            return None  # D's usage chunk: merged into the closing one
        out = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            text = choice.get("text") if isinstance(choice.get("text"), str) else ""
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                shift = self.first.offset_shift
                logprobs = dict(logprobs, text_offset=[o + shift if type(o) is int else o
                                                       for o in logprobs["text_offset"]])
            out.append(self._choice(text, choice.get("finish_reason"), choice.get("stop_reason"), logprobs,
                                    choice.get("token_ids")))
        return self._chunk(out) if out else None

    def rewrite_event(self, event: bytes) -> tuple[bytes | None, dict | None]:
        """One server-sent event of D's stream as the client's bytes (None: nothing to send),
        and D's payload when it was decoded (None on the fast path).

        A completion's chunks after the first are D's own bytes with P's id and `created` put in
        (a few byte replacements instead of a decode and an encode per token: at thousands of
        tokens a second the router's one thread is the stream's bottleneck otherwise). The first
        chunk, the usage chunk, errors, chat chunks and chunks with logprobs to move are decoded
        and rebuilt."""

        fast = self._fast
        if fast is not None and b'"error"' not in event and not _USAGE.search(event):
            d_id, p_id = fast
            return _CREATED.sub(self._created_bytes, event.replace(d_id, p_id, 1), count=1) + b"\n\n", None
        payload = _sse_payload(event)
        if payload is None or "error" in payload:
            return None, payload
        if self._fast is None and not self.chat and self.first.logprobs is None:
            d_id = payload.get("id")
            if isinstance(d_id, str) and d_id and '"' not in d_id and "\\" not in d_id:
                self._fast = (b'"' + d_id.encode() + b'"', b'"' + str(self.id).encode() + b'"')
        return self.rewrite(payload), payload


_ENCODE = msgspec.json.Encoder()
_CREATED = re.compile(rb'"created":\s*\d+')
_USAGE = re.compile(rb'"usage":\s*\{')
_DECODE = msgspec.json.Decoder()


def _sse_payload(event: bytes) -> dict | None:
    lines = [line[5:] for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        payload = _DECODE.decode(b"\n".join(lines))
    except msgspec.DecodeError:
        return None
    return payload if isinstance(payload, dict) else None
