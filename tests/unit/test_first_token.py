"""P's first token for the client: which requests may take it, how P's answer is read, what D is
asked, and how P's token and D's continuation join into one engine's answer and stream."""

from __future__ import annotations

import json

import pytest

from kvbaton.router import first_token as ft

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def p_completion(text="w7", token=7, finish="length", logprobs=None, prompt=(5, 6)) -> dict:
    return {"id": "cmpl-p", "object": "text_completion", "created": 100, "model": "tiny",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": list(prompt), "token_ids": [token]}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1,
                      "prompt_tokens_details": {"cached_tokens": 0}},
            "kv_transfer_params": {"kvbaton": {"ticket": "t", "abandon": "secret"}}}


def p_chat(text="w7", token=7, finish="length", prompt=(5, 6), **message) -> dict:
    return {"id": "chatcmpl-p", "object": "chat.completion", "created": 100, "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, **message},
                         "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": [token]}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "prompt_token_ids": list(prompt), "kv_transfer_params": {"kvbaton": {"ticket": "t"}}}


def d_completion(text=" w8 w9", tokens=(8, 9), finish="length", logprobs=None) -> dict:
    return {"id": "cmpl-d", "object": "text_completion", "created": 200, "model": "tiny",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": None, "token_ids": list(tokens)}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)}}


@pytest.mark.parametrize("body, reason", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"bad_words": ["x"]}, "bad_words"), ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "continuous_usage_stats"),
    ({"max_tokens": "1"}, "budget_not_an_int"), ({"max_tokens": 1.0}, "budget_not_an_int"),
    ({"min_tokens": 2.0}, "budget_not_an_int"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
])
def test_requests_that_cannot_start_from_p_s_token_name_why(body, reason):
    assert ft.refusal(COMPLETIONS, {"prompt": "w5", **body}) == reason


@pytest.mark.parametrize("body", [
    {}, {"n": 1}, {"presence_penalty": 0.0}, {"response_format": {"type": "text"}}, {"seed": 3, "temperature": 0.7},
    {"logprobs": 2}, {"stop": ["w9"], "min_tokens": 4, "repetition_penalty": 1.2}, {"vllm_xargs": {}},
])
def test_plain_sampling_options_start_from_p_s_token(body):
    assert ft.refusal(COMPLETIONS, {"prompt": "w5", **body}) is None


