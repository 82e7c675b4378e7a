"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP against a
server started on 127.0.0.1: exactness under concurrency (each token's log-probability and top
alternatives against the request replayed alone), streaming, chat, disconnects, malformed requests,
the API key, back-pressure and metrics. Synchronisation is by events, never by sleeping."""

import concurrent.futures
import json
import queue
import random
import re
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from _models import decisive_model  # noqa: E402
from _reference import sentencepiece_tokenizer  # noqa: E402

from looplm.config import ModelConfig  # noqa: E402
from looplm.data import ByteTokenizer  # noqa: E402
from looplm.infer import extend, make_cache  # noqa: E402
from looplm.infer.generate import DepthRule, SamplingConfig, generate  # noqa: E402
from looplm.infer.speculative import Speculation  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402
from looplm.serve import Engine, EngineConfig, Request, Token  # noqa: E402
from looplm.serve.api import create_app  # noqa: E402
from looplm.serve.protocol import CHAT_STOP  # noqa: E402

TOK = ByteTokenizer()
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread
NAME = "tiny-looped"


@pytest.fixture(scope="module")
def model():
    return decisive_model(TOK.vocab_size, max_depth=8)


@contextmanager
def serving(engine: Engine, api_key: str | None = None):
    """A uvicorn server in a thread on a socket bound here to port 0 of 127.0.0.1 (the kernel picks a
    free port: no race) and already listening, so a request waits in its backlog until the server
    accepts it; yields the base URL, then stops the server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME, api_key=api_key), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _client(url: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _alone(model, prompt: str, depth: int, max_tokens: int, mode: str = "terminal", stop=()) -> str:
    sampling = SamplingConfig(max_new_tokens=max_tokens, stop=tuple(stop))
    return generate(model, TOK, [prompt], DepthRule(depth), cache=mode, sampling=sampling)[0]


@torch.no_grad()
def _greedy_replay(model, prompt: str, depth: int, max_tokens: int, mode: str) -> list[torch.Tensor]:
    """Log-probabilities of each step of the prompt decoded greedily alone (example id 0, prefill and
    decode at `depth`), up to `max_tokens` tokens or an end of text (which is not a token of the reply)."""
    ids = TOK.encode(prompt)
    cache = make_cache(mode, model.cfg, 1, len(ids) + max_tokens, depth)
    logits = extend(model, torch.tensor([ids]), cache, depth).logits[0, -1]
    steps = []
    while True:
        lp = logits.log_softmax(-1)
        if int(lp.argmax()) == TOK.eos_id:
            return steps
        steps.append(lp)
        if len(steps) == max_tokens:
            return steps
        logits = extend(model, lp.argmax().view(1, 1), cache, depth).logits[0, -1]


def assert_logprobs_equal(logprobs, ref: list[torch.Tensor], k: int) -> None:
    """A completion choice's `logprobs` block against the replay: the same tokens, each log-probability
    to 1e-5, and the top-k keyed by each token's own spelling (`_spelled`: a byte of a multi-byte
    character as `bytes:\\xNN`, so no two alternatives share a key), each with its own log-probability."""
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ref)
    for text, chosen, top, lp in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, ref):
        assert text == _spelled(int(lp.argmax()))[0] and abs(chosen - float(lp.max())) <= 1e-5
        best = lp.topk(k)
        want = {_spelled(i)[0]: v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        assert set(top) == set(want)
        for key, value in top.items():
            assert abs(value - want[key]) <= 1e-5, key


def test_openai_client_completions_chat_and_streaming(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=3))
    with serving(engine) as url:
        client = _client(url)
        assert [m.id for m in client.models.list().data] == [NAME]
        want = _alone(model, "abc", 3, 12)
        done = client.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0)
        assert done.choices[0].text == want and done.choices[0].finish_reason in ("stop", "length")
        assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens >= 1
        assert done.usage.model_extra["mean_decode_depth"] == 3.0
        deep = client.completions.create(
            model=NAME, prompt="abc", max_tokens=12, temperature=0, extra_body={"depth": 5}
        )
        assert deep.choices[0].text == _alone(model, "abc", 5, 12)
        stream = client.completions.create(
            model=NAME, prompt="abc", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
        echoed = client.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0, echo=True)
        assert echoed.choices[0].text == "abc" + want
        streamed = client.completions.create(
            model=NAME, prompt="abc", max_tokens=12, temperature=0, echo=True, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "abc" + want

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        prompt = "system: be brief\nuser: hi\nassistant:"  # the documented template
        want_chat = _alone(model, prompt, 3, 10, stop=CHAT_STOP)
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
        assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
        pieces = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want_chat
        unbounded = client.chat.completions.create(model=NAME, messages=messages, temperature=0)  # no max_tokens
        n_prompt = len(TOK.encode(prompt))
        assert unbounded.usage.prompt_tokens == n_prompt
        assert unbounded.choices[0].message.content == _alone(model, prompt, 3, 64 - n_prompt + 1, stop=CHAT_STOP)

        two = client.completions.create(model=NAME, prompt=["ab", "cd"], n=2, max_tokens=5, temperature=0, logprobs=2)
        assert [c.index for c in two.choices] == [0, 1, 2, 3]
        assert [c.text for c in two.choices] == [_alone(model, p, 3, 5) for p in ("ab", "ab", "cd", "cd")]
        lp = two.choices[0].logprobs
        assert 1 <= len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) <= 5
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the top one
            # (top_logprobs is keyed by token text: two byte tokens that decode to U+FFFD share a key)
            assert 1 <= len(top) <= 2 and max(top.values()) <= chosen + 1e-6 and chosen <= 0


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_sixteen_concurrent_requests_match_their_replay_alone(model, mode):
    rng = random.Random(0)
    jobs = [
        ("".join(rng.choice("abcdefgh +=") for _ in range(rng.randint(1, 20))), 1 + i % 4, rng.randint(2, 20))
        for i in range(16)
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=4, max_depth=4, cache=mode))
    with serving(engine) as url:
        client = _client(url)

        def ask(job):
            prompt, depth, n = job
            return client.completions.create(
                model=NAME, prompt=prompt, max_tokens=n, temperature=0, logprobs=2, extra_body={"depth": depth}
            ).choices[0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, jobs))
    for choice, (prompt, depth, n) in zip(got, jobs):
        ref = _greedy_replay(model, prompt, depth, n, mode)
        assert_logprobs_equal(choice.logprobs, ref, 2)
        assert choice.text == TOK.decode([int(lp.argmax()) for lp in ref])
    assert sum(len(c.logprobs.tokens) for c in got) > 100
    assert engine.finished.get("cancelled", 0) == 0


def _observed(engine: Engine) -> tuple[list, threading.Event]:
    """The handles the engine is given from now on, and an event set after each request it finishes."""
    handles, finished = [], threading.Event()
    submit, finish = engine.submit, engine._finish

    def recording_submit(request, sink=None):
        handle = submit(request, sink)
        handles.append(handle)
        return handle

    def recording_finish(*args, **kwargs):
        finish(*args, **kwargs)
        finished.set()

    engine.submit, engine._finish = recording_submit, recording_finish
    return handles, finished


