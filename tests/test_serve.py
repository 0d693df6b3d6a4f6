"""serve.py and the Python API: real openai / httpx clients against servers on 127.0.0.1 (tiny models, CPU)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from starlette.requests import ClientDisconnect

from jobs.serve import background_server, build_app
from jobs.serve_engine import ServeEngine
from models.tiny import build_tiny
from sample.compat import block_diffusion_generate
from sample.generate import generate
from sample.params import SamplingParams
from tests.test_sampler_utils import sharp_tiny

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = dict(max_tokens=16, temperature=0.0, block_size=4, denoising_steps=4,
                remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.9)
QUESTIONS = [f"What is {a} + {b}?" for a in range(4) for b in range(4)]


@pytest.fixture(scope="module")
def sdar(demo_tokenizer):
    # a sharpened head: confidences spread over (0, 1), so batched and single runs pick the same tokens on any CPU
    return sharp_tiny("sdar", demo_tokenizer)


@pytest.fixture(scope="module")
def server(sdar):
    """(openai client, base URL, engine) of a server over the tiny SDAR model."""
    engine = ServeEngine(sdar, SamplingParams(**DEFAULTS), max_batch=8, max_queue=32, max_prompt_tokens=64)
    with background_server(build_app(engine, "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60), url, engine
    engine.close()


def offline(adapter, prompt_ids, **settings):
    """Token ids and text (the stop token left out) of offline ``generate`` with the server's defaults."""
    traj = generate(adapter, [prompt_ids], SamplingParams(**(DEFAULTS | settings)), progress=False)[0]
    ids = traj.response_ids[:-1] if traj.finish_reason in ("eos", "stop") else traj.response_ids
    return traj, adapter.tokenizer.decode(ids, skip_special_tokens=False)


def chat(client, question, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}], **kw)


def streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons per choice index of a stream, and its last chunk."""
    texts, reasons, last = {}, {}, None
    for chunk in stream:
        last = chunk
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, last


def test_chat_and_completions_equal_offline_generate(server, sdar):
    client, _, _ = server
    ids = sdar.encode_chat(QUESTIONS[0])
    traj, text = offline(sdar, ids)
    out = chat(client, QUESTIONS[0], extra_body={"return_step_map": True})
    choice = out.choices[0]
    assert choice.message.content == text
    assert choice.token_ids == traj.response_ids and choice.step_map == traj.step_map  # token for token
    assert choice.finish_reason == ("length" if traj.finish_reason == "length" else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(traj.response_ids))

    texts, reasons, last = streamed(chat(client, QUESTIONS[0], stream=True, stream_options={"include_usage": True}))
    assert texts == {0: text} and reasons == {0: choice.finish_reason}
    assert last.usage.completion_tokens == len(traj.response_ids)

    prompt = "2 + 3 ="
    _, raw_text = offline(sdar, sdar.tokenizer.encode(prompt, add_special_tokens=False), max_tokens=10)
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=10).choices[0].text == raw_text
    texts, _, _ = streamed(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True))
    assert texts == {0: raw_text}


def test_stream_sends_each_block_as_it_is_committed(server, sdar):
    _, url, _ = server
    _, text = offline(sdar, sdar.encode_chat(QUESTIONS[1]), max_tokens=24)
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 24,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    pieces = [c["delta"].get("content") for line in lines[:-1] for c in json.loads(line[6:])["choices"]]
    pieces = [p for p in pieces if p]
    assert "".join(pieces) == text and len(pieces) > 1  # several blocks, not one piece at the end


def test_n_choices_and_seeded_sampling(server, sdar):
    client, _, _ = server
    _, text = offline(sdar, sdar.encode_chat(QUESTIONS[2]))
    out = chat(client, QUESTIONS[2], n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content == text for c in out.choices)
    texts, reasons, _ = streamed(chat(client, QUESTIONS[2], n=2, stream=True))
    assert texts == {0: text, 1: text} and set(reasons) == {0, 1}

    ids = sdar.encode_chat(QUESTIONS[3])
    expected = generate(sdar, [ids] * 2, SamplingParams(**(DEFAULTS | {"temperature": 1.0, "seed": 7})),
                        progress=False)
    out = chat(client, QUESTIONS[3], n=2, temperature=1.0, seed=7, extra_body={"return_step_map": True})
    assert [c.token_ids for c in out.choices] == [t.response_ids for t in expected]


def test_seeded_requests_running_together_each_get_generates_tokens(server, sdar):
    """Two requests with the same seed, admitted in the same step, each sample as generate() with that seed alone
    (sharing one generator would interleave their draws)."""
    import asyncio

    _, _, engine = server
    ids = sdar.encode_chat(QUESTIONS[6])
    params = SamplingParams(**(DEFAULTS | {"temperature": 1.0, "seed": 11}))
    expected = generate(sdar, [ids], params, progress=False)[0].response_ids

    async def both() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        with engine._cond:  # both pending before the driver's next step: they would share a batch
            reqs = [engine.submit(f"r{i}", [ids], 1, params, [], False, True, loop) for i in range(2)]
        out = []
        for req in reqs:
            while (event := await req.queue.get())[0] != "done":
                pass
            out.append(event[2].token_ids)
        return out

    assert asyncio.run(both()) == [expected, expected]


def test_stop_strings_cut_the_text(server, sdar):
    client, _, _ = server
    _, text = offline(sdar, sdar.encode_chat(QUESTIONS[4]))
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = text[:text.find(stop)]
    out = chat(client, QUESTIONS[4], stop=[stop, "never-there"])
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    assert 0 < out.usage.completion_tokens <= len(sdar.tokenizer.encode(text, add_special_tokens=False)) + 1
    texts, reasons, _ = streamed(chat(client, QUESTIONS[4], stop=stop, stream=True))
    assert texts == {0: want} and reasons == {0: "stop"}
    # the decoding order of the tokens through the stop string, as a finished choice carries its own
    traj, _ = offline(sdar, sdar.encode_chat(QUESTIONS[4]))
    out = chat(client, QUESTIONS[4], stop=[stop], extra_body={"return_step_map": True})
    n = out.usage.completion_tokens
    assert out.choices[0].token_ids == traj.response_ids[:n] and out.choices[0].step_map == traj.step_map[:n]


def test_sixteen_concurrent_clients(server, sdar):
    client, _, _ = server
    expected = [offline(sdar, sdar.encode_chat(q))[1] for q in QUESTIONS]

    def ask(i):
        if i % 2:
            return streamed(chat(client, QUESTIONS[i], stream=True))[0][0]
        return chat(client, QUESTIONS[i]).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == expected


def test_logprobs_are_the_samplers_record_of_each_token(server, sdar):
    client, _, _ = server
    traj, text = offline(sdar, sdar.encode_chat(QUESTIONS[5]))
    ids = traj.response_ids[:-1] if traj.finish_reason in ("eos", "stop") else traj.response_ids
    out = chat(client, QUESTIONS[5], logprobs=True).choices[0]
    content = out.logprobs.content
    # each token's text is its own decode (U+FFFD for part of a character, as OpenAI's); its bytes rebuild the text
    assert [c.token for c in content] == [sdar.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace") == text  # a random model's stray bytes
    assert [c.logprob for c in content] == pytest.approx(traj.logprobs[:len(ids)], abs=1e-4)
    assert all(c.logprob <= 0 and c.top_logprobs == [] for c in content)
    assert chat(client, QUESTIONS[5]).choices[0].logprobs is None  # only when asked

    last = None
    for chunk in chat(client, QUESTIONS[5], logprobs=True, stream=True):
        last = chunk.choices[0] if chunk.choices and chunk.choices[0].finish_reason else last
    assert [c.logprob for c in last.logprobs.content] == pytest.approx([c.logprob for c in content], abs=1e-6)

    prompt = "4 + 4 ="
    raw, raw_text = offline(sdar, sdar.tokenizer.encode(prompt, add_special_tokens=False), max_tokens=10)
    lp = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=0).choices[0].logprobs
    each = [sdar.tokenizer.decode([i], skip_special_tokens=False) for i in raw.response_ids]
    assert lp.tokens == each[:len(lp.tokens)]
    assert len(lp.tokens) == len(raw.response_ids) - (raw.finish_reason in ("eos", "stop")) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.top_logprobs is None
    # where each token starts in the text: the length of the text before it wherever that text ends on a whole
    # character (a token holding part of a character adds nothing until the token that completes it)
    ids = raw.response_ids[:len(lp.tokens)]
    before = [sdar.tokenizer.decode(ids[:i], skip_special_tokens=False) for i in range(len(ids))]
    whole = [i for i, b in enumerate(before) if raw_text.startswith(b) and not b.endswith("\ufffd")]
    assert len(whole) >= len(ids) // 2 and [lp.text_offset[i] for i in whole] == [len(before[i]) for i in whole]
    assert lp.text_offset[-1] <= len(raw_text)
    assert lp.token_logprobs == pytest.approx(raw.logprobs[:len(lp.tokens)], abs=1e-4)

    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = chat(client, QUESTIONS[5], stop=[stop], logprobs=True).choices[0]
    tokens = "".join(c.token for c in cut.logprobs.content)
    assert tokens.startswith(cut.message.content) and len(tokens) < len(cut.message.content) + len(stop) + 8

    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(client, "hi", logprobs=True, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs=0"):
        client.completions.create(model="tiny", prompt="hi", logprobs=3)


def test_logprob_bytes_rebuild_characters_that_span_tokens(demo_tokenizer):
    """OpenAI's ``bytes`` of a chat log-prob: a token holding part of a UTF-8 character carries those bytes (decoded
    alone it is U+FFFD), so the tokens' bytes join to the text; a special token gives its text."""
    from jobs.serve import token_bytes

    text = "a€ 中 é"
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    raw = token_bytes(demo_tokenizer, ids)
    assert bytes(b for piece in raw for b in piece) == text.encode()
    partial = [piece for t, piece in zip(ids, raw) if demo_tokenizer.decode([t]) == "\ufffd"]
    assert partial and all(piece != list("\ufffd".encode()) for piece in partial)
    eos = demo_tokenizer.eos_token_id
    assert token_bytes(demo_tokenizer, [eos]) == [list(demo_tokenizer.decode([eos]).encode())]