def test_chat_refuses_tools_logprobs_and_media_but_not_text_parts():
    text = [{"role": "user", "content": [{"type": "text", "text": "w5"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert ft.refusal(CHAT, {"messages": text}) is None
    assert ft.refusal(CHAT, {"messages": image}) == "multimodal"
    assert ft.refusal(CHAT, {"messages": text, "tools": [{"type": "function"}]}) == "tools"
    assert ft.refusal(CHAT, {"messages": text, "tools": [{"type": "function"}], "tool_choice": "none"}) is None
    assert ft.refusal(CHAT, {"messages": text, "logprobs": True}) == "chat_logprobs"
    for bad in (5, True, "w5", None):  # not the router's to judge: P answers the client's 400
        assert ft.refusal(CHAT, {"messages": bad}) is None


def test_p_computes_one_token_with_its_token_ids_and_a_handoff():
    p_body = ft.prefill_body({"prompt": "w5", "max_tokens": 9, "stream": True, "n": 1, "min_tokens": 4,
                              "stream_options": {"include_usage": True}, "best_of": 1})
    assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
    assert p_body["return_token_ids"] is True and p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in p_body and "best_of" not in p_body


def test_d_continues_from_p_s_prompt_and_token_with_the_rest_of_the_budget():
    first = ft.read_first_token(COMPLETIONS, {"prompt": "w5 w6", "max_tokens": 5}, p_completion())
    body = {"prompt": "w5 w6", "max_tokens": 5, "min_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 2,
            "stream": True, "stream_options": {"include_usage": False}}
    d_body = ft.continuation_body(body, first)
    assert d_body["prompt"] == [5, 6, 7] and d_body["max_tokens"] == 4 and d_body["min_tokens"] == 2
    assert "truncate_prompt_tokens" not in d_body and d_body["temperature"] == 0
    assert d_body["stream_options"] == {"include_usage": True}
    # Completions default to 16 tokens; chat to the rest of the context (null for D).
    assert ft.continuation_body({"prompt": "w5"}, first)["max_tokens"] == 15
    chat = {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 6, "logprobs": False,
            "chat_template_kwargs": {}, "stop": ["w9"]}
    chat_first = ft.read_first_token(CHAT, chat, p_chat())
    d_chat = ft.continuation_body(chat, chat_first)
    assert d_chat["prompt"] == [5, 6, 7] and d_chat["max_tokens"] == 5 and d_chat["stop"] == ["w9"]
    assert not {"messages", "max_completion_tokens", "logprobs", "chat_template_kwargs"} & set(d_chat)
    no_budget = ft.read_first_token(CHAT, {"messages": chat["messages"]}, p_chat())
    assert ft.continuation_body({"messages": chat["messages"]}, no_budget)["max_tokens"] is None


@pytest.mark.parametrize("finish, budget, ends", [("stop", 8, True), ("length", 1, True), ("length", 8, False)])
def test_a_first_token_that_ends_the_request_ends_it_on_p(finish, budget, ends):
    first = ft.read_first_token(COMPLETIONS, {"prompt": "w5", "max_tokens": budget}, p_completion(finish=finish))
    assert first.ends is ends
    if ends:
        answer = ft.answer_from_prefill(first)
        assert "kv_transfer_params" not in answer and "token_ids" not in answer["choices"][0]
        assert answer["choices"][0]["finish_reason"] == finish and answer["usage"]["completion_tokens"] == 1


def test_a_first_token_that_fills_the_context_ends_the_request_on_p():
    body = {"prompt": "w5 w6", "max_tokens": 8}
    assert ft.read_first_token(COMPLETIONS, body, p_completion(prompt=(5, 6)), context_limit=3).ends
    assert not ft.read_first_token(COMPLETIONS, body, p_completion(prompt=(5, 6)), context_limit=4).ends
    assert not ft.read_first_token(COMPLETIONS, body, p_completion(prompt=(5, 6)), context_limit=None).ends


def test_a_first_token_that_could_begin_a_stop_string_or_a_character_goes_to_d():
    assert ft.read_first_token(COMPLETIONS, {"prompt": "w5", "stop": ["w7 w8"]}, p_completion(text=" w7")) == "stop_prefix"
    assert ft.read_first_token(COMPLETIONS, {"prompt": "w5", "stop": ["x"]}, p_completion(text=" w7")).ends is False
    assert ft.read_first_token(COMPLETIONS, {"prompt": "w5"}, p_completion(text="\ufffd")) == "partial_utf8"
    # A stop already complete in P's text ended the request on P: nothing to span.
    assert ft.read_first_token(COMPLETIONS, {"prompt": "w5", "stop": "w"}, p_completion(text="", finish="stop")).ends


@pytest.mark.parametrize("answer", [{}, {"choices": []}, {"choices": [{"text": "a"}]},
                                    {"choices": [{"text": "a", "token_ids": [1, 2], "prompt_token_ids": [3]}]},
                                    {"choices": [{"text": "a", "token_ids": [1], "prompt_token_ids": []}]},
                                    {"choices": [{"text": None, "token_ids": [1], "prompt_token_ids": [3]}]}])
def test_a_p_answer_without_what_d_needs_goes_to_d(answer):
    assert ft.read_first_token(COMPLETIONS, {"prompt": "w5"}, answer) == "prefill_answer"


def test_a_chat_answer_from_a_reasoning_or_tool_parser_goes_to_d():
    assert ft.read_first_token(CHAT, {"messages": []}, p_chat(reasoning="think")) == "parsed_output"
    assert ft.read_first_token(CHAT, {"messages": []}, p_chat(tool_calls=[{"id": "x"}])) == "parsed_output"


def test_the_joined_completion_is_one_engine_s_answer():
    # (vLLM's offsets add up the logprob token strings' lengths, here 2 each, not the text's.)
    p_lp = {"tokens": ["w7"], "token_logprobs": [-0.1], "top_logprobs": [{"w7": -0.1}], "text_offset": [0]}
    d_lp = {"tokens": ["w8", "w9"], "token_logprobs": [-0.2, -0.3], "top_logprobs": [{}, {}], "text_offset": [0, 2]}
    body = {"prompt": "w5 w6", "max_tokens": 3, "logprobs": 1, "return_token_ids": True}
    first = ft.read_first_token(COMPLETIONS, body, p_completion(text=" w7", logprobs=p_lp))
    joined = ft.joined_answer(first, d_completion(finish="length", logprobs=d_lp))
    choice = joined["choices"][0]
    assert choice["text"] == " w7 w8 w9" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [7, 8, 9] and choice["prompt_token_ids"] == [5, 6]
    assert choice["logprobs"]["text_offset"] == [0, 2, 4] and choice["logprobs"]["tokens"] == ["w7", "w8", "w9"]
    assert joined["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert joined["id"] == "cmpl-p" and "kv_transfer_params" not in joined
    plain = ft.joined_answer(ft.read_first_token(COMPLETIONS, {"prompt": "w5"}, p_completion()), d_completion())
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    assert ft.joined_answer(first, {"choices": [{"message": {}}]}) is None


def test_the_joined_chat_answer_keeps_chat_s_shape():
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}
    first = ft.read_first_token(CHAT, body, p_chat(text="w7"))
    joined = ft.joined_answer(first, d_completion(text=" w8 w9", finish="stop"))
    assert joined["object"] == "chat.completion" and joined["choices"][0]["message"]["content"] == "w7 w8 w9"
    assert joined["choices"][0]["message"]["role"] == "assistant" and joined["choices"][0]["finish_reason"] == "stop"
    assert "prompt_token_ids" not in joined and joined["usage"]["completion_tokens"] == 3


def events(chunks: list[bytes]) -> list:
    out = []
    for chunk in chunks:
        data = chunk.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_continued_chat_stream_opens_with_the_role_then_p_s_token_and_closes_with_one_usage():
    body = {"messages": [{"role": "user", "content": "w5"}], "stream": True, "stream_options": {"include_usage": True}}
    first = ft.read_first_token(CHAT, body, p_chat(text="w7"))
    stream = ft.ContinuedStream(first, body)
    opening = events(stream.opening())
    assert opening[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening[1]["choices"][0]["delta"] == {"content": "w7"} and opening[1]["object"] == "chat.completion.chunk"
    middle = events([stream.rewrite({"id": "cmpl-d", "created": 5, "choices": [
        {"index": 0, "text": " w8", "finish_reason": "stop", "stop_reason": None, "token_ids": [8]}]})])
    assert middle[0]["id"] == "chatcmpl-p" and middle[0]["created"] == 100
    assert middle[0]["choices"][0]["delta"] == {"content": " w8"} and "token_ids" not in middle[0]["choices"][0]
    assert stream.rewrite({"id": "cmpl-d", "choices": [], "usage": {"completion_tokens": 1}}) is None
    closing = events(stream.closing({"prompt_tokens": 3, "completion_tokens": 1}))
    assert closing[0]["usage"]["completion_tokens"] == 2 and closing[0]["choices"] == [] and closing[-1] == "[DONE]"


def test_a_completion_stream_moves_d_s_offsets_and_a_stream_ended_on_p_closes_at_once():
    body = {"prompt": "w5", "stream": True, "max_tokens": 1}
    first = ft.read_first_token(COMPLETIONS, body, p_completion(text=" w7"))
    assert first.ends
    opened = events(ft.ContinuedStream(first, body).opening())
    assert opened[0]["choices"][0]["text"] == " w7" and opened[0]["choices"][0]["finish_reason"] == "length"
    assert opened[-1] == "[DONE]" and len(opened) == 2  # no usage chunk: the client did not ask
    going = ft.read_first_token(COMPLETIONS, {"prompt": "w5", "max_tokens": 4}, p_completion(text=" w7"))
    chunk = events([ft.ContinuedStream(going, {}).rewrite(
        {"choices": [{"text": " w8", "logprobs": {"text_offset": [0], "tokens": [" w8"]}}]})])[0]
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [3]


@pytest.mark.parametrize("spaced", [False, True])
def test_d_s_chunks_after_the_first_are_its_bytes_with_p_s_id_and_created(spaced):
    """The fast path: D's own bytes with P's id and `created` (whatever JSON spacing D uses); the
    first chunk (its prompt token ids), the usage chunk and errors are decoded."""

    def sse(payload: dict) -> bytes:
        return b"data: " + (json.dumps(payload) if spaced else json.dumps(payload, separators=(",", ":"))).encode()

    body = {"prompt": "w5", "max_tokens": 4, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    stream = ft.ContinuedStream(ft.read_first_token(COMPLETIONS, body, p_completion(text=" w7")), body)
    first, payload = stream.rewrite_event(sse({"id": "cmpl-d", "created": 200, "choices": [
        {"index": 0, "text": " w8", "token_ids": [8], "prompt_token_ids": [5, 6, 7], "finish_reason": None}]}))
    assert payload is not None and events([first])[0]["choices"][0]["token_ids"] == [8]
    assert "prompt_token_ids" not in events([first])[0]["choices"][0]
    later, payload = stream.rewrite_event(sse({"id": "cmpl-d", "created": 201, "choices": [
        {"index": 0, "text": " w9 cmpl-d", "token_ids": [9], "finish_reason": "length"}]}))
    assert payload is None  # not decoded
    chunk = events([later])[0]
    assert chunk["id"] == "cmpl-p" and chunk["created"] == 100 and chunk["choices"][0]["text"] == " w9 cmpl-d"
    usage, payload = stream.rewrite_event(sse({"id": "cmpl-d", "created": 201, "choices": [],
                                               "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    assert usage is None and payload["usage"]["completion_tokens"] == 2
    error, payload = stream.rewrite_event(sse({"error": {"message": "boom"}}))
    assert error is None and payload["error"]["message"] == "boom"