def test_client_disconnect_mid_stream_frees_its_slot(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    steps = threading.Semaphore(1)  # decode steps the engine may take: it waits before the second
    decode = engine._decode

    def gated_decode():
        assert steps.acquire(timeout=60)
        decode()

    engine._decode = gated_decode
    handles, finished = _observed(engine)
    with serving(engine) as url:
        # logprobs: every token gets a chunk (a token whose text is held back would send none)
        body = {"model": NAME, "prompt": "abc", "max_tokens": 50, "temperature": 0, "stream": True, "logprobs": 0}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                seen = 0
                while seen < 2:  # the prefill's token and the one allowed decode step's (one chunk or two:
                    line = next(lines)  # tokens that arrived together are sent as one chunk)
                    if line.startswith("data: "):
                        seen += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                assert engine.pool.running == 1
            assert handles[0]._cancelled.wait(30)  # the server saw the client leave and cancelled
            for _ in range(50):
                steps.release()
            assert finished.wait(30)  # the engine dropped the row at its next step
            assert engine.pool.running == 0 and engine.finished == {"cancelled": 1}
            assert http.get(f"{url}/health").json()["running_sequences"] == 0


def _malformed(n_ctx: int) -> list[tuple[str, object]]:
    """(path, body) pairs that must each get a 4xx; bodies given as str are sent raw."""
    ok = {"model": NAME, "prompt": "ab", "max_tokens": 4}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", "{not json"),
        ("/v1/completions", ""),
        ("/v1/completions", "[1, 2]"),
        ("/v1/chat/completions", '{"messages": '),
        ("/v1/completions", {**ok, "max_tokens": -1}),
        ("/v1/completions", {**ok, "max_tokens": 0}),
        ("/v1/completions", {**ok, "max_tokens": "many"}),
        ("/v1/completions", {**ok, "prompt": 7}),
        ("/v1/completions", {**ok, "prompt": []}),
        ("/v1/completions", {**ok, "prompt": ""}),
        ("/v1/completions", {"model": NAME}),
        ("/v1/completions", {**ok, "model": "gpt-4"}),
        ("/v1/completions", {**ok, "prompt": "x" * n_ctx}),
        ("/v1/completions", {**ok, "max_tokens": n_ctx}),
        ("/v1/completions", {**ok, "depth": 0}),
        ("/v1/completions", {**ok, "depth": 99}),
        ("/v1/completions", {**ok, "depth": "deep"}),
        ("/v1/completions", {**ok, "prefill_depth": 0}),
        ("/v1/completions", {**ok, "exit_tau": -1}),
        ("/v1/completions", {**ok, "exit_tau": 0.1, "min_depth": 9}),
        ("/v1/completions", {**ok, "temperature": -0.5}),
        ("/v1/completions", {**ok, "top_p": 0}),
        ("/v1/completions", {**ok, "top_p": 1.5}),
        ("/v1/completions", {**ok, "top_k": -3}),
        ("/v1/completions", {**ok, "n": 0}),
        ("/v1/completions", {**ok, "n": 1000}),
        ("/v1/completions", {**ok, "stop": ""}),
        ("/v1/completions", {**ok, "stop": ["a", "b", "c", "d", "e"]}),
        ("/v1/completions", {**ok, "logprobs": 50}),
        ("/v1/completions", {**ok, "presence_penalty": 1.0}),
        ("/v1/completions", {**ok, "logit_bias": {"5": 10}}),
        ("/v1/completions", {**ok, "best_of": 3}),
        ("/v1/completions", {**ok, "prompt": [999999]}),
        ("/v1/completions", {**ok, "prompt": [-1]}),
        ("/v1/completions", {**ok, "seed": "s"}),
        ("/v1/completions", {**ok, "suffix": "end"}),
        # not Unicode text (a lone surrogate, which JSON's escapes can spell): was a 500
        ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 1}'),
        ("/v1/completions", '{"prompt": "a", "stop": ["\\udfff"], "max_tokens": 1}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        # OpenAI's types, not converted: was served as 1, False, [1, 0], and with usage
        ("/v1/completions", {**ok, "max_tokens": True}),
        ("/v1/completions", {**ok, "stream": "no"}),
        ("/v1/completions", {**ok, "prompt": [True, False]}),
        ("/v1/completions", {**ok, "stream": True, "stream_options": {"include_usage": "false"}}),
        ("/v1/completions", {**ok, "stream": True, "stream_options": {"bogus": 1}}),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}),
        ("/v1/completions", '{"prompt": "a", "max_tokens": 1, "temperature": NaN}'),
        ("/v1/chat/completions", {**chat, "messages": []}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "robot", "content": "hi"}]}),
        ("/v1/chat/completions", {**chat, "messages": [{"content": "hi"}]}),
        ("/v1/chat/completions", {**chat, "messages": "hi"}),
        ("/v1/chat/completions", {**chat, "top_logprobs": 3}),
        ("/v1/chat/completions", {**chat, "max_tokens": -5}),
        ("/v1/chat/completions", {**chat, "model": "nope"}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * n_ctx}]}),
        ("/v1/chat/completions", {**chat, "depth": 0}),
        ("/v1/nothing", ok),
    ]
    out = []
    while len(out) < 100:  # the kinds again with other values, to 100 requests
        for path, body in cases:
            if isinstance(body, dict) and len(out) >= len(cases):
                body = {**body, "user": f"u{len(out)}"}
            out.append((path, body))
    return out[:100]