def test_bad_requests_get_4xx_naming_the_field(server):
    client, url, _ = server
    with pytest.raises(openai.NotFoundError, match="model"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "hi", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        chat(client, "word " * 200)
    with pytest.raises(openai.BadRequestError, match="remasking_strategy"):
        chat(client, "hi", extra_body={"remasking_strategy": "nope"})
    with pytest.raises(openai.BadRequestError, match="denoising_steps"):
        chat(client, "hi", extra_body={"denoising_steps": 8})  # more steps than the block has tokens
    with pytest.raises(openai.BadRequestError, match="block_lenght"):
        chat(client, "hi", extra_body={"block_lenght": 8})
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="hi", echo=True)
    with pytest.raises(openai.BadRequestError, match="seed"):
        chat(client, "hi", seed=2**64)  # beyond what a generator takes
    with pytest.raises(openai.BadRequestError, match=r"41 sequences.*at most 40") as err:
        chat(client, "hi", n=41)  # more than the server ever runs at once: no retry helps
    assert err.value.body["param"] == "n"
    resp = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [', timeout=10,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    for body, kind in ((b'{"model": "tiny", "prompt": "hi"}', "text/plain"), (b'["tiny"]', "application/json")):
        resp = httpx.post(f"{url}/v1/completions", content=body, timeout=10, headers={"content-type": kind})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == (
            "the request body must be a JSON object (sent with Content-Type: application/json)")
    resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    for empty, message in (("", "prompt must not be empty"), ([[]], "prompt must not be empty"),
                           (["a", ""], "prompt 1 is empty")):
        with pytest.raises(openai.BadRequestError, match=message) as err:
            client.completions.create(model="tiny", prompt=empty, max_tokens=4)
        assert err.value.body["param"] == "prompt"
    for method, route, status in (("GET", "/v1/nowhere", 404), ("DELETE", "/v1/models", 405)):
        resp = httpx.request(method, f"{url}{route}", timeout=10)
        error = resp.json()["error"]
        assert resp.status_code == status and error["type"] == "invalid_request_error" and error["message"]
    assert resp.headers["allow"] == "GET"  # the 405 keeps its Allow header
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    assert chat(client, "still alive?", max_tokens=4).choices[0].message.content is not None


def test_disconnected_client_frees_its_slot(sdar):
    never_stops = SamplingParams(**DEFAULTS, ignore_eos=True, stop_token_ids=[])  # runs 3000 tokens unless cancelled
    engine = ServeEngine(sdar, never_stops, max_batch=1, max_queue=0)
    try:
        with background_server(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            stream = chat(client, QUESTIONS[5], max_tokens=3000, stream=True)
            next(iter(stream))
            with pytest.raises(openai.APIStatusError) as full:
                chat(client, QUESTIONS[6], max_tokens=4)
            assert full.value.status_code == 503
            stream.close()
            deadline = time.monotonic() + 60
            while httpx.get(f"{url}/health", timeout=10).json()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(f"{url}/health", timeout=10).json()["running"] == 0  # the slot was freed
            _, text = offline(sdar, sdar.encode_chat(QUESTIONS[6]), ignore_eos=True, stop_token_ids=[], max_tokens=4)
            assert chat(client, QUESTIONS[6], max_tokens=4).choices[0].message.content == text
    finally:
        engine.close()


def test_api_key_and_models(sdar):
    engine = ServeEngine(sdar, SamplingParams(**DEFAULTS))
    try:
        with background_server(build_app(engine, "tiny", api_key="secret")) as url:
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["tiny"]
            assert client.models.retrieve("tiny").id == "tiny"
            with pytest.raises(openai.NotFoundError) as err:
                client.models.retrieve("other")
            assert err.value.body["code"] == "model_not_found"
            for body in (b'{"model": "tiny", "messages": [', b'{"model": "other"}'):  # the key before the body
                resp = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=10,
                                  headers={"content-type": "application/json"})
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # no key needed
            with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream true"):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream_options={"include_usage": True})
            asked = [{"role": "user", "content": QUESTIONS[0]}]
            as_system, as_developer = (client.chat.completions.create(
                model="tiny", messages=[{"role": role, "content": "Be brief."}, *asked], max_tokens=6, temperature=0)
                for role in ("system", "developer"))
            assert as_developer.choices[0].message.content == as_system.choices[0].message.content
            assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    finally:
        engine.close()


def test_a_request_after_shutdown_is_refused_at_once(sdar):
    from jobs.serve_engine import RequestError

    engine = ServeEngine(sdar, SamplingParams(**DEFAULTS))
    app = build_app(engine, "tiny")
    engine.close()
    with background_server(app) as url:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "shutting down"
        resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                          timeout=10)
        assert resp.status_code == 503 and resp.json()["error"] == {
            "message": "the server is shutting down", "type": "server_error", "param": None, "code": "server_busy"}
    loop = asyncio.new_event_loop()
    with pytest.raises(RequestError, match="shutting down"):
        engine.submit("r", [[5]], 1, SamplingParams(**DEFAULTS), [], False, False, loop)
    loop.close()