def test_malformed_requests_get_4xx_and_the_server_keeps_answering(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    with serving(engine) as url, httpx.Client(timeout=30) as http:
        statuses = []
        for path, body in _malformed(engine.max_len):
            if isinstance(body, str):
                r = http.post(url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(url + path, json=body)
            statuses.append(r.status_code)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert r.json()["error"]["message"], r.text
        assert len(statuses) == 100 and statuses.count(404) >= 2
        ok = http.post(
            f"{url}/v1/completions", json={"model": NAME, "prompt": "abc", "max_tokens": 12, "temperature": 0}
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == _alone(model, "abc", 3, 12)
    assert engine.pool.running == 0 and not engine._pending


def test_api_key_is_required_when_set(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    with serving(engine, api_key="sekret") as url:
        with pytest.raises(openai.AuthenticationError):
            _client(url, "wrong").models.list()
        assert _client(url, "sekret").completions.create(model=NAME, prompt="a", max_tokens=2).choices
        assert httpx.get(f"{url}/health").status_code == 200  # health and metrics stay open


def test_full_queue_answers_429(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2, max_queue=1))
    step, paused = engine.step, threading.Event()
    engine.step = lambda: False if paused.is_set() else step()
    paused.set()
    queued = threading.Event()
    submit = engine.submit
    engine.submit = lambda request, sink=None: (submit(request, sink), queued.set())[0]
    with serving(engine) as url, httpx.Client(timeout=30) as http:
        body = {"model": NAME, "prompt": "abc", "max_tokens": 4, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(http.post, f"{url}/v1/completions", json=body)
            assert queued.wait(30)  # the first request waits in the queue (the engine is paused)
            health = http.get(f"{url}/health").json()  # (waiting is the queue, not the batch)
            assert (health["waiting"], health["running_sequences"]) == (1, 0)
            second = http.post(f"{url}/v1/completions", json=body)
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "queue_full" and "retry later" in second.json()["error"]["message"]
            paused.clear()
            assert first.result(timeout=30).json()["choices"][0]["text"] == _alone(model, "abc", 2, 4)


def test_metrics_and_health(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=3, depth=2))
    with serving(engine) as url, httpx.Client(timeout=30) as http:
        assert http.get(f"{url}/health").json()["status"] == "ok"
        http.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0})
        text = http.get(f"{url}/metrics").text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    for name in (
        "looplm_queue_length",
        "looplm_running_sequences",
        "looplm_tokens_per_second",
        "looplm_mean_decode_depth",
        "looplm_cache_bytes_in_use",
        "looplm_cache_bytes_capacity",
    ):
        assert name in values, name
    assert values["looplm_generated_tokens_total"] == engine.generated_tokens > 0
    assert values["looplm_prompt_tokens_total"] == 5
    assert values["looplm_mean_decode_depth"] == 2.0 and values["looplm_cache_bytes_in_use"] == 0
    assert values["looplm_cache_bytes_capacity"] == engine.pool.nbytes
    assert values["looplm_prefill_seconds_total"] > 0 and values["looplm_decode_seconds_total"] > 0
    assert json.dumps(values)  # all plain numbers


@pytest.mark.slow
def test_looplm_serve_command(tmp_path):
    """`looplm serve` on a run folder: binds 127.0.0.1 (port 0: the kernel picks a free one, which the
    banner shows), answers, and refuses a bad flag with one error line."""
    import subprocess

    from _jobs import error_line, looplm_cmd, subprocess_env, write_random_run

    run = write_random_run(tmp_path / "run")
    step = run / "checkpoints" / "step_0000001"  # a checkpoint folder is served under its run's name
    proc = subprocess.Popen(
        looplm_cmd("serve", str(step), "--port", "0", "--max-batch", "2", "--depth", "2", "--max-seq-len", "64"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # the process closed its output

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen = []
    try:
        while True:  # the banner comes once the socket listens: a request waits in its backlog until served
            line = lines.get(timeout=120)
            assert line is not None, "looplm serve exited:\n" + "".join(seen)
            seen.append(line)
            banner = re.search(r"serving 'run' on http://127\.0\.0\.1:(\d+)/v1", line)
            if banner:
                port = int(banner.group(1))
                break
        assert port != 0  # the port the system chose for --port 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["run"] and models[0]["max_model_len"] == 64
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=30,
            json={"prompt": "+12,34=", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(30)
    while (line := lines.get(timeout=30)) is not None:
        seen.append(line)
    out = "".join(seen)
    assert "serving 'run' on http://127.0.0.1:" in out and "(terminal cache, 2 slots x 64 positions" in out
    bad = subprocess.run(
        looplm_cmd("serve", str(run), "--cache", "paged"), capture_output=True, text=True, env=subprocess_env()
    )
    assert bad.returncode == 2 and "--cache" in error_line(bad.stderr)


@pytest.mark.slow
def test_looplm_serve_on_a_busy_port_is_one_error_line(tmp_path):
    """A port already listened on is refused before the model loads and before any banner: exit 2 and
    one `error:` line (a server that started anyway would hang until the timeout kills it)."""
    import subprocess

    from _jobs import error_line, looplm_cmd, subprocess_env, write_random_run

    run = write_random_run(tmp_path / "run")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        got = subprocess.run(
            looplm_cmd("serve", str(run), "--port", str(port)),
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=120,
        )
    assert got.returncode == 2, got.stderr
    assert error_line(got.stderr).startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert "serving" not in got.stdout and "Uvicorn" not in got.stderr


@pytest.mark.parametrize(
    ("flags", "needs_model", "message"),
    [
        (["--port", "70000"], False, "--port must be in 0..65535"),
        (["--port", "-1"], False, "--port must be in 0..65535"),
        (["--depth", "0"], False, "--depth must be >= 1"),
        (["--max-batch", "0"], False, "--max-batch must be >= 1"),
        (["--max-queue", "0"], False, "--max-queue must be >= 1"),
        (["--max-seq-len", "1"], False, "--max-seq-len must be >= 2"),
        (["--depth", "4", "--max-depth", "3"], False, "--max-depth (3) must be >= --depth (4)"),
        (["--cache", "full", "--prefill", "student"], False, "--prefill student writes terminal banks"),
        (["--host", "no-such-host.invalid", "--port", "0"], False, "cannot listen on no-such-host.invalid:0: "),
        (["--port", "0", "--depth", "100"], True, "--depth must be in 1..64 (the model's max_depth), got 100"),
        (["--port", "0", "--max-depth", "65"], True, "--max-depth must be in 1..64"),
        (["--port", "0", "--max-seq-len", "100000"], True, "--max-seq-len must be in 2..64 (the model's context)"),
    ],
)
def test_looplm_serve_refuses_bad_options_with_one_error_line(tmp_path, capsys, flags, needs_model, message):
    """Each bad option is a user error naming it (exit 2), not an internal error: those about the model
    once it has loaded, the others before anything loads (the checkpoint is not even there)."""
    from looplm import cli

    run = tmp_path / "run"
    if needs_model:
        from _jobs import write_random_run

        write_random_run(run)
    assert cli.main(["serve", str(run), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# -- defects found in review (issue 19) ----------------------------------------------------------------
def _until(condition, what: str, timeout: float = 60.0) -> None:
    """Wait for `condition()` (engine state); the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_client_that_leaves_a_non_streaming_request_frees_its_slot():
    """Tokens keep arriving every few ms, so a check for the client made only while no token arrives
    never runs; the slot must still be freed soon after the client closes its connection (with an API
    key, whose middleware must leave the disconnect visible)."""
    import socket

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=2048, max_depth=4
    )
    engine = Engine(LoopedLM(cfg).eval(), TOK, EngineConfig(max_batch=1, depth=2))
    decode = engine._decode

    def paced_decode():  # ~20 s of tokens unless the server cancels the row
        engine._rows[0].handle._cancelled.wait(0.01)
        decode()

    engine._decode = paced_decode
    body = json.dumps({"model": NAME, "prompt": "abc", "max_tokens": 2000, "temperature": 0}).encode()
    with serving(engine, api_key="sekret") as url:
        client = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer sekret\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _until(lambda: engine.generated_tokens >= 5, "the request to decode")
        client.close()
        _until(lambda: engine.pool.running == 0, "the slot to be freed")
        assert engine.finished == {"cancelled": 1} and engine.generated_tokens < 1000


def _spelled(token_id: int) -> tuple[str, list[int] | None]:
    """A byte-tokenizer token as OpenAI spells it in logprobs, with its own bytes: ASCII as itself, a
    byte of a multi-byte character as `bytes:\\xNN`, the special tokens by name with no bytes."""
    if token_id >= 256:
        return ("<eos>", "<pad>")[token_id - 256], None
    return (chr(token_id) if token_id < 128 else f"bytes:\\x{token_id:02x}"), [token_id]


def _native_steps(model, prompt: str, n: int, k: int, depth: int = 3) -> list[tuple[int, float, list]]:
    """(greedy token, its log-prob, the top-k (token, log-prob)) per step, from the no-cache forward."""
    seq, out = TOK.encode(prompt), []
    for _ in range(n):
        with torch.no_grad():
            lp = model(torch.tensor([seq]), depth, init="seeded").logits[0, -1].log_softmax(-1)
        top = lp.topk(k)
        out.append((int(lp.argmax()), float(lp.max()), list(zip(top.indices.tolist(), top.values.tolist()))))
        seq.append(out[-1][0])
    return out


def test_logprobs_spell_each_token_by_its_own_bytes(model):
    """Chat `bytes` are each token's own bytes (not those of U+FFFD for a byte of a multi-byte
    character), and completions' `top_logprobs` keep every alternative under its own key, against the
    no-cache forward (the full cache reproduces it)."""
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, cache="full"))
    with TestClient(create_app(engine, NAME)) as http:
        got = http.post(
            "/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0, "logprobs": 5}
        ).json()["choices"][0]["logprobs"]
        steps = _native_steps(model, "hello", len(got["tokens"]), 5)
        assert got["tokens"] == [_spelled(t)[0] for t, _, _ in steps]
        for top, (_, _, want) in zip(got["top_logprobs"], steps):
            assert len(top) == 5 and set(top) == {_spelled(t)[0] for t, _ in want}
            assert all(top[_spelled(t)[0]] == pytest.approx(lp, abs=1e-4) for t, lp in want)
        assert any(sum(t >= 128 for t, _ in want) >= 2 for _, _, want in steps)  # keys that used to collide

        prompt = "user: hi\nassistant:"
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 3,
            },
        ).json()["choices"][0]["logprobs"]["content"]
        steps = _native_steps(model, prompt, len(chat), 3)
        for entry, (token, lp, top) in zip(chat, steps):
            assert (entry["token"], entry["bytes"]) == _spelled(token)
            assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
            assert [(e["token"], e["bytes"]) for e in entry["top_logprobs"]] == [_spelled(t) for t, _ in top]
        assert any(token >= 128 for token, _, _ in steps)  # a byte of a multi-byte character was chosen


def test_every_chunk_of_a_stream_has_the_same_created(model, monkeypatch):
    """The clock ticks a second at every reading: a stream that read it per chunk would show it."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    import looplm.serve.api as api

    ticks = iter(range(1_700_000_000, 1_800_000_000))
    monkeypatch.setattr(api, "time", SimpleNamespace(time=lambda: float(next(ticks))))
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    with TestClient(create_app(engine, NAME)) as http:
        for path, body in (
            ("/v1/completions", {"prompt": "abc"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            body = {
                **body,
                "model": NAME,
                "max_tokens": 6,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with http.stream("POST", path, json=body) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert len(chunks) >= 3 and len({c["created"] for c in chunks}) == 1, path


def test_null_optional_fields_mean_their_defaults(model):
    """OpenAI clients send `null` for an unset optional field: the server uses the field's default."""
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    optional = [
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "stream_options",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "user",
        "depth",
        "prefill_depth",
        "exit_tau",
        "min_depth",
        "max_tokens",
        "logprobs",
        "echo",
        "best_of",
        "suffix",
    ]
    with TestClient(create_app(engine, NAME)) as http:
        base = {"model": NAME, "prompt": "abc", "seed": 7}  # temperature defaults to 1: a seeded sample
        nulls = http.post("/v1/completions", json={**base, **{f: None for f in optional}})
        assert nulls.status_code == 200, nulls.text
        assert nulls.json()["choices"] == http.post("/v1/completions", json=base).json()["choices"]
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "seed": 7, "max_tokens": 4}
        chat_nulls = {"max_completion_tokens": None, "logprobs": None, "top_logprobs": None, "temperature": None}
        got = http.post("/v1/chat/completions", json={**chat, **chat_nulls})
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == http.post("/v1/chat/completions", json=chat).json()["choices"]


def test_a_seed_out_of_range_is_400_before_any_prefill(model):
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    with TestClient(create_app(engine, NAME)) as http:
        for seed in (2**64, -(2**63) - 1):
            r = http.post("/v1/completions", json={"model": NAME, "prompt": "abc", "temperature": 1.0, "seed": seed})
            assert r.status_code == 400 and "seed must be in" in r.json()["error"]["message"], r.text
        last = http.post(
            "/v1/completions",
            json={"model": NAME, "prompt": "abc", "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 2**64 - 1},
        )  # choice 2 gets seed+1
        assert last.status_code == 400, last.text
    assert engine.prompt_tokens == 0 and engine.finished == {}


def test_more_choices_than_the_queue_holds_is_400_not_429(model, monkeypatch):
    """Retrying cannot help a request whose choices (prompts x n) outnumber the queue: a 400, and none
    of its choices reaches the engine; its prompts are not tokenized first (on the event loop, for
    nothing)."""
    from fastapi.testclient import TestClient

    tok = ByteTokenizer()
    encoded = []
    encode = tok.encode_prompt
    monkeypatch.setattr(tok, "encode_prompt", lambda prompt: encoded.append(prompt) or encode(prompt))
    engine = Engine(model, tok, EngineConfig(max_batch=1, depth=2, max_queue=3))
    with TestClient(create_app(engine, NAME)) as http:
        for body in ({"prompt": "abc", "n": 4}, {"prompt": ["ab", "cd"], "n": 2}):
            r = http.post("/v1/completions", json={"model": NAME, "max_tokens": 2, **body})
            assert r.status_code == 400 and "max_queue 3" in r.json()["error"]["message"], r.text
        r = http.post(
            "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 4},
        )
        assert r.status_code == 400, r.text
        assert encoded == []
        assert (
            http.post("/v1/completions", json={"model": NAME, "prompt": "abc", "max_tokens": 2, "n": 3}).status_code
            == 200
        )
    assert engine.prompt_tokens == 3 * 3


def test_the_api_key_is_compared_in_constant_time(model, monkeypatch):
    from fastapi.testclient import TestClient

    import looplm.serve.api as api

    compared = []
    real = api.secrets.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api.secrets, "compare_digest", spy)
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    with TestClient(create_app(engine, NAME, api_key="sekret")) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert http.get("/v1/models").status_code == 401
    assert len(compared) == 3 and all(b"sekret" in b for _, b in compared)


# -- echo with logprobs scores the prompt (OpenAI's legacy completions, lm-eval's local-completions) --------
def _native_prompt_scores(model, ids: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities after each prefix ids[:j + 1] and those of ids[j + 1], from the native
    no-cache forward at `depth` (example id 0)."""
    with torch.no_grad():
        lp = model(torch.tensor([ids]), depth, init="seeded").logits[0, :-1].log_softmax(-1)
    return lp, lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(model):
    """echo + logprobs: `tokens`, `token_logprobs` (null first), `top_logprobs` (null first) and
    `text_offset` cover the prompt, then the completion; the prompt's scores are the no-cache forward's
    at the request's prefill depth (to 1e-5). max_tokens 0 with echo only scores the prompt (as lm-eval
    sends it); without echo it stays a 400."""
    from fastapi.testclient import TestClient

    prompt = "score me, caf\u00e9"
    ids = TOK.encode(prompt)
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, max_depth=5))
    with TestClient(create_app(engine, NAME)) as http:
        body = {
            "model": NAME,
            "prompt": prompt,
            "echo": True,
            "logprobs": 2,
            "temperature": 0,
            "depth": 2,
            "prefill_depth": 5,
        }
        scored = http.post("/v1/completions", json={**body, "max_tokens": 0})
        assert scored.status_code == 200, scored.text
        choice = scored.json()["choices"][0]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        native, want = _native_prompt_scores(model, ids, 5)
        assert lp["tokens"] == [_spelled(t)[0] for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5, rtol=0)
        for top, row in zip(lp["top_logprobs"][1:], native):
            best = row.topk(2)
            assert top == pytest.approx(
                {_spelled(t)[0]: v for t, v in zip(best.indices.tolist(), best.values.tolist())}, abs=1e-5
            )
        # offsets into the prompt text: both bytes of "\u00e9" start at its character
        assert lp["text_offset"] == _char_of_each_byte(prompt) == [*range(14), 13]
        assert scored.json()["usage"]["completion_tokens"] == 0
        assert scored.json()["usage"]["prompt_tokens"] == len(ids)

        both = http.post("/v1/completions", json={**body, "max_tokens": 4}).json()["choices"][0]
        alone = http.post("/v1/completions", json={**body, "max_tokens": 4, "echo": False}).json()["choices"][0]
        assert both["text"] == prompt + alone["text"]
        n = len(ids)
        assert both["logprobs"]["tokens"] == lp["tokens"] + alone["logprobs"]["tokens"]
        assert both["logprobs"]["token_logprobs"][:n] == lp["token_logprobs"]
        assert both["logprobs"]["token_logprobs"][n:] == alone["logprobs"]["token_logprobs"]
        assert both["logprobs"]["text_offset"][:n] == lp["text_offset"]
        assert both["logprobs"]["text_offset"][n:] == [len(prompt) + o for o in alone["logprobs"]["text_offset"]]

        plain = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "echo": True, "max_tokens": 0})
        assert plain.status_code == 200 and plain.json()["choices"][0] == {
            "index": 0,
            "text": prompt,
            "logprobs": None,
            "finish_reason": "length",
        }
        refused = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 0})
        assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]

        stream = http.post("/v1/completions", json={**body, "max_tokens": 4, "stream": True})
        chunks = [
            json.loads(line[6:])
            for line in stream.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in chunks:
            for key in merged:
                merged[key] += c["choices"][0]["logprobs"][key]
        assert "".join(c["choices"][0]["text"] for c in chunks) == both["text"]
        assert merged == {key: both["logprobs"][key] for key in merged}
    assert engine.pool.running == 0


# -- text_offset: the character where each token starts, for multi-byte characters too ----------------
def _char_of_each_byte(text: str) -> list[int]:
    """For each UTF-8 byte of `text`, the index of the character it belongs to: the `text_offset` of
    each token of a byte tokenizer (a byte inside a character gets that character's offset)."""
    return [k for k, ch in enumerate(text) for _ in ch.encode("utf-8")]


class _ScriptedEngine:
    """Stands in for `Engine` in `create_app`: every request's reply is the bytes of `reply` (up to
    max_tokens), each token released as text once its character is whole; prompt scores are -1. So
    the completion's bytes are known to the test, which a trained or random model would not give."""

    def __init__(self, reply: str | bytes):
        self.tokenizer, self.reply = TOK, list(reply) if isinstance(reply, bytes) else TOK.encode(reply)
        self.config, self.max_len, self.running, self.waiting = EngineConfig(max_batch=1), 64, 0, 0

    def start(self):
        pass

    def shutdown(self):
        pass

    def check(self, request):
        pass

    def submit(self, request, sink):
        import codecs
        from types import SimpleNamespace

        from looplm.serve.engine import Finish, PromptLogprobs, Token

        if request.prompt_logprobs is not None:
            n = len(request.prompt_ids) - 1
            sink(
                PromptLogprobs(
                    [-1.0] * n, [[(t, -1.0)] for t in request.prompt_ids[1:]] if request.prompt_logprobs else None
                )
            )
        utf8, text = codecs.getincrementaldecoder("utf-8")(errors="replace"), ""
        ids = self.reply[: request.sampling.max_new_tokens]
        for t in ids:
            piece = utf8.decode(bytes([t]))
            text += piece
            sink(Token(t, piece, 1, -0.5, [(t, -0.5)] if request.logprobs else None))
        text += utf8.decode(b"", final=True)
        handle = SimpleNamespace(
            finish=Finish("length", text, "", len(request.prompt_ids), len(ids), 1.0), cancel=lambda: None
        )
        sink(handle.finish)
        return handle


def _streamed_logprobs(http, body: dict) -> tuple[str, dict[str, list]]:
    stream = http.post("/v1/completions", json={**body, "stream": True})
    assert stream.status_code == 200, stream.text
    chunks = [
        json.loads(line[6:])
        for line in stream.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    merged: dict[str, list] = {"tokens": [], "text_offset": []}
    for c in chunks:
        for key in merged:
            merged[key] += c["choices"][0]["logprobs"][key]
    return "".join(c["choices"][0]["text"] for c in chunks), merged


def test_text_offsets_count_characters_for_multi_byte_text():
    """Each token's `text_offset` is the index, in the returned text, of the character its first byte
    belongs to (byte tokens of one character share its offset): in the completion, in an echoed prompt
    before it, and the same streamed as not; the offsets are computed here from the text alone."""
    from fastapi.testclient import TestClient

    prompt, reply = "h\u00e9llo w\u00f6rld", "\u65e5\u672c \U0001f642 \u0436!"  # 2-, 3-, 4-byte characters
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": prompt, "max_tokens": len(reply.encode()), "logprobs": 1}
        plain = http.post("/v1/completions", json=body).json()["choices"][0]
        assert plain["text"] == reply
        assert plain["logprobs"]["text_offset"] == _char_of_each_byte(reply)

        echoed = http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
        assert echoed["text"] == prompt + reply
        want = _char_of_each_byte(prompt) + [len(prompt) + k for k in _char_of_each_byte(reply)]
        assert echoed["logprobs"]["text_offset"] == want

        scored = http.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()["choices"][0]
        assert scored["logprobs"]["text_offset"] == _char_of_each_byte(prompt)

        for echo, choice in ((False, plain), (True, echoed)):
            text, merged = _streamed_logprobs(http, {**body, "echo": echo})
            assert text == choice["text"]
            assert merged == {key: choice["logprobs"][key] for key in merged}


def _offsets_by_incremental_decoder(data: bytes) -> list[int]:
    """Each byte's character index in `data.decode("utf-8", "replace")`, from Python's incremental
    decoder: a byte that continues a pending character belongs to it; a byte that breaks a pending
    prefix off (the decoder emits U+FFFD for the prefix) starts one character after it."""
    import codecs

    utf8, emitted, offsets = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, []
    for b in data:
        pending = bool(utf8.getstate()[0])
        out = utf8.decode(bytes([b]))
        offsets.append(emitted + (pending and out.startswith("\ufffd")))
        emitted += len(out)
    return offsets


@pytest.mark.parametrize("reply", [b"\xca$", b"\xa5\xb2", b"\xfc\x8ex", b"ab\xe6\x97c", b"\xe6\x97\xa5\xe6x\xf0\x9f"])
def test_text_offsets_of_invalid_utf8(reply):
    """A byte that is invalid, or that breaks off an incomplete character, starts a character of its own
    (its U+FFFD's): it got the offset of the character before it ([0, 0] for b"\xca$")."""
    from fastapi.testclient import TestClient

    text = reply.decode("utf-8", errors="replace")
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": "ab", "max_tokens": len(reply), "logprobs": 1}
        plain = http.post("/v1/completions", json=body).json()["choices"][0]
        assert plain["text"] == text
        assert plain["logprobs"]["text_offset"] == _offsets_by_incremental_decoder(reply)
        streamed_text, merged = _streamed_logprobs(http, body)
        assert merged["text_offset"] == plain["logprobs"]["text_offset"]


# -- unknown request fields are refused by name; OpenAI's own are accepted -----------------------------
def test_an_unknown_field_is_400_naming_it_and_openai_fields_are_accepted(model):
    """A misspelt looplm field (`deph`) used to be dropped silently (the reply came at the server's
    depth); now it is a 400 that names it. Fields of OpenAI's APIs that looplm does not use, and the
    bodies the openai client sends, are still accepted."""
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(create_app(engine, NAME)) as http:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/chat/completions", chat)):
            refused = http.post(path, json={**body, "deph": 3, "exit_tua": 0.1})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert "'deph'" in error["message"] and "'exit_tua'" in error["message"] and error["param"] == "deph"
            assert http.post(path, json={**body, "deph": None}).status_code == 400  # null too: it is still a typo
        assert (
            "'messages'"
            in http.post("/v1/completions", json={"prompt": "hi", "messages": []}).json()["error"]["message"]
        )

        ignored = {
            "user": "u1",
            "presence_penalty": 0,
            "frequency_penalty": 0,
            "logit_bias": {},
            "n": 1,
            "best_of": 1,
            "suffix": None,
            "seed": 3,
            "stream_options": None,
        }
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **ignored})
        assert ok.status_code == 200, ok.text
        chat_ignored = {
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "none",
            "metadata": {"k": "v"},
            "store": False,
            "parallel_tool_calls": False,
            "service_tier": "auto",
            "user": "u1",
            "reasoning_effort": None,
            "modalities": ["text"],
            "prompt_cache_key": "x",
            "safety_identifier": "s",
        }
        ok = http.post("/v1/chat/completions", json={**chat, **chat_ignored})
        assert ok.status_code == 200, ok.text

        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        out = client.completions.create(
            model=NAME,
            prompt="hi",
            max_tokens=2,
            temperature=0,
            user="u",
            seed=1,
            stream_options=None,
            extra_body={"depth": 2},
        )
        assert out.choices[0].text == _alone(model, "hi", 2, 2)
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            response_format={"type": "text"},
            store=False,
            metadata={"k": "v"},
        )
        assert reply.choices[0].message.role == "assistant"
        with pytest.raises(openai.BadRequestError, match="deph"):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body={"deph": 3})


# -- a SentencePiece-style tokenizer (`▁` word markers) behind the API ------------------------------------
@pytest.fixture(scope="module")
def sp_model():
    sp = sentencepiece_tokenizer()
    return decisive_model(sp.vocab_size, max_depth=8), sp


def _sp_alone(model, sp, prompt: str, max_tokens: int, stop=()) -> str:
    sampling = SamplingConfig(max_new_tokens=max_tokens, stop=tuple(stop))
    return generate(model, sp, [prompt], DepthRule(3), sampling=sampling)[0]


def test_sentencepiece_stop_strings_through_the_api(sp_model):
    """Stop strings that begin with a word's space, streamed or not: the text equals `generate` on the
    prompt alone with the same stop, cut before it, and the streamed pieces join into it."""
    from fastapi.testclient import TestClient

    model, sp = sp_model
    prompt = "a looped model"
    free = _sp_alone(model, sp, prompt, 12)
    words = free.split(" ")
    assert len(words) >= 3, free
    engine = Engine(model, sp, EngineConfig(max_batch=2, depth=3))
    with TestClient(create_app(engine, NAME)) as http:
        for stop in (" " + words[1], words[2][:2], "zzz"):
            want = _sp_alone(model, sp, prompt, 12, stop=(stop,))
            assert want == (free[: free.index(stop)] if stop in free else free)
            body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
            done = http.post("/v1/completions", json=body).json()["choices"][0]
            assert done["text"] == want, stop
            assert done["finish_reason"] == ("stop" if stop in free else "length")
            stream = http.post("/v1/completions", json={**body, "stream": True})
            chunks = [
                json.loads(line[6:])
                for line in stream.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            assert "".join(c["choices"][0]["text"] for c in chunks) == want, stop
    assert engine.pool.running == 0


def test_sentencepiece_token_names_spell_the_text(sp_model):
    """Completions' logprob tokens and chat's token bytes, joined, spell the reply (every word's space
    included), and the echoed prompt + reply is the decode of all the ids."""
    from fastapi.testclient import TestClient

    model, sp = sp_model
    prompt = "a looped model"
    engine = Engine(model, sp, EngineConfig(max_batch=2, depth=3))
    with TestClient(create_app(engine, NAME)) as http:
        done = http.post(
            "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 1}
        ).json()["choices"][0]
        assert " " in done["text"].strip()
        assert "".join(done["logprobs"]["tokens"]) == done["text"]
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": NAME,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
            },
        ).json()["choices"][0]
        content = chat["logprobs"]["content"]
        assert bytes(b for e in content for b in e["bytes"]).decode() == chat["message"]["content"]
        echoed = http.post(
            "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "echo": True}
        ).json()["choices"][0]
        assert echoed["text"] == prompt + done["text"] and prompt + " " in echoed["text"]


def test_sentencepiece_text_offsets_point_into_the_text(sp_model):
    """Each logprob token's `text_offset` is where its text starts in the reply."""
    from fastapi.testclient import TestClient

    model, sp = sp_model
    engine = Engine(model, sp, EngineConfig(max_batch=2, depth=3))
    with TestClient(create_app(engine, NAME)) as http:
        done = http.post(
            "/v1/completions",
            json={"model": NAME, "prompt": "a looped model", "max_tokens": 10, "temperature": 0, "logprobs": 1},
        ).json()["choices"][0]
    text, lp = done["text"], done["logprobs"]
    ids = [sp.encode(t) for t in lp["tokens"]]
    assert all(ids) and " " in text.strip()
    ends = lp["text_offset"][1:] + [len(text)]
    assert [text[a:b] for a, b in zip(lp["text_offset"], ends)] == lp["tokens"]


def test_an_echoed_prompt_with_an_unknown_character_is_the_text_its_offsets_index(sp_model):
    """A tokenizer with an unknown token cannot spell every prompt: "Hello world" reads as "ello world". The
    echo returned the prompt as sent while the offsets counted in the text read, so "lo" pointed at "ll"; the
    echo is now the text read, and each offset is where its token's text starts in the reply."""
    from fastapi.testclient import TestClient

    model, sp = sp_model
    engine = Engine(model, sp, EngineConfig(max_batch=2, depth=3))
    body = {"model": NAME, "prompt": "Hello world", "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True}
    with TestClient(create_app(engine, NAME)) as http:
        done = http.post("/v1/completions", json=body).json()["choices"][0]
    text, lp = done["text"], done["logprobs"]
    assert text.startswith("ello world") and lp["tokens"][2:6] == ["e", "l", "lo", " wor"], lp["tokens"]
    ends = lp["text_offset"][1:] + [len(text)]
    spelled = [text[a:b] for a, b in zip(lp["text_offset"], ends)]
    assert spelled[2:] == lp["tokens"][2:]  # the unknown token and the one before it spell nothing
    assert spelled[:2] == ["", ""]


class _PaddedHead(torch.nn.Module):
    """A head with rows past the tokenizer's ids (as a release pads its embedding) that win every
    argmax: the model's own head for ids [0, 258), then PAD rows scoring 10 above its best."""

    PAD = 42

    def __init__(self, head):
        super().__init__()
        self.inner = head

    def forward(self, x):
        out = self.inner(x)[..., : TOK.vocab_size]
        return torch.cat([out, (out.amax(-1, keepdim=True) + 10).expand(*out.shape[:-1], self.PAD)], -1)


@pytest.fixture(scope="module")
def padded_model():
    model = decisive_model(TOK.vocab_size + _PaddedHead.PAD, max_depth=8)
    model.head = _PaddedHead(model.head)
    return model


@torch.no_grad()
def _tokenizer_greedy(model, ids: list[int], n: int, depth: int) -> list[torch.Tensor]:
    """Log-probabilities over the tokenizer's ids of each greedy step (no cache: the whole sequence
    re-run natively per token, seeded as example 0), until an end of text or n tokens."""
    ids, steps = list(ids), []
    for _ in range(n):
        out = model(torch.tensor([ids]), depth, init="seeded", example_ids=torch.tensor([0]))
        lp = out.logits[0, -1, : TOK.vocab_size].log_softmax(-1)
        if int(lp.argmax()) == TOK.eos_id:
            break
        steps.append(lp)
        ids.append(int(lp.argmax()))
    return steps


def test_a_model_padded_past_the_tokenizer_answers_with_the_tokenizers_ids(padded_model):
    """A model whose head has rows no token id reaches (here they would win every argmax) decodes,
    scores and spells over the tokenizer's ids only: the reply and its top-5 alternatives are the
    native forward's over those ids, a stream ends with [DONE], and a prompt id past the tokenizer
    is a 400. `generate` gives the same text."""
    from fastapi.testclient import TestClient

    want = _tokenizer_greedy(padded_model, TOK.encode("Hello"), 6, 3)
    text = TOK.decode([int(lp.argmax()) for lp in want])
    engine = Engine(padded_model, TOK, EngineConfig(max_batch=2, depth=3, cache="full"))
    with TestClient(create_app(engine, NAME)) as http:
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 5}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200
        choice = reply.json()["choices"][0]
        assert choice["text"] == text
        assert_logprobs_equal(openai.types.completion_choice.Logprobs(**choice["logprobs"]), want, 5)
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        assert streamed.endswith("data: [DONE]\n\n") and '"error"' not in streamed
        bad = http.post("/v1/completions", json={**body, "prompt": [72, TOK.vocab_size + 3]})
        assert bad.status_code == 400 and f"0..{TOK.vocab_size - 1}" in bad.json()["error"]["message"]
    assert _alone(padded_model, "Hello", 3, 6, mode="full") == text
    # the static step's logits too (speculation drafts and verifies through it)
    speculating = Engine(padded_model, TOK, EngineConfig(depth=3, cache="full", speculate=2, draft_depth=1))
    with TestClient(create_app(speculating, NAME)) as http:
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == text
    spec = generate(
        padded_model,
        TOK,
        ["Hello"],
        DepthRule(3),
        cache="full",
        speculate=Speculation(2, 1),
        sampling=SamplingConfig(6),
    )
    assert spec == [text]


def test_an_unexpected_error_is_a_500_in_openais_body_and_ends_a_stream_with_it(model, monkeypatch):
    """A bug while a request is answered is a 500 with OpenAI's error body, not a bare text page; past
    a stream's 200 it is one last `data:` line with that body, not a stream cut short without a word."""
    from fastapi.testclient import TestClient

    import looplm.serve.replies as replies

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    with TestClient(create_app(engine, NAME), raise_server_exceptions=False) as http:
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "logprobs": 2}

        def broken(*args, **kwargs):
            raise RuntimeError("spelling broke")

        monkeypatch.setattr(replies, "spelling", broken)
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 500
        error = reply.json()["error"]
        assert error["type"] == "server_error" and "spelling broke" in error["message"]
        streamed = http.post("/v1/completions", json={**body, "stream": True})
        last = [line for line in streamed.text.splitlines() if line.startswith("data: ")][-1]
        assert "spelling broke" in json.loads(last[len("data: ") :])["error"]["message"]
        monkeypatch.undo()
        assert http.post("/v1/completions", json=body).status_code == 200  # the server keeps answering


def test_models_by_id_and_a_prompt_past_the_context_answer_as_openai_does(model):
    """`GET /v1/models/{id}` (what the openai client's `models.retrieve` calls) is the served model's
    card, a 404 `model_not_found` for another name; a prompt longer than the context is a 400 with
    OpenAI's code `context_length_exceeded` and says so (a chat that sets no max_tokens too)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    with serving(engine) as url:
        client = _client(url)
        card = client.models.retrieve(NAME)
        assert card.id == NAME and card.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("other/model")
        assert missing.value.body["code"] == "model_not_found"
        n_ctx = engine.max_len
        for call, needs in (
            (lambda: client.completions.create(model=NAME, prompt="x" * (n_ctx - 4), max_tokens=10), n_ctx + 5),
            (lambda: client.completions.create(model=NAME, prompt=[65] * (n_ctx + 1), max_tokens=1), None),
            (
                lambda: client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "x" * (n_ctx + 20)}]
                ),
                None,
            ),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                call()
            assert err.value.body["code"] == "context_length_exceeded"
            message = err.value.body["message"]
            assert f"context of {n_ctx}" in message
            assert (f"needs {needs} positions" in message) if needs else ("max_tokens" not in message)


def test_a_request_cancelled_while_queued_counts_as_finished(model):
    """A request that leaves before a slot takes it is counted in /metrics' finished requests."""
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    handle = engine.submit(Request(TOK.encode("abc"), SamplingConfig(max_new_tokens=4)))
    handle.cancel()
    engine.step()
    assert engine.stats()["finished_total"] == {"cancelled": 1}


def test_every_request_that_never_ran_counts_as_finished_with_its_prompt(model):
    """A prefill that fails, and requests still queued at shutdown, are counted in /metrics'
    finished requests as a cancel in the queue is, and their Finish carries the prompt's size."""
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))

    def failing(*args, **kwargs):
        raise RuntimeError("the prefill failed")

    engine.prefill = failing
    broken = engine.submit(Request(TOK.encode("hello"), SamplingConfig(max_new_tokens=4)))
    engine.step()
    assert broken.finish.reason == "error" and engine.stats()["finished_total"] == {"error": 1}
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    running = engine.submit(Request(TOK.encode("hello"), SamplingConfig(max_new_tokens=8)))
    queued = engine.submit(Request(TOK.encode("queued prompt"), SamplingConfig(max_new_tokens=8)))
    engine.step()
    engine.shutdown()
    assert (running.finish.reason, queued.finish.reason, queued.finish.prompt_tokens) == ("cancelled", "cancelled", 13)
    assert engine.stats()["finished_total"] == {"cancelled": 2}


@pytest.mark.parametrize("speculate", [0, 3])
def test_an_end_of_text_token_is_no_decoded_token(model, speculate):
    """/metrics counts as decoded only the tokens rows emitted: the EOS that ends a row is not one."""
    config = EngineConfig(max_batch=1, depth=4, speculate=speculate, draft_depth=1)
    prompt = TOK.encode("hello")
    free, events = Engine(model, TOK, config), []
    free.run_until_done([free.submit(Request(prompt, SamplingConfig(max_new_tokens=10)), sink=events.append)])
    ids = [e.token_id for e in events if isinstance(e, Token)]
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])  # the first new token after two

    class EndsThere(ByteTokenizer):
        eos_id = ids[j]

    engine = Engine(model, EndsThere(), config)
    handle = engine.submit(Request(prompt, SamplingConfig(max_new_tokens=10)))
    engine.run_until_done([handle])
    assert (handle.finish.reason, handle.finish.completion_tokens) == ("stop", j)
    assert engine.decoded_tokens == j - 1  # the prefill chose the first; the decode steps the rest
    assert engine.stats()["mean_decode_depth"] == 4.0  # (the step that chose the EOS is not counted)


def test_a_chat_reply_stops_where_any_other_roles_turn_would_start():
    """For every role a request may give other than the assistant's, the rendered prompt's turn for it
    (what a model trained on the template would write next) starts with a stop string of the reply."""
    from typing import get_args

    from looplm.serve.protocol import ChatMessage, ChatRequest

    roles = [r for r in get_args(ChatMessage.model_fields["role"].annotation) if r != "assistant"]
    assert set(roles) == {"system", "developer", "user"}
    for role in roles:
        req = ChatRequest(model=NAME, messages=[{"role": "user", "content": "hi"}, {"role": role, "content": "x"}])
        turn = req.render().split("\n")[1]  # the second message's own line
        assert any(("\n" + turn).startswith(stop) for stop in req.stop_strings()), (role, req.stop_strings())


def test_usage_mean_decode_depth_weights_each_choice_by_its_tokens():
    """Kills R01 (replies.py `usage`: the mean of the choices' means instead of the per-token mean): two
    choices, 1 token at depth 3 and 3 tokens at depth 5 (2, 6 and 7 recurrences), are 4 tokens whose
    recurrences sum to 18: a mean decode depth of 4.5, not (3 + 5) / 2."""
    from looplm.serve.engine import Finish
    from looplm.serve.replies import usage

    per_token = [[3], [2, 6, 7]]  # each choice's recurrences per decoded token
    finishes = [Finish("length", "", "", 7, len(d), sum(d) / len(d)) for d in per_token]
    got = usage(7, finishes)
    assert got["mean_decode_depth"] == pytest.approx(sum(map(sum, per_token)) / sum(map(len, per_token)))
    assert (got["prompt_tokens"], got["completion_tokens"], got["total_tokens"]) == (7, 4, 11)