def test_fixed_capacity_cache_group_serves_on_cpu(sdar):
    """``cuda_graphs=true`` decodes on the fixed-capacity KV cache (its CPU path too). A server's settings group has
    no response budget of its own, so the cache reserves what memory allows instead of the unbounded budget."""
    engine = ServeEngine(sdar, SamplingParams(**DEFAULTS, cuda_graphs=True), max_batch=4, max_queue=4)
    try:
        with background_server(build_app(engine, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            for question in QUESTIONS[:2]:
                _, text = offline(sdar, sdar.encode_chat(question))
                assert chat(client, question).choices[0].message.content == text
    finally:
        engine.close()


@pytest.mark.parametrize("base", ["sdar", "sdar-fixed-capacity", "dream"])
def test_a_failed_admission_fails_only_the_newcomers(demo_tokenizer, monkeypatch, base):
    """The admission raises after the sampler took the newcomers' cache rows (block) or joined its cache (full):
    it puts the batch back, the newcomers' request errs, and the request already running decodes on exactly as
    offline ``generate`` decodes it alone."""
    from jobs.serve_engine import compute_precision, packed_projections

    fixed = base == "sdar-fixed-capacity"  # the fixed-capacity cache (cuda_graphs=true; its CPU path here)
    base = base.removesuffix("-fixed-capacity")
    adapter = build_tiny(base, demo_tokenizer)
    params = SamplingParams(**DEFAULTS, cuda_graphs=fixed) if base == "sdar" else SamplingParams(
        max_tokens=16, temperature=0.0, block_size=4)
    engine = ServeEngine(adapter, params, driver_thread=False)
    loop = asyncio.new_event_loop()

    def step() -> None:
        with engine._cond:
            busy = engine._between_steps()
        for group in busy:
            engine._step(group)

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    first, second = adapter.encode_chat(QUESTIONS[1]), adapter.encode_chat(QUESTIONS[2])
    with compute_precision(adapter, params), torch.inference_mode(), packed_projections(adapter.model):
        running = engine.submit("a", [first], 1, params, [], False, True, loop)
        step()
        with monkeypatch.context() as patch:
            if base == "sdar":
                patch.setattr("sample.block_sampler.BlockSampler._append_rows", fails)
            else:
                patch.setattr("sample.full_sampler.append_rows", fails)
            newcomer = engine.submit("b", [second], 1, params, [], False, True, loop)
            step()
        while engine._choices:
            step()
    loop.run_until_complete(asyncio.sleep(0))  # the events posted to the loop
    events = {req.id: [req.queue.get_nowait() for _ in range(req.queue.qsize())] for req in (running, newcomer)}
    loop.close()
    engine.close()
    assert events["b"] == [("error", 0, "sampling failed: RuntimeError: out of memory (simulated)")]
    (kind, _, result), = events["a"]
    alone = generate(adapter, [first], params, progress=False)[0]
    assert kind == "done" and result.token_ids == alone.response_ids and result.step_map == alone.step_map


def test_a_failed_admission_fails_its_request_and_the_server_goes_on(demo_tokenizer, monkeypatch):
    """A sampler that raises while admitting sequences (out of memory, say) ends their requests with an error; the
    next request is served as usual."""
    from sample.full_sampler import WindowCachedFullSampler

    dream = build_tiny("dream", demo_tokenizer)
    real, calls = WindowCachedFullSampler._admit_cache, []

    def fails_once(self, n):
        calls.append(n)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return real(self, n)

    monkeypatch.setattr(WindowCachedFullSampler, "_admit_cache", fails_once)
    engine = ServeEngine(dream, SamplingParams(max_tokens=8, temperature=0.0, block_size=4))
    try:
        with background_server(build_app(engine, "tiny-dream")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            ask = dict(model="tiny-dream", messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.InternalServerError, match="out of memory"):
                client.chat.completions.create(**ask)
            traj = generate(dream, [dream.encode_chat("hi")], engine.defaults, progress=False)[0]
            ids = traj.response_ids[:-1] if traj.finish_reason in ("eos", "stop") else traj.response_ids
            want = dream.tokenizer.decode(ids, skip_special_tokens=False)
            assert client.chat.completions.create(**ask).choices[0].message.content == want  # the next one is served
    finally:
        engine.close()


def test_a_full_attention_canvas_over_the_positions_blames_max_tokens(demo_tokenizer):
    from jobs.serve_engine import RequestError
    from tests.test_sampler_utils import sharp_tiny

    llada = sharp_tiny("llada", demo_tokenizer, seed=2, max_position_embeddings=40)
    engine = ServeEngine(llada, SamplingParams(max_tokens=8, temperature=0.0, block_size=32), driver_thread=False)
    assert engine.request_params({"max_tokens": 32}).max_tokens == 32  # one block: fits
    with pytest.raises(RequestError) as err:  # 33 tokens take two blocks of 32: 64 positions, no prompt fits
        engine.request_params({"max_tokens": 33})
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    assert "max_tokens 33 (whole blocks of 32: 64) is more than the model's 40 positions" in str(err.value)


def test_full_attention_model_is_served(demo_tokenizer):
    dream = build_tiny("dream", demo_tokenizer)
    defaults = dict(max_tokens=8, temperature=0.0, block_size=4)
    engine = ServeEngine(dream, SamplingParams(**defaults))
    try:
        with background_server(build_app(engine, "tiny-dream")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            traj = generate(dream, [dream.encode_chat("hi")], SamplingParams(**defaults), progress=False)[0]
            out = client.chat.completions.create(model="tiny-dream", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"return_step_map": True})
            assert out.choices[0].token_ids == traj.response_ids
            texts, _, _ = streamed(client.chat.completions.create(
                model="tiny-dream", messages=[{"role": "user", "content": "hi"}], stream=True))
            assert texts == {0: out.choices[0].message.content}
            # its complete blocks stream as they finish, as a block model's do
            long = generate(dream, [dream.encode_chat(QUESTIONS[1])], SamplingParams(**(defaults | {
                "max_tokens": 16})), progress=False)[0]
            assert len(long.response_ids) > 8  # three blocks or more: two sent before the end
            body = {"model": "tiny-dream", "messages": [{"role": "user", "content": QUESTIONS[1]}],
                    "max_tokens": 16, "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                lines = [line for line in resp.iter_lines() if line]
            pieces = [c["delta"].get("content") for line in lines[:-1] for c in json.loads(line[6:])["choices"]]
            assert len([p for p in pieces if p]) > 1
            # a stop string inside a complete block ends the row before the sampler does (read from committed())
            text = dream.tokenizer.decode(long.response_ids[:-1] if long.finish_reason != "length"
                                          else long.response_ids, skip_special_tokens=False)
            stop = dream.tokenizer.decode(long.response_ids[5:7], skip_special_tokens=False)
            assert stop.strip() and text.find(stop) >= 0
            out = client.chat.completions.create(model="tiny-dream", max_tokens=16, stop=[stop],
                                                 messages=[{"role": "user", "content": QUESTIONS[1]}])
            assert out.choices[0].message.content == text[:text.find(stop)]
            assert out.choices[0].finish_reason == "stop"
            out = client.chat.completions.create(model="tiny-dream", max_tokens=16, stop=[stop],
                                                 messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                 extra_body={"return_step_map": True})
            n = out.usage.completion_tokens
            assert out.choices[0].token_ids == long.response_ids[:n] and out.choices[0].step_map == long.step_map[:n]
            # a full-attention canvas is sized by max_tokens: beyond the positions it is refused at once
            with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
                client.chat.completions.create(model="tiny-dream", max_tokens=10**9,
                                               messages=[{"role": "user", "content": "hi"}])
            assert err.value.body["param"] == "max_tokens"
    finally:
        engine.close()


def test_block_diffusion_generate_matches_the_sampler(sdar):
    ids = sdar.encode_chat(QUESTIONS[7])
    settings = dict(block_size=4, denoising_steps=4, temperature=1.0, top_k=0, top_p=0.9,
                    remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.9, seed=3)
    out = block_diffusion_generate(sdar.model, {"input_ids": torch.tensor([ids])}, mask_id=sdar.mask_id,
                                   gen_length=10, block_length=4, denoising_steps=4, temperature=1.0, top_k=0,
                                   top_p=0.9, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9,
                                   seed=3)
    budget = -(-(len(ids) + 10) // 4) * 4 - len(ids)  # to the end of the block holding prompt + gen_length
    traj = generate(sdar, [ids], SamplingParams(max_tokens=budget, ignore_eos=True, stop_token_ids=[], **settings),
                    progress=False)[0]
    assert out.shape == (1, len(ids) + budget)
    assert out[0].tolist() == ids + traj.response_ids
    again = block_diffusion_generate(sdar, torch.tensor(ids), mask_id=sdar.mask_id, gen_length=10, temperature=1.0,
                                     top_p=0.9, confidence_threshold=0.9, seed=3)  # the other defaults: the card's
    assert torch.equal(again, out)
    # the reference function's default (Gen-Verse/dLLM-RL generate.py); the card passes 0.9
    assert inspect.signature(block_diffusion_generate).parameters["confidence_threshold"].default == 0.85
    rows = sdar.model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=f"mask_id 151669 is outside this model's vocabulary \\(ids 0 to {rows - 1}"):
        block_diffusion_generate(sdar.model, torch.tensor(ids), mask_id=151669)  # the card's id on another model


def test_serve_entry_reports_config_errors_in_one_line(capsys):
    import serve

    assert serve.config_argv(["config=x.yaml", "--api-key", "k", "--port=9"]) == \
        ["config=x.yaml", "server.api_key=k", "server.port=9"]
    with pytest.raises(SystemExit) as exit_:
        serve.main(["config=configs/demo/serve_demo.yaml", "server.port=-1"])
    assert exit_.value.code == 2 and "server.port" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_py_answers_then_stops_on_a_signal_and_ends_open_streams(tmp_path, sdar, sig):
    """serve.py as users run it: the engine on the main thread, HTTP on another. It answers; a signal during an
    open stream ends that stream with an error event and the process exits with the signal's code and one line."""
    sdar.model.save_pretrained(tmp_path / "tiny")
    sdar.tokenizer.save_pretrained(tmp_path / "tiny")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "serve.py", "config=configs/demo/serve_demo.yaml", f"model.pretrained_model={tmp_path}/tiny",
           "server.port=0", "rollout.ignore_eos=true", "rollout.stop_token_ids=[]"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # nohup: inherited ignored
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving"), line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="none")
        done = client.completions.create(model="tiny", prompt="What is 2 + 3?", max_tokens=8, temperature=0.0)
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
        with httpx.stream("POST", f"{url}/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Count.", "max_tokens": 4000, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")  # the stream is open and producing
            proc.send_signal(sig)
            rest = [ln for ln in lines if ln]
        assert any('"the server is shutting down"' in ln for ln in rest), rest[-3:]
        assert proc.wait(timeout=30) == (130 if sig == signal.SIGINT else 143)
        assert "the server stopped" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_client_gone_before_its_stream_starts_is_cancelled(sdar):
    """A client that leaves before the first byte of its stream (the server's first send fails) never starts the
    event generator, whose own cleanup then never runs: the response itself cancels the request."""
    import asyncio

    never_stops = SamplingParams(**DEFAULTS, ignore_eos=True, stop_token_ids=[])
    engine = ServeEngine(sdar, never_stops, max_batch=1, max_queue=0)
    app = build_app(engine, "tiny")
    body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 3000,
                       "messages": [{"role": "user", "content": QUESTIONS[5]}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000)}
    sent: list[str] = []
    cancelled: list[str] = []
    engine_cancel = engine.cancel
    engine.cancel = lambda req: (cancelled.append(req.id), engine_cancel(req))  # the request still runs meanwhile

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):  # the socket is gone: the first send fails as uvicorn's does
        sent.append(message["type"])
        raise OSError("connection reset by peer")

    try:
        with pytest.raises(ClientDisconnect):  # what reaches uvicorn
            asyncio.run(app(scope, receive, send))
        assert sent == ["http.response.start"] and len(cancelled) == 1  # before the call returned
        deadline = time.monotonic() + 10
        while sum(engine.load()[k] for k in ("running", "waiting")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.load()["running"] == engine.load()["waiting"] == 0
    finally:
        engine.close()


def test_a_server_prompt_limit_no_request_could_use_is_refused_in_one_line(sdar):
    from core.loader import ConfigError
    from jobs.serve import check_prompt_limit

    limit = sdar.position_limit
    check_prompt_limit(None, limit)
    check_prompt_limit(limit - 1, limit)  # a prompt of limit - 1 tokens leaves one position for a token
    check_prompt_limit(10**6, None)  # a model without a position limit
    with pytest.raises(ConfigError, match=f"key 'server.max_prompt_tokens': {limit} leaves no room for a generated "
                                          f"token below the model's {limit} positions"):
        check_prompt_limit(limit, limit)