def _serve_model():
    return decisive_model(TOK.vocab_size, max_depth=8)


def _sse(resp) -> list[dict]:
    import json

    return [
        json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _free(model, prompt: str, n: int, stop=()) -> tuple[str, list[int]]:
    """looplm generate's greedy text for `prompt` alone at depth 3, and its token ids."""
    stats: dict = {}
    text = generate(
        model, TOK, [prompt], DepthRule(3), sampling=SamplingConfig(max_new_tokens=n, stop=tuple(stop)), stats=stats
    )[0]
    return text, stats["token_ids"][0]


def test_a_streamed_completion_ends_with_the_reason_and_usage_of_the_whole_reply():
    """Kills R04 (replies.py CompletionReply.finish: finish_reason always "stop") and R02 (usage total_tokens
    = completion_tokens only): a reply cut by max_tokens ends "length", one cut by a stop string "stop", streamed
    as whole; usage counts the prompt's tokens plus the generated ones (looplm generate's, on the prompt alone)."""
    from fastapi.testclient import TestClient

    from looplm.serve import Engine, EngineConfig
    from looplm.serve.api import create_app

    model = _serve_model()
    free, ids = _free(model, "abc", 12)
    assert len(ids) > 4 and TOK.eos_id not in ids[:4] and len(free) > 3, free
    prompt_tokens = len(TOK.encode_prompt("abc"))
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    with TestClient(create_app(engine, "m")) as http:
        for extra, reason in (({"max_tokens": 4}, "length"), ({"max_tokens": 12, "stop": [free[2:4]]}, "stop")):
            text, got_ids = _free(model, "abc", extra["max_tokens"], extra.get("stop", ()))
            body = {"model": "m", "prompt": "abc", "temperature": 0, **extra}
            whole = http.post("/v1/completions", json=body).json()
            assert whole["choices"][0]["finish_reason"] == reason and whole["choices"][0]["text"] == text
            usage = whole["usage"]
            assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == len(got_ids)
            assert usage["total_tokens"] == prompt_tokens + len(got_ids)
            chunks = _sse(
                http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
            )
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert reasons[-1] == reason and not any(reasons[:-1])
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
            assert chunks[-1]["usage"] == usage


def test_a_streamed_chat_reply_releases_its_held_back_tail():
    """Kills R05 (replies.py ChatReply.finish dropping `ev.tail`): a reply whose last character could start a
    stop string is held back until the reply ends; the finish chunk carries it, so the deltas join into the
    whole reply's content and looplm generate's text."""
    from fastapi.testclient import TestClient

    from looplm.serve import Engine, EngineConfig
    from looplm.serve.api import create_app
    from looplm.serve.protocol import CHAT_STOP

    model = _serve_model()
    rendered = "user: hi\nassistant:"
    free, _ = _free(model, rendered, 6, CHAT_STOP)
    stop = free[-1] + "\x01"  # never generated whole, its first character ends the reply: held back
    want, _ = _free(model, rendered, 6, (stop, *CHAT_STOP))
    assert want == free and free
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stop": [stop],
    }
    with TestClient(create_app(engine, "m")) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        chunks = _sse(http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert whole["message"]["content"] == want
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["delta"].get("content")  # the test can fail: the finish chunk held text


def test_a_chat_without_max_tokens_may_fill_the_context():
    """Kills P01 (protocol.py ChatRequest.budget `context - prompt_tokens + 1` -> `context - prompt_tokens`):
    unset max_tokens lets a chat reply take every position the slot has left, plus the last token (never fed),
    as looplm generate's room is; the reply equals looplm generate with that budget."""
    from fastapi.testclient import TestClient

    from looplm.serve import Engine, EngineConfig
    from looplm.serve.api import create_app
    from looplm.serve.protocol import CHAT_STOP

    model = _serve_model()
    rendered = "user: hi\nassistant:"
    slot = 32
    room = slot - len(TOK.encode_prompt(rendered)) + 1
    want, ids = _free(model, rendered, room, CHAT_STOP)
    assert len(ids) == room and TOK.eos_id not in ids  # the reply runs to the budget (the test can fail)
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, max_seq_len=slot))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    with TestClient(create_app(engine, "m")) as http:
        got = http.post("/v1/chat/completions", json=body).json()
    assert got["choices"][0]["message"]["content"] == want and got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == room


def test_top_logprobs_keep_the_likelier_of_two_tokens_spelled_alike():
    """Kills R03 (replies.py `_top`: `top.setdefault(...)` -> `top[...] = lp`): of two alternatives with one
    spelling (a byte-fallback `<0x41>` and `A`, say), the likelier one (listed first) keeps the key."""
    from types import SimpleNamespace

    from looplm.serve.replies import CompletionReply

    class Pieces:  # ids 1 and 2 spell "A", 3 spells "B"
        def token_piece(self, i):
            return {1: b"A", 2: b"A", 3: b"B"}[i]

    reply = SimpleNamespace(tok=Pieces())
    assert CompletionReply._top(reply, [(2, -0.1), (1, -0.7), (3, -1.5)]) == {"A": -0.1, "B": -1.5}


# -- the HTTP layer's edges (found by mutating events, api, errors and protocol) ----------------------------
def test_choices_that_do_not_all_fit_the_queue_leave_none_queued(model):
    """A request whose choices fill the queue part way (the queue holds 3; 1 waits, 3 come)
    is refused with EngineFull and the choices already queued are cancelled: none of them runs."""
    import asyncio

    from looplm.serve.engine import EngineFull
    from looplm.serve.events import Choices

    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2, max_queue=3))
    first = engine.submit(Request(TOK.encode("first"), SamplingConfig(2)))

    async def submit():
        with pytest.raises(EngineFull):
            Choices(engine, [Request(TOK.encode(p), SamplingConfig(2)) for p in ("ab", "cd", "ef")])
        engine.step()  # drops the cancelled choices, admits the first request

    asyncio.run(submit())
    engine.run_until_done([first])
    assert engine.finished["cancelled"] == 2 and sum(engine.finished.values()) == 3 and engine.waiting == 0
    assert engine.prompt_tokens == len("first")  # only the first request was prefilled


def test_a_choice_that_fails_is_an_error_body_streamed_or_not(model):
    """A choice whose generation fails (its prefill raised) ends a stream with OpenAI's error
    body carrying the engine's message, not a chunk with finish_reason "error"; unstreamed it is a 500."""
    from fastapi.testclient import TestClient

    from looplm.infer.prefill import Prefill

    class Failing(Prefill):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("the prefill failed")

    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2), prefill=Failing())
    body = {"model": NAME, "prompt": "abc", "max_tokens": 4}
    with TestClient(create_app(engine, NAME)) as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 500 and "the prefill failed" in whole.json()["error"]["message"]
        streamed = http.post("/v1/completions", json={**body, "stream": True})
    data = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    errors = [d["error"] for d in data if "error" in d]
    assert len(errors) == 1 and errors[0]["type"] == "server_error" and "the prefill failed" in errors[0]["message"]
    assert not any(c.get("finish_reason") for d in data for c in d.get("choices", []))


def test_a_streamed_run_of_tokens_belongs_to_one_choice():
    """Events that arrived together are sent as one chunk per run of consecutive tokens of
    one choice; tokens of two choices side by side are two runs."""
    from looplm.serve.engine import Finish
    from looplm.serve.events import _runs

    a, b, c, d = (Token(t, chr(t), 2) for t in b"abcd")
    end = Finish("length", "ab", "", 1, 2, 2.0)
    batch = [(0, a), (1, b), (1, c), (0, d), (0, end), (1, a)]
    assert _runs(batch) == [(0, [a]), (1, [b, c]), (0, [d]), (0, end), (1, [a])]


def test_the_model_card_gives_the_engines_slot_length(model):
    """The model card's max_model_len is the engine's slot (`max_seq_len` 32 here), what a
    request may fill, not the model's context (64)."""
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2, max_seq_len=32))
    with TestClient(create_app(engine, NAME)) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 32
        assert http.get(f"/v1/models/{NAME}").json()["max_model_len"] == 32


def test_error_bodies_name_the_field_the_kind_and_the_code(model):
    """A body that fails validation names its field as the client sent it (`max_tokens`,
    not `body.max_tokens`); a body that is not JSON says so; an unknown path is a 404
    `not_found_error`; a request to a stopped engine is a 503 `shutting_down`."""
    from fastapi.testclient import TestClient

    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    ok = {"model": NAME, "prompt": "ab", "max_tokens": 2}
    with TestClient(create_app(engine, NAME)) as http:
        r = http.post("/v1/completions", json={**ok, "max_tokens": "many"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens" and error["message"].startswith("max_tokens: ")
        json_type = {"content-type": "application/json"}
        r = http.post("/v1/completions", content="{not json", headers=json_type)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "the request body is not valid JSON",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        r = http.post("/v1/completions", content='{"prompt": "a", "temperature": NaN}', headers=json_type)
        assert r.json()["error"]["message"] == "temperature: Input should be a finite number", r.text  # was "<= 100"
        chat = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
        r = http.post("/v1/chat/completions", content=chat, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text", r.text
        assert r.json()["error"]["message"].startswith("messages[0].content[0].text: contains an unpaired surrogate")
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        engine.shutdown()
        r = http.post("/v1/completions", json=ok)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert r.json()["error"]["type"] == "server_error"


def test_request_fields_at_their_limits():
    """Four stop strings (OpenAI's most) are accepted; a chat's
    max_completion_tokens wins over the older max_tokens; top_logprobs 0 without logprobs asks for
    nothing; a frequency_penalty, like a presence_penalty, is refused."""
    from pydantic import ValidationError

    from looplm.serve.protocol import ChatRequest, CompletionRequest

    four = ["a", "b", "c", "d"]
    assert CompletionRequest(prompt="x", stop=four).stop_strings() == tuple(four)
    messages = [{"role": "user", "content": "hi"}]
    assert ChatRequest(messages=messages, max_tokens=2, max_completion_tokens=5).budget(10, 64) == 5
    assert ChatRequest(messages=messages, top_logprobs=0).logprob_count() is None
    with pytest.raises(ValidationError, match="frequency_penalty"):
        CompletionRequest(prompt="x", frequency_penalty=0.5)


# -- replies: choices of several prompts, logprobs 0, empty deltas, offsets after a split character ----------
def _stream_chunks(http, path: str, body: dict) -> list[dict]:
    stream = http.post(path, json={**body, "stream": True})
    assert stream.status_code == 200, stream.text
    return [
        json.loads(line[6:])
        for line in stream.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_echoed_logprobs_of_n_choices_per_prompt_score_their_own_prompt():
    """Two prompts, n = 2: choice i answers prompt i // 2, and with echo + logprobs its logprobs start with
    that prompt's tokens (null score first), then the reply's, with offsets past that prompt's text."""
    from fastapi.testclient import TestClient

    prompts, reply = ["ab", "wxyz"], "ok"
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": prompts, "n": 2, "echo": True, "logprobs": 1, "max_tokens": 2, "seed": 1}
        choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = prompts[c["index"] // 2]
        lp = c["logprobs"]
        assert c["text"] == prompt + reply
        assert lp["tokens"] == list(prompt + reply)
        assert lp["token_logprobs"] == [None] + [-1.0] * (len(prompt) - 1) + [-0.5] * len(reply)
        assert lp["text_offset"] == list(range(len(prompt) + len(reply)))


def test_echo_with_logprobs_0_scores_the_prompt_too():
    """logprobs 0 asks for the chosen tokens' log-probabilities without alternatives: with echo the prompt's
    tokens come first (as with logprobs >= 1), streamed or not."""
    from fastapi.testclient import TestClient

    prompt, reply = "abc", "de"
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2}
        lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        assert lp["tokens"] == list(prompt + reply)
        assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
        assert lp["text_offset"] == [0, 1, 2, 3, 4]
        streamed = [
            t for c in _stream_chunks(http, "/v1/completions", body) for t in c["choices"][0]["logprobs"]["tokens"]
        ]
        assert streamed == lp["tokens"]


def test_a_stream_sends_no_empty_text_chunk_and_a_chat_stream_sends_every_tokens_logprobs():
    """A character split over byte tokens: a completion stream without logprobs sends no chunk with empty
    text for its first bytes (only the whole character); a chat stream with logprobs sends each byte's
    entry all the same (3 for one 3-byte character), and its last chunk's delta is empty when nothing
    was held back."""
    from fastapi.testclient import TestClient

    reply = "\u65e5x"  # 3 bytes, then 1
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": "ab", "max_tokens": 4}
        chunks = _stream_chunks(http, "/v1/completions", body)
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
        assert "".join(texts) == reply and all(texts)

        chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
        chunks = _stream_chunks(http, "/v1/chat/completions", chat)
        entries = [
            e
            for c in chunks
            if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert [e["bytes"] for e in entries] == [[b] for b in reply.encode()]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == reply
        last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        assert len(last) == 1 and last[0]["choices"][0]["delta"] == {}


def test_offsets_after_a_prompt_that_ends_inside_a_character():
    """A prompt of token ids ending with the lead byte of a 2-byte character, a reply starting with a
    continuation byte: the reply is decoded on its own (its first byte does not complete the prompt's
    character: it is a U+FFFD of its own), and its offsets index that text."""
    from fastapi.testclient import TestClient

    reply = b"\xb4" + "\u65e5\u672c!".encode()
    text = reply.decode("utf-8", errors="replace")
    with TestClient(create_app(_ScriptedEngine(reply), NAME)) as http:
        body = {"model": NAME, "prompt": [104, 0xD7], "max_tokens": len(reply), "logprobs": 1}
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["text"] == text == "\ufffd\u65e5\u672c!"
        assert choice["logprobs"]["text_offset"] == _offsets_by_incremental_decoder(reply) == [0, 1, 1, 1, 2, 2, 2, 3]
        _, merged = _streamed_logprobs(http, body)
        assert merged["text_offset"] == choice["logprobs"]["text_offset"]


def test_offsets_decode_a_short_window_however_long_the_reply():
    """`Offsets` decodes a window that slides past each whole character, so a token costs the same at any
    length: over a long reply of 3-byte characters no decode sees more than a few ids (the window used to
    stop sliding at the first character split over tokens), and the offsets are each byte's character."""
    from looplm.serve.replies import Offsets

    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids, *args, **kwargs):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids, *args, **kwargs)

    text = "\u65e5\u672c" * 40 + "ab" * 20
    offsets = Offsets(Counting())
    got = [offsets.push(b) for b in text.encode()]
    assert got == _char_of_each_byte(text)
    assert Counting.longest <= 8, Counting.longest


def test_a_token_event_without_text_is_a_chunk_only_when_it_carries_logprobs():
    """The first byte of a split character is a `Token` with no text yet. Alone in an event (a reader that
    keeps up gets one event per token): a completion chunk without logprobs has nothing to send (None, no
    empty-text chunk); a chat chunk with logprobs still sends the byte's entry (else its log-probability
    never reaches the client), and one without logprobs sends nothing."""
    from looplm.serve.protocol import ChatRequest, CompletionRequest
    from looplm.serve.replies import ChatReply, CompletionReply, Envelope

    env = Envelope("x", NAME, 0)
    partial, whole = [Token(0xE6, "", 1, -0.25, [(0xE6, -0.25)])], [Token(97, "a", 1, -0.5, [(97, -0.5)])]
    body = CompletionRequest(model=NAME, prompt="ab", max_tokens=4, stream=True)
    reply = CompletionReply(TOK, body, [TOK.encode("ab")], env)
    reply.start(0)
    assert reply.event(0, partial) is None
    assert reply.event(0, whole)["choices"][0]["text"] == "a"

    messages = [{"role": "user", "content": "hi"}]
    chat = ChatReply(TOK, ChatRequest(model=NAME, messages=messages, logprobs=True), 3, 0, env)
    chunk = chat.event(0, partial)
    assert chunk["choices"][0]["delta"] == {"content": ""}
    entry = {"token": "bytes:\\xe6", "logprob": -0.25, "bytes": [0xE6]}
    assert chunk["choices"][0]["logprobs"]["content"] == [{**entry, "top_logprobs": [entry]}]
    assert ChatReply(TOK, ChatRequest(model=NAME, messages=messages), 3, None, env).event(0, partial) is None


def test_events_that_arrived_together_are_read_as_one_batch(model):
    """`Choices.batches` hands every event already queued to the reader at once (one SSE write for them),
    in arrival order: two choices run to the end before the reader wakes give one batch of all their
    tokens and finishes."""
    import asyncio

    from looplm.serve.engine import Finish
    from looplm.serve.events import Choices

    class Connected:
        async def is_disconnected(self):
            return False

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    reqs = [Request(TOK.encode(p), SamplingConfig(n), example_id=i) for i, (p, n) in enumerate([("ab", 4), ("x", 3)])]

    async def read():
        choices = Choices(engine, reqs)
        engine.run_until_done(choices.handles)  # on this thread: every event waits in the loop's queue
        await asyncio.sleep(0)  # the engine's posts run
        return [batch async for batch in choices.batches(Connected())]

    batches = asyncio.run(read())
    assert len(batches) == 1
    (batch,) = batches
    finishes = [(i, ev) for i, ev in batch if isinstance(ev, Finish)]
    assert sorted(i for i, _ in finishes) == [0, 1]
    for i, fin in finishes:
        assert sum(isinstance(ev, Token) for j, ev in batch if j == i) == fin.completion_tokens


def test_the_mailbox_wakes_the_loop_once_for_the_events_posted_before_it_runs():
    """`Mailbox.post` from the engine's thread: the events a step posts to several requests' queues
    while the loop is busy cost one `call_soon_threadsafe` (one wake-up), arrive on their queues in
    the order posted, and a post after that delivery schedules a new one."""
    import asyncio
    import threading

    from looplm.serve.events import Mailbox

    async def run():
        loop = asyncio.get_running_loop()
        scheduled = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda f, *a: (scheduled.append(f), real(f, *a))[1]
        box = Mailbox.of(loop)
        assert Mailbox.of(loop) is box
        queues = [asyncio.Queue() for _ in range(3)]
        step = [(queues[j % 3], (j % 3, j)) for j in range(12)]  # a step's events for 3 requests
        poster = threading.Thread(target=lambda: [box.post(q, item) for q, item in step])
        poster.start()
        poster.join()  # the loop has not run meanwhile: one delivery is scheduled for all twelve
        assert len(scheduled) == 1
        await asyncio.sleep(0)
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [
            [(i, j) for j in range(i, 12, 3)] for i in range(3)
        ]
        threading.Thread(target=box.post, args=(queues[0], "next")).start()
        for _ in range(100):
            if not queues[0].empty():
                break
            await asyncio.sleep(0.01)
        assert len(scheduled) == 2 and queues[0].get_nowait() == "next"

    asyncio.run(run())


def test_a_client_that_leaves_after_some_choices_finished_gets_no_body(model):
    """`collect` answers None (a 499) when the client leaves before every choice finished, also when some
    had: choice 0 (one token) ends at its prefill, choice 1 is still running when the client is gone."""
    import asyncio

    from looplm.serve.events import Choices, collect

    class Gone:
        async def is_disconnected(self):
            return True

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    reqs = [Request(TOK.encode("ab"), SamplingConfig(1)), Request(TOK.encode("x"), SamplingConfig(8))]

    async def read():
        choices = Choices(engine, reqs)
        engine.step()  # both prefill: choice 0 finishes, choice 1 has its first token
        await asyncio.sleep(0)  # the engine's posts run
        assert choices.handles[0].finish is not None and choices.handles[1].finish is None
        return await collect(choices, Gone())

    assert asyncio.run(read()) is None
    engine.step()  # the unfinished choice was cancelled
    assert engine.running == 0 and engine.finished == {"length": 1, "cancelled": 1}
