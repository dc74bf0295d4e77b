"""`gpn serve` as a user meets it: the `openai` client against a real server process on 127.0.0.1.

One server for the module (a tiny GPN with a BPE tokenizer and a chat template, made here), pinned to the
model, with the state store, a spill folder and small limits. What it must do:
- chat (plain and streamed) and completions give, greedy, the tokens of `generate()` on the whole prompt in
  this process (serving without the store), while later turns continue from kept states
  (`usage.prompt_tokens_details.cached_tokens`);
- `n` answers; `/v1/models` and `/health`;
- clients at once each get the answer they get alone, a seeded sample too;
- the refusals: bad input is a 4xx naming the problem (never a 500), a request past the context limit a 400,
  one past the queue limit a 429 saying when to retry, and a client that goes away, mid-stream or not, frees its slot.
A server of its own, not pinned, serves two models: each continues from its own states, across an unload.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai  # the test extra has it, with the serving extra's server stack: missing, these tests fail, never skip
import pytest
import torch

from ..environment import REPO_ROOT
from ..tiny_models import copy_with_a_nan_weight, perturbed_model, state_sensitive_model, tiny_config
from .doc_blocks import ALL_BLOCKS

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_QUEUED = 6
MAX_CONTEXT = 200_000  # room for the long streams the disconnect test cuts short
MAX_REQUEST_BYTES = 1 << 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny GPN folder: its own BPE tokenizer with a chat template, generation ending at `<|end|>`."""
    from modeling_gpn.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("served-gpn")
    tokenizer = train_bpe_tokenizer(
        ["the cat sat on the mat. " * 20, "to be or not to be, that is the question " * 20], 300
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"))
    # (a model whose answers depend on the whole conversation: on `perturbed_model`'s, a kept state shared between
    # requests, or continued from the wrong point, gave the answers of the right one)
    state_sensitive_model(config, seed=40, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model and tokenizer in this process: `generate()` on the whole prompt, as serving without the store."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def bare_handler(kind: type, manager=None, state=None):
    """A `gpn serve` handler of `kind` outside a server: no store, no context limit, one slot, and a model manager
    without transformers' idle-unload timer (a non-daemon 300 s threading.Timer, which kept the test process alive
    for 5 minutes after the tests finished)."""
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    from modeling_gpn.serve.handlers import Admission, ServingPolicy

    return kind(
        model_manager=manager or ModelManager(device="cpu", model_timeout=-1),
        generation_state=state or GenerationState(),
        policy=ServingPolicy(store=None, max_context=None, admission=Admission(1)),
    )


def launched(
    model_dir: Path | None, log_path: Path, *options: str, program: tuple[str, ...] = ("-m", "gpn_cli")
) -> subprocess.Popen:
    """`gpn serve MODEL --device cpu OPTIONS` (without MODEL when None: not pinned) started in its own process on
    `--port 0`, its output in `log_path`: the process, not waited for (`wait_until_up` gives its address). `program`:
    what runs `gpn`, a script that wraps it (HOLDS_MARKED_PROMPTS)."""
    # Port 0: the server binds a port the system gives it, and says which. A port found free here and bound by the
    # server seconds later (after its imports) could be taken meanwhile by anything on the machine.
    command = [
        sys.executable,
        *program,
        "serve",
        *([] if model_dir is None else [str(model_dir)]),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        "cpu",
        *options,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)


# The line a server says where it listens with (uvicorn's), the port the system gave it under `--port 0` included.
LISTENING = re.compile(r"^.*Uvicorn running on (http://127\.0\.0\.1:(\d+)) \(Press CTRL\+C to quit\)$", re.MULTILINE)


def wait_until_up(process: subprocess.Popen, log_path: Path) -> str:
    """The address of the server `launched` (the one its log says it listens on), once it answers /health there
    (failing the test if it exits or takes 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        listening = LISTENING.search(log_path.read_text(encoding="utf-8"))
        if listening and int(listening[2]) != 0 and status_if_up(listening[1] + "/health") == 200:
            return listening[1]
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"gpn serve did not come up (exit {process.poll()}):\n{log_path.read_text(encoding='utf-8')[-3000:]}"
            )
        time.sleep(0.2)


def stopped(process: subprocess.Popen) -> None:
    """Terminate `process` if it is still running (killed if it has not ended 15 s later)."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)


@contextlib.contextmanager
def serving(model_dir: Path | None, log_path: Path, *options: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`gpn serve MODEL --device cpu OPTIONS` (`launched`) as a block: (its address, the process), once /health
    answers; killed at the end if it is still running."""
    process = launched(model_dir, log_path, *options)
    try:
        yield wait_until_up(process, log_path), process
    finally:
        stopped(process)


# `gpn serve` (`python -m gpn_cli`) whose completions' tokenization ahead of transformers' handler (in the worker
# thread) waits, for a prompt that begins with HELD, until the file FOLDER/release exists (at most 30 s), having made
# FOLDER/held. The large-prompt test holds its prompt there while other requests are answered: a second or so of
# real tokenization, awaited with a sleep, was a race that a fast machine (or a slow test thread) could lose.
HELD = "[held] "
HOLDS_MARKED_PROMPTS = f"""
import runpy, sys, time
from pathlib import Path
from modeling_gpn.serve.handlers import StateKeepingCompletionHandler as Completions

folder = Path(sys.argv.pop(1))
tokenize_ahead = Completions._tokenize_ahead


def held_then_tokenized(self, body, *args):
    if str(body.get("prompt", "")).startswith({HELD!r}):
        (folder / "held").touch()
        deadline = time.monotonic() + 30
        while not (folder / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return tokenize_ahead(self, body, *args)


Completions._tokenize_ahead = held_then_tokenized
runpy.run_module("gpn_cli", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def holds(tmp_path_factory) -> Path:
    """The folder through which the pinned server's marked prompts are held (HOLDS_MARKED_PROMPTS)."""
    folder = tmp_path_factory.mktemp("holds")
    (folder / "holds_marked_prompts.py").write_text(HOLDS_MARKED_PROMPTS, encoding="utf-8")
    return folder


# The servers of this module that need nothing of the tests before them, each started as a user starts it: name ->
# the fixture (or test) that serves through it. Started at once by `launched_servers` (each import costs seconds of
# one core: one after another, they leave the other idle).
SERVERS = {
    "pinned": "server",
    "unpinned": "unpinned_server",
    "restart": "test_a_conversation_continues_after_the_server_is_stopped_and_restarted",
}


@pytest.fixture(scope="module")
def launched_servers(request, tmp_path_factory, holds) -> Iterator[dict[str, tuple[str, subprocess.Popen, Path, Path]]]:
    """The module's servers that the selected tests use (`SERVERS`: the pinned `server`, the `unpinned_server`, the
    first server of the restart test), launched together at the first test that needs one; each is waited for where
    it is used (`wait_until_up`, which gives its address), and all are stopped at the module's end. Name -> (process,
    log, state folder)."""
    items = [item for item in request.session.items if item.module is request.module]
    used = [
        name
        for name, user in SERVERS.items()
        if any(user in item.fixturenames or item.originalname == user for item in items)
    ]
    model_dir = request.getfixturevalue("model_dir") if {"pinned", "restart"} & set(used) else None
    limits = ["--max-queued-requests", str(MAX_QUEUED), "--max-context", str(MAX_CONTEXT)]
    limits += ["--max-request-bytes", str(MAX_REQUEST_BYTES)]
    options = {
        "pinned": (model_dir, limits),
        "unpinned": (None, ["--model-timeout", "2"]),
        "restart": (model_dir, ["--dtype", "int8"]),  # (the restart test serves a quantized model too)
    }
    launches = {}
    try:
        for name in used:
            states, log_path = tmp_path_factory.mktemp(f"{name}-states"), tmp_path_factory.mktemp("log") / f"{name}.log"
            if name == "restart":  # (a folder the server makes, as the test's own was)
                states = states / "states"
            model, extra = options[name]
            # (the pinned one through HOLDS_MARKED_PROMPTS: the large-prompt test holds its prompt there)
            program = (str(holds / "holds_marked_prompts.py"), str(holds)) if name == "pinned" else ("-m", "gpn_cli")
            process = launched(model, log_path, "--state-dir", str(states), *extra, program=program)
            launches[name] = (process, log_path, states)
        yield launches
    finally:
        for process, _, _ in launches.values():
            stopped(process)


@pytest.fixture(scope="module")
def server(launched_servers):
    """`gpn serve MODEL` in its own process, with the state store, a spill folder and small limits."""
    process, log_path, _ = launched_servers["pinned"]
    return wait_until_up(process, log_path)


class Unanswered(AssertionError):
    """A GET that got no HTTP answer: refused, reset, or none within its timeout; the message names the URL."""


def get(url: str, timeout: float = 5) -> tuple[int, dict | None]:
    """GET `url`: (its status, its JSON body; None for an error status). No answer within `timeout` s, or none at
    all (refused, reset), raises `Unanswered` naming the URL and what happened: it was (None, None), and a test
    that expected a status said only that it got None."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, None
    except OSError as error:
        reason = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(reason, TimeoutError):
            raise Unanswered(f"GET {url}: timed out, no answer within {timeout} s") from error
        raise Unanswered(f"GET {url}: no answer: {reason!r}") from error


def status_if_up(url: str) -> int | None:
    """The status of GET `url`, None while nothing answers there (refused, or no answer within 5 s): for polling a
    server that is coming up."""
    try:
        return get(url)[0]
    except Unanswered:
        return None


@pytest.fixture(scope="module")
def unpinned_server(launched_servers):
    """`gpn serve` without MODEL (each request names its model, loaded on demand and unloaded after 2 idle
    seconds), with the state store and a spill folder: one process for the tests that serve folders of their own."""
    process, log_path, _ = launched_servers["unpinned"]
    return wait_until_up(process, log_path)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def model_name(model_dir) -> str:
    return str(model_dir)


def expected_chat(reference, messages: list[dict], max_tokens: int, streamed: bool = False, **generation) -> str:
    model, tokenizer = reference
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **generation)
    return as_text(tokenizer, out[0, inputs["input_ids"].shape[1] :], streamed)


def api_penalties(logits: torch.Tensor, answer: list[int], frequency: float, presence: float) -> torch.Tensor:
    """The OpenAI API's penalties, as its docs write them: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j]
    the times the answer so far holds token j (the prompt does not count)."""
    counts = torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=logits.shape[-1]).to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def penalized_greedy(
    reference, messages: list[dict], max_tokens: int, frequency: float, presence: float, prompt_counts: bool = False
) -> str:
    """A greedy answer under the API's penalties, one forward of the whole sequence a token (no cache); with
    `prompt_counts`, the prompt's tokens counted too (the way the API does not)."""
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt, answer = ids["input_ids"][0].tolist(), []
    with torch.no_grad():
        for _ in range(max_tokens):
            counted = prompt + answer if prompt_counts else answer
            logits = api_penalties(model(torch.tensor([prompt + answer])).logits[0, -1], counted, frequency, presence)
            answer.append(int(logits.argmax()))
            if answer[-1] == model.generation_config.eos_token_id:
                break
    return as_text(tokenizer, torch.tensor(answer), False)


def as_text(tokenizer, ids: torch.Tensor, streamed: bool) -> str:
    """The answer's text as the server sends it, streamed or not: decoded whole. (transformers' streamer never
    sends an unfinished UTF-8 character at the end: the stream's last chunk adds it,
    `test_a_streamed_answer_that_ends_inside_a_character_ends_as_the_answer_does`.)"""
    return tokenizer.decode(ids, skip_special_tokens=True)


def streamed_text(stream) -> tuple[str, object]:
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(parts), usage


def test_a_server_started_on_port_0_says_the_port_it_listens_on(launched_servers, unpinned_server):
    """`gpn serve --port 0` (as every server of this module is started: a port found free here could be taken before
    the server binds it) listens on a port the system gives it, and its line says which: it answers there. (Not
    transformers serve's default port: a --port not passed on to the server listened there, and answered.)"""
    from modeling_gpn.serve.cli import _serve_parameters

    process, log_path, _ = launched_servers["unpinned"]
    assert process.args[process.args.index("--port") + 1] == "0"
    [line] = LISTENING.findall(log_path.read_text(encoding="utf-8"))
    default_port = next(default for name, *_, default in _serve_parameters() if name == "port")
    assert line[0] == unpinned_server and int(line[1]) not in (0, default_port), line
    assert get(unpinned_server + "/health") == (200, {"status": "ok"})


def test_a_get_that_gets_no_answer_fails_naming_the_url_and_what_happened():
    """`get` answered (None, None) for any request that failed, and a test that expected a status said only that it
    got None: it now raises, naming the URL and a timeout as such; `status_if_up`, for the callers that poll a server
    coming up, gives None."""
    with socket.socket() as silent, socket.socket() as closed:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # (the connection is made, in its backlog, and never answered)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/health"
        with pytest.raises(Unanswered, match=rf"^GET {re.escape(url)}: timed out, no answer within 0.2 s$"):
            get(url, timeout=0.2)
        closed.bind(("127.0.0.1", 0))  # (bound, not listening: refused)
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/health"
        with pytest.raises(Unanswered, match=rf"^GET {re.escape(url)}: no answer: .*Connection refused"):
            get(url)
        assert status_if_up(url) is None


def test_chat_turns_continue_from_kept_states_with_the_tokens_of_the_whole_prompt(client, model_name, reference):
    messages = [{"role": "system", "content": "the cat sat"}, {"role": "user", "content": "to be or not to be"}]
    previous_prompt = None
    for turn in range(3):
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0)
        assert reply.choices[0].message.content == expected_chat(reference, messages, 10)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if previous_prompt is None:
            assert cached == 0
        else:  # the last turn's prompt (all but its last token, at least) was not read again
            assert previous_prompt - 1 <= cached < reply.usage.prompt_tokens
        previous_prompt = reply.usage.prompt_tokens
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "that is the question " * (turn + 1)},
        ]
    # streamed: the same tokens, the usage in the last chunk
    text, usage = streamed_text(
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert text == expected_chat(reference, messages, 10, streamed=True)
    assert usage.prompt_tokens_details.cached_tokens >= previous_prompt - 1


def test_the_readmes_serving_session_runs_against_a_served_gpn(server, model_name, reference, capsys):
    """The README's serving block (```` ```python serving ````: chat, a streamed second turn, a completion),
    run as written but for the address and the model: the server of this module and its tiny GPN."""
    (block,) = [b for b in ALL_BLOCKS if b.path.name == "README.md" and "serving" in b.options]
    assert "http://127.0.0.1:8000/v1" in block.code and '"me/gpn-tiny"' in block.code, block.where
    code = block.code.replace("http://127.0.0.1:8000/v1", server + "/v1").replace('"me/gpn-tiny"', repr(model_name))
    namespace: dict = {}
    exec(compile(code, block.where, "exec"), namespace)
    first_turn = namespace["messages"][:1]
    assert namespace["reply"].choices[0].message.content == expected_chat(reference, first_turn, 60)
    # what it printed: the streamed second turn (greedy, as a GPN answers without a temperature), from the state
    # the first kept, then the completion
    model, tokenizer = reference
    second_turn = expected_chat(reference, namespace["messages"], 60, streamed=True)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        completion = model.generate(**inputs, max_new_tokens=20, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert second_turn and second_turn != expected_chat(reference, namespace["messages"][-1:], 60, streamed=True)
    assert capsys.readouterr().out == second_turn + as_text(tokenizer, completion, False) + "\n"


def test_completions_plain_and_streamed(client, model_name, reference):
    model, tokenizer = reference
    prompt = "the cat sat on the"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        answer = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1] :]
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert plain.choices[0].text == as_text(tokenizer, answer, False) and plain.usage.completion_tokens == 8
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == as_text(tokenizer, answer, True)
    longer = client.completions.create(model=model_name, prompt=prompt + " mat. to be", max_tokens=4, temperature=0)
    assert longer.usage.prompt_tokens_details.cached_tokens >= ids["input_ids"].shape[1] - 1


def test_a_streamed_answer_that_ends_inside_a_character_ends_as_the_answer_does(client, model_name, reference):
    """An answer cut at its max_tokens inside a character (here the byte 0xE4, the first of 你's three, forced by
    logit_bias) decodes with U+FFFD at its end; transformers' stream holds text ending in U+FFFD back until a token
    completes it, so the streamed answer lacked it. The stream now sends it when generation ends: streamed and not
    streamed agree, and no text before the stream's last carries a replacement character."""
    _, tokenizer = reference
    byte = tokenizer.convert_tokens_to_ids("ä")  # (byte-level BPE spells the byte 0xE4 as "ä")
    request = dict(model=model_name, prompt="the cat", max_tokens=2, temperature=0, logit_bias={str(byte): 100})
    plain = client.completions.create(**request).choices[0].text
    assert plain == tokenizer.decode([byte, byte]) and plain.endswith("\ufffd")
    chunks = [chunk.choices[0] for chunk in client.completions.create(**request, stream=True) if chunk.choices]
    assert "".join(choice.text for choice in chunks) == plain
    texts = [choice.text for choice in chunks if choice.text]
    assert texts[-1].endswith("\ufffd") and not any("\ufffd" in text for text in texts[:-1]), texts


def test_a_stream_goes_on_through_byte_tokens_that_form_no_character(unpinned_server, tmp_path):
    """LLaMA-2's tokenizer spells 龘 in byte tokens, and decodes a run of byte tokens that is no UTF-8 as a whole
    as one U+FFFD a byte: 龘 then <0xE9><0xBE> then "▁hello" is "����� hello". transformers' stream (tokenizers'
    `DecodeStream`) sent 龘, then refused "▁hello" ("Invalid prefix encountered while decoding stream") and the
    stream ended in an error. Now a run of byte tokens is sent once it has ended: the streamed text is the answer's,
    for chat, completions and the Responses API, cut at `max_tokens` inside a run or after a whole character, or
    before a `stop` sequence."""
    from transformers import AutoTokenizer

    from ..environment import require_shared
    from ..tiny_models import BYTE_RUNS, byte_runs_model_dir

    folder = byte_runs_model_dir(tmp_path / "model", require_shared("data/llama2-tokenizer"), CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    client = openai.OpenAI(base_url=unpinned_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model, messages = str(folder), [{"role": "user", "content": "hello"}]
    # 9 tokens: a run that is no UTF-8, "▁hello", then 龘 whole at the end; 11: ending inside a run; a stop
    # sequence after the run, and one (龘) that ends generation at its last byte, the run still held then
    for max_tokens, stop, made in ((9, None, 9), (11, None, 11), (12, ["hello"], 6), (12, ["龘"], 3)):
        request = dict(model=model, prompt="hello", max_tokens=max_tokens, temperature=0, stop=stop)
        plain = client.completions.create(**request)
        whole = tokenizer.decode(BYTE_RUNS[:made] if made <= 6 else (BYTE_RUNS * 2)[:made])
        assert plain.choices[0].text == (whole if stop is None else whole[: whole.index(stop[0])]), plain
        assert plain.usage.completion_tokens == made, plain.usage
        chunks = [chunk.choices[0] for chunk in client.completions.create(**request, stream=True) if chunk.choices]
        assert "".join(choice.text for choice in chunks) == plain.choices[0].text, [c.text for c in chunks]
        assert chunks[-1].finish_reason == ("length" if stop is None else "stop")
    assert tokenizer.decode(BYTE_RUNS[:6]) == "\ufffd" * 5 + " hello"
    request = dict(model=model, messages=messages, max_tokens=9, temperature=0)
    plain = client.chat.completions.create(**request).choices[0].message.content
    assert plain.startswith("\ufffd" * 5 + " hello") and plain.endswith("龘"), plain
    assert streamed_text(client.chat.completions.create(**request, stream=True))[0] == plain
    request = dict(model=model, input=messages, max_output_tokens=9, temperature=0)
    assert client.responses.create(**request, stream=False).output_text == plain
    events = list(client.responses.create(**request, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain, events[-1]


def test_completions_apply_logit_bias_and_refuse_what_they_would_ignore(client, model_name, reference):
    """transformers' completion handler accepts logit_bias, echo, best_of, logprobs and presence_penalty and
    applies none of them, and appends a suffix to the answer (the API inserts the answer before it): logit_bias
    is applied here (as its chat handler applies it; presence_penalty too, `test_penalties_are_the_apis`), the
    others are a 400 naming the field, but for their defaults, which change nothing."""
    model, tokenizer = reference
    prompt = "the cat sat on the"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        plain = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1] :]
        ban = {(int(plain[0]),): -100.0}
        banned = model.generate(**ids, max_new_tokens=6, do_sample=False, sequence_bias=ban)
    banned = banned[0, ids["input_ids"].shape[1] :]
    assert not torch.equal(banned, plain)  # the bias changes this answer: the test can fail
    reply = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(int(plain[0])): -100}
    )
    assert reply.choices[0].text == as_text(tokenizer, banned, False)
    for fields in ({"echo": True}, {"best_of": 3}, {"logprobs": 2}, {"suffix": " END"}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model_name, prompt=prompt, max_tokens=2, **fields)
        assert f"does not support {next(iter(fields))}" in str(refused.value.body)
    defaults = dict(echo=False, best_of=1, logprobs=0, presence_penalty=0, suffix="")
    assert client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0, **defaults).choices
    chat_defaults = dict(logprobs=False, presence_penalty=0, response_format={"type": "text"})
    messages = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, **chat_defaults).choices


def a_stop_inside(text: str) -> tuple[str, int]:
    """A stop sequence of two plain characters that first occurs inside `text` (not at its start), and where."""
    for position in range(1, len(text) - 1):
        stop = text[position : position + 2]
        if all(char.isascii() and (char.isalpha() or char == " ") for char in stop) and text.find(stop) == position:
            return stop, position
    pytest.fail(f"no plain two characters inside {text!r} to stop at")


def test_answers_end_before_their_stop_sequence(client, model_name, reference):
    """The OpenAI API returns the text before a stop sequence ("the returned text will not contain the stop
    sequence"); transformers serve stops at the token that completes it and sends that token's text whole, stop
    sequence and all. Here chat and completions, plain, streamed and with n answers, end before it, "stop"."""
    model, tokenizer = reference
    prompts = {
        "completion": tokenizer("the cat sat on the", return_tensors="pt"),
        "chat": tokenizer.apply_chat_template(
            [{"role": "user", "content": "to be or not"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        ),
    }
    for endpoint, inputs in prompts.items():
        with torch.no_grad():
            answer = model.generate(**inputs, max_new_tokens=20, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        text = as_text(tokenizer, answer, False)
        stop, position = a_stop_inside(text)
        streamed_before_stop = as_text(tokenizer, answer, True).split(stop)[0]
        request = dict(model=model_name, max_tokens=20, temperature=0, stop=[stop, "never in it"])
        if endpoint == "completion":
            request["prompt"] = "the cat sat on the"
            plain = client.completions.create(**request, n=2)
            texts = [choice.text for choice in plain.choices]
            streamed = "".join(
                chunk.choices[0].text for chunk in client.completions.create(**request, stream=True) if chunk.choices
            )
        else:
            request["messages"] = [{"role": "user", "content": "to be or not"}]
            plain = client.chat.completions.create(**request, n=2)
            texts = [choice.message.content for choice in plain.choices]
            streamed, _ = streamed_text(client.chat.completions.create(**request, stream=True))
        assert texts == [text[:position]] * 2, (endpoint, stop, text)
        assert [choice.finish_reason for choice in plain.choices] == ["stop", "stop"]
        assert streamed == streamed_before_stop, (endpoint, stop, text)


def test_an_empty_stop_list_is_no_stop_sequence(client, model_name):
    """`stop: []` is what clients built for vLLM send (its default): the answer is the one without `stop`, as the
    OpenAI API answers it; it was refused ("a list of 1 to 4")."""
    request = dict(model=model_name, max_tokens=6, temperature=0)
    for endpoint, fields in (
        (client.chat.completions, {"messages": [{"role": "user", "content": "to be or not"}]}),
        (client.completions, {"prompt": "the cat sat on the"}),
    ):
        plain, empty = (endpoint.create(**request, **fields, **stop) for stop in ({}, {"stop": []}))
        assert empty.choices[0].model_dump() == plain.choices[0].model_dump()
        assert empty.usage.completion_tokens == plain.usage.completion_tokens == 6


def test_a_stop_sequence_the_prompt_begins_ends_no_answer(client, model_name, reference):
    """A stop sequence begun by the prompt's end and completed by the answer ("cat" + " the" after "the cat") is
    not in the answer's text, which the OpenAI API searches: the answer goes on to max_tokens. (transformers'
    stop-string check reads the prompt too: it ended the answer after one token, "stop", with nothing cut.) One
    naming a special token still ends the answer there."""
    _, tokenizer = reference
    word = tokenizer.convert_tokens_to_ids("Ġthe")
    request = dict(model=model_name, prompt="the cat", max_tokens=3, temperature=0, logit_bias={str(word): 100})
    plain = client.completions.create(**request, stop=["cat the"])
    assert plain.choices[0].text == " the the the" == client.completions.create(**request).choices[0].text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3
    streamed = client.completions.create(**request, stop=["cat the"], stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == " the the the"
    # a stop sequence naming a special token ends the answer at that token (as transformers' check does), though
    # the text sent leaves the token out
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    request["logit_bias"] = {str(user): 100}
    at_user = client.completions.create(**request, stop=["<|user|>"])
    assert at_user.choices[0].finish_reason == "stop" and at_user.usage.completion_tokens == 1


def test_a_stream_holds_back_what_may_begin_a_stop_sequence():
    """A stop sequence spread over several streamed pieces is cut whole: the pieces' text that could begin one
    waits for the next piece, and is sent when it does not."""
    from modeling_gpn.serve.stop_strings import StreamCutter

    cutter = StreamCutter(["\nObservation:", "END"])
    sent = [cutter.feed(piece) for piece in ["Thought: go", "\nObs", "erv", "ation: 42", " more"]]
    assert sent == ["Thought: go", "", "", "", ""] and cutter.stopped and cutter.flush() == ""
    cutter = StreamCutter(["\nObservation:", "END"])
    sent = [cutter.feed(piece) for piece in ["a\nOb", "x E", "N"]] + [cutter.flush()]
    assert "".join(sent) == "a\nObx EN" and sent[0] == "a" and not cutter.stopped


def test_n_answers_models_and_health(client, model_name, reference, server):
    messages = [{"role": "user", "content": "that is the question"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0, n=3)
    expected = expected_chat(reference, messages, 6)
    assert [choice.message.content for choice in reply.choices] == [expected] * 3
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 3 * 6
    banned = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=6, temperature=0, logit_bias={"0": -100}
    )
    assert banned.choices[0].message.content  # an integer bias, as the OpenAI API has it (transformers: a 500)
    sampled = client.completions.create(model=model_name, prompt="to be", max_tokens=5, temperature=1.0, n=4, seed=0)
    assert len({choice.text for choice in sampled.choices}) > 1  # temperature 1 samples (transformers: greedy here)
    assert [model.id for model in client.models.list().data] == [model_name]
    assert get(server + "/health") == (200, {"status": "ok"})
    # pinned, it loads no other model: transformers' /load_model loaded any it was named and kept it for good
    # (a pinned server never unloads), while refusing every request for it
    for name, status in (("no/such-model", 400), (model_name, 200)):
        request = urllib.request.Request(
            server + "/load_model",
            data=json.dumps({"model": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                code, text = answer.status, answer.read().decode()
        except urllib.error.HTTPError as refused:
            code, text = refused.code, refused.read().decode()
        assert (code, "pinned" in text) == (status, status == 400), text


def test_greedy_requests_as_transformers_serve_reads_them_with_the_tokens_of_the_whole_prompt(
    client, model_name, reference
):
    """temperature 0 is greedy whatever top_p (transformers serve: do_sample=False), a generation_config without
    max_new_tokens answers as generate() does without it, and a penalty that looks back over the answer
    (`frequency_penalty`) gives, from a kept state, the tokens of a loop over the whole prompt."""
    messages = [{"role": "user", "content": "the cat sat on the mat. the cat sat on the mat. the cat"}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0, top_p=0.5)
    assert reply.choices[0].message.content == expected_chat(reference, messages, 8)
    # no max_new_tokens in the generation_config, no max_tokens: generate()'s own 20 new tokens, or up to its max_length
    for generation_config, new_tokens in (
        ('{"do_sample": false}', 20),
        ('{"do_sample": false, "max_length": 30}', None),
    ):
        reply = client.chat.completions.create(
            model=model_name, messages=messages, extra_body={"generation_config": generation_config}
        )
        new_tokens = new_tokens or 30 - reply.usage.prompt_tokens
        assert reply.choices[0].message.content == expected_chat(reference, messages, new_tokens)
        assert reply.usage.completion_tokens <= new_tokens
    penalized = penalized_greedy(reference, messages, 12, frequency=1.0, presence=0.0)
    assert penalized != expected_chat(reference, messages, 12)  # the penalty changes this answer: the test can fail
    for _ in range(2):  # the second continues from the state the first kept
        reply = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=12, temperature=0, frequency_penalty=1.0
        )
        assert reply.choices[0].message.content == penalized
    assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens - 1


def test_n_answers_end_where_each_row_finished(client, model_name, reference):
    """Rows of one generate() that finish early are padded (with EOS, when the model has no pad token): each of
    the n answers is cut where its row finished (its EOS kept, or the token that completes a stop string), the
    padding neither in its text nor its token count; an answer that ends so is "stop", even at max_tokens,
    streamed or not."""
    from modeling_gpn.serve.generation import StateKeepingModel
    from modeling_gpn.serve.handlers import _answer_rows

    model, tokenizer = reference
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "to be or not"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = inputs["input_ids"].shape[1]
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, stop_strings=["e"])
    torch.manual_seed(1)
    with torch.no_grad():  # (the server's generate(): its rows stop at a stop string in the answer's text)
        rows = StateKeepingModel(model, None, answers=4).generate(
            inputs["input_ids"], generation_config=config, tokenizer=tokenizer
        )
    eos, padded, at_the_stop_string = model.generation_config.eos_token_id, 0, 0
    for row, (_, ids, stopped) in enumerate(_answer_rows(rows, inputs, config, tokenizer)):
        generated = rows[row, prompt:]
        assert torch.equal(generated[: len(ids)], ids) and (generated[len(ids) :] == eos).all()  # the rest: padding
        padded += len(ids) < len(generated)
        if stopped:  # at its EOS or the first token to complete the stop string, not at the padding after it
            assert "e" not in tokenizer.decode(ids[:-1]), tokenizer.decode(ids)
            at_the_stop_string += int(ids[-1]) != eos
        assert stopped or len(ids) == config.max_new_tokens
    assert padded, "no row ended before another: nothing here could be padding"
    assert at_the_stop_string, "no row ended at the stop string: nothing here checks where one ends"
    # through the server: a greedy answer whose stop string is completed by its max_tokens-th token is "stop"
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert len(answer) == 4 and eos not in answer
    last = tokenizer.decode(answer[-1:])
    assert last.strip() and last not in tokenizer.decode(answer[:-1])
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0, n=2, stop=[last]
    )
    assert [choice.finish_reason for choice in reply.choices] == ["stop", "stop"]
    assert reply.usage.completion_tokens == 2 * 4
    # and one whose EOS is its max_tokens-th token (EOS made certain by logit_bias): "stop", not "length"
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=1, temperature=0, logit_bias={str(eos): 100}
    )
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    # streamed too (transformers: "length" for any stream max_tokens long), and one cut at its length is "length"
    for max_tokens, bias, reason in ((1, {str(eos): 100}, "stop"), (4, None, "length")):
        chunks = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=max_tokens, temperature=0, logit_bias=bias, stream=True
        )
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == reason, max_tokens


def test_responses_answer_through_the_store_with_the_checks_and_limits_of_chat(client, model_name, reference):
    """/v1/responses (transformers' handler) goes through the state store, the request checks and the context
    limit as chat does: the same greedy tokens, a kept state reused, and a 400 naming the problem, never a 500.
    Without `stream`, the answer is one JSON response, as the API's default (transformers streams it: the `openai`
    client, which sent no `stream`, returned the raw event text)."""
    messages = [{"role": "user", "content": "to be or not to be, that is"}]
    for stream in ({}, {"stream": False}):  # the second continues from the state the first kept
        reply = client.responses.create(model=model_name, input=messages, max_output_tokens=6, temperature=0, **stream)
        assert reply.output_text == expected_chat(reference, messages, 6)
    assert reply.usage.input_tokens_details.cached_tokens == reply.usage.input_tokens - 1
    for fields, word in (
        ({"temperature": "hot"}, "temperature"),
        ({"max_output_tokens": MAX_CONTEXT}, "context limit"),
        ({"input": [3]}, "input[0]"),
        ({"previous_response_id": "resp_1"}, "does not support previous_response_id"),  # (transformers ignores it)
        ({"text": {"format": {"type": "json_object"}}}, "does not support text"),
        ({"text": {"verbosity": "low"}}, "does not support text"),
        ({"conversation": "conv_1"}, "does not support conversation"),  # (its stored items would never be read)
        ({"reasoning": {"effort": "high"}}, "does not support reasoning"),
        (  # (transformers: a KeyError, a 500)
            {"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "content": [{"text": "hmm"}]}]},
            "input[1].content[0] (a reasoning item's part) must be an object with a type and a text",
        ),
        ({"context_management": [{"type": "compaction"}]}, "does not support context_management"),
        (
            {"input": [{"type": "input_image", "image_url": "http://x/a.png"}]},
            "input[0] is a part of type 'input_image'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
            "input[0].content[0] is a part of type 'input_image'",
        ),
        (  # (the API's input list holds items, never bare parts; transformers: its 422, naming no item)
            {"input": [{"role": "user", "content": "hi"}, {"type": "input_text", "text": "there"}]},
            "input[1] is a content part (type 'input_text') in a list of items (input[0] is a message)",
        ),
        (
            {"input": [{"type": "input_text", "text": "hi"}, {"type": "reasoning", "content": None}]},
            "input[0] is a content part (type 'input_text') in a list of items (input[1] is an item of type 'reasoning')",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=model_name, input="hi", stream=False, extra_body=fields)
        assert word in str(refused.value.body), refused.value.body


def test_a_response_cut_at_max_output_tokens_is_incomplete(client, model_name, reference):
    """The Responses API marks an answer cut at `max_output_tokens` `status: "incomplete"` (`incomplete_details`
    naming the reason; streamed, its last event is "response.incomplete"); transformers said "completed" for every
    answer, so a client could not tell a cut answer from a finished one. One that ended on EOS at its last allowed
    token (a `generation_config` naming its first token EOS) is complete."""
    model, tokenizer = reference
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=3, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert len(answer) == 3 and model.generation_config.eos_token_id not in answer
    ends_at_first = {"generation_config": json.dumps({"eos_token_id": int(answer[0])})}
    for max_output_tokens, extra, status in ((3, {}, "incomplete"), (1, ends_at_first, "completed")):
        request = dict(model=model_name, input=messages, max_output_tokens=max_output_tokens, temperature=0)
        reply = client.responses.create(**request, stream=False, extra_body=extra)
        assert reply.status == status and reply.usage.output_tokens == max_output_tokens, (status, reply)
        reason = getattr(reply.incomplete_details, "reason", None)
        assert reason == ("max_output_tokens" if status == "incomplete" else None), reply.incomplete_details
        events = list(client.responses.create(**request, stream=True, extra_body=extra))
        assert events[-1].type == f"response.{status}" and events[-1].response.status == status, events[-1]


def test_responses_instructions_come_before_an_input_that_begins_with_a_system_message(client, model_name, reference):
    """The Responses API inserts `instructions` before the input; transformers' handler wrote them over the
    content of the first message it made when that was a system message, which the model then never saw: the
    input's first item, or the first after a reasoning item (which makes no message of its own). An input that
    begins with a reasoning item, which transformers took for one message's content parts (dropping every item), is
    read as items."""
    instructions = {"role": "system", "content": "that is the question"}
    given = [{"role": "system", "content": "the cat sat on the mat"}, {"role": "user", "content": "to be or not"}]
    expected = expected_chat(reference, [instructions, *given], 12)
    assert expected != expected_chat(reference, [instructions, given[1]], 12)  # the system message counts here
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]}
    for before in ([], [reasoning], [{**reasoning, "role": "assistant"}]):
        reply = client.responses.create(
            model=model_name,
            instructions=instructions["content"],
            input=[*before, *given],
            max_output_tokens=12,
            temperature=0,
            stream=False,
        )
        assert reply.output_text == expected, before


def test_clients_at_once_each_get_their_own_answer(client, model_name, reference):
    """Branches of one conversation at once: each continues from the same kept state, and none disturbs another."""
    history = [{"role": "system", "content": "the cat sat on the mat"}, {"role": "user", "content": "to be"}]
    first = client.chat.completions.create(model=model_name, messages=history, max_tokens=5, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}]
    branches = [
        history + [{"role": "user", "content": f"{'or not ' * (index + 1)}to be"}] for index in range(MAX_QUEUED)
    ]
    expected = [
        expected_chat(reference, messages, 12, streamed=bool(index % 2)) for index, messages in enumerate(branches)
    ]
    answers: dict[int, tuple[str, int]] = {}
    start = threading.Barrier(len(branches))

    def ask(index: int) -> None:
        start.wait()
        request = dict(model=model_name, messages=branches[index], max_tokens=12, temperature=0)
        if index % 2:
            text, usage = streamed_text(client.chat.completions.create(**request, stream=True))
        else:
            reply = client.chat.completions.create(**request)
            text, usage = reply.choices[0].message.content, reply.usage
        answers[index] = text, usage.prompt_tokens_details.cached_tokens

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(branches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [answers.get(index, (None,))[0] for index in range(len(branches))] == expected
    assert all(answers[index][1] >= first.usage.prompt_tokens - 1 for index in range(len(branches)))


def test_a_seed_gives_the_same_sample_whatever_runs_beside_it(client, model_name):
    """A request's `seed` gives the same sampled answer asked alone (its prompt read whole) and asked while other
    sampled requests arrive and generate (continuing from the state the first kept): the seed is applied when the
    request's generate() starts, not when the request arrives (transformers serve), which reseeds the generator
    the request generating then draws from."""
    seeds = range(1, MAX_QUEUED + 1)

    def sample(seed: int) -> str:
        request = dict(model=model_name, prompt=f"the cat sat {seed}", max_tokens=16, temperature=1.0, seed=seed)
        return client.completions.create(**request).choices[0].text

    alone = {seed: sample(seed) for seed in seeds}
    assert len(set(alone.values())) == len(alone)  # they sample: a reseeded generator would change them
    at_once: dict[int, str] = {}
    start = threading.Barrier(len(alone))

    def ask(seed: int) -> None:
        start.wait()
        at_once[seed] = sample(seed)

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert at_once == alone


def test_a_sample_is_drawn_from_the_whole_distribution_as_the_openai_api_draws_it(client, model_name, reference):
    """The OpenAI API has no top_k: `temperature` samples from every token. A GPN's generation config sets no top_k,
    so generate() would keep only the 50 likeliest (its library default): the seeded sample here is generate()'s
    with top_k=0, which differs from the truncated one."""
    model, tokenizer = reference
    prompt = "the cat sat"
    inputs = tokenizer(prompt, return_tensors="pt")
    samples = {}
    for top_k in (0, None):  # None: not given, generate()'s default, the 50 likeliest tokens
        torch.manual_seed(0)
        with torch.no_grad():
            given = {} if top_k is None else {"top_k": top_k}
            out = model.generate(**inputs, max_new_tokens=12, do_sample=True, temperature=2.0, **given)
        samples[top_k] = out[0, inputs["input_ids"].shape[1] :]
    assert not torch.equal(samples[0], samples[None])  # the truncation changes this sample: the test can fail
    reply = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=2.0, seed=0)
    assert reply.choices[0].text == as_text(tokenizer, samples[0], False)


def test_penalties_are_the_apis(client, model_name, reference):
    """`frequency_penalty` and `presence_penalty` as the OpenAI API applies them: each token's logit lowered by its
    count in the answer so far (not the prompt), and once it is there, before temperature scales the logits
    (transformers serve: a repetition penalty of 1 + frequency_penalty dividing the logits of the prompt's tokens
    too, and presence_penalty ignored): each greedy answer is a loop of the API's formula. (This tiny model's
    logits are small: each case is one whose text tells the API's way from the others, asserted so.)"""
    repeated = [{"role": "user", "content": "the cat sat on the mat. the cat sat on the mat. the cat"}]
    for messages, frequency, presence, others in (
        (repeated, 0.05, 0.0, [(0.0, 0.0, False), (0.05, 0.0, True)]),  # (the prompt counted: transformers' way)
        (repeated, 0.02, 0.0, [(0.0, 0.0, False), (0.0, 0.02, False)]),
        (repeated, 0.0, 0.02, [(0.0, 0.0, False), (0.02, 0.0, False)]),
    ):
        expected = penalized_greedy(reference, messages, 12, frequency, presence)
        for other in others:  # the case can fail
            assert expected != penalized_greedy(reference, messages, 12, *other), (frequency, presence, other)
        reply = client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=12,
            temperature=0,
            frequency_penalty=frequency,
            presence_penalty=presence,
        )
        assert reply.choices[0].message.content == expected, (frequency, presence)


def test_sampled_penalties_come_before_the_temperature_and_the_cuts():
    """The API penalises the logits, then samples at its temperature and top_p: generate() applies its own
    temperature, top-k and top-p before any processor it is given, so `Penalties` takes them out of the request's
    generation config and applies them after the penalties. (This tiny model's nearly uniform logits draw the same
    seeded sample in either order, so the order is checked on the logits the processors give.)"""
    from transformers import GenerationConfig, TopKLogitsWarper, TopPLogitsWarper

    from modeling_gpn.serve.generation import Penalties

    torch.manual_seed(0)
    scores, prompt, answer = torch.randn(2, 50) * 3, [7, 8, 9], [[3, 3, 5], [9, 4, 4]]
    ids = torch.tensor([prompt + row for row in answer])
    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=20, top_p=0.9)
    chain = Penalties(1.5, 0.5).processors(config, prompt_length=len(prompt))
    assert (config.temperature, config.top_k, config.top_p) == (1.0, 0, 1.0)  # generate() applies none of them
    given = scores
    for processor in chain:
        given = processor(ids, given)
    expected = torch.stack([api_penalties(scores[r], answer[r], 1.5, 0.5) for r in range(2)]) / 0.5
    expected = TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(20)(ids, expected))  # (generate()'s own cuts, in its order)
    assert torch.equal(given.isinf(), expected.isinf())
    torch.testing.assert_close(given[~given.isinf()], expected[~expected.isinf()])
    greedy = GenerationConfig(do_sample=False, temperature=0.5)
    assert len(Penalties(1.0, 0.0).processors(greedy, prompt_length=3)) == 1 and greedy.temperature == 0.5


def test_penalties_are_refused_under_continuous_batching():
    """With `--continuous-batching` (a model other than a GPN) no generate() call takes the API's penalties: a
    400, not transformers' repetition penalty, nor presence_penalty ignored."""
    from fastapi import HTTPException
    from transformers import GenerationConfig

    from modeling_gpn.serve.handlers import StateKeepingChatCompletionHandler

    handler = bare_handler(StateKeepingChatCompletionHandler)
    for penalty in ({"frequency_penalty": 0.5}, {"presence_penalty": -1.0}):
        with pytest.raises(HTTPException) as refused:
            handler._build_generation_config(penalty, GenerationConfig(), use_cb=True)
        assert refused.value.status_code == 400 and "--continuous-batching" in refused.value.detail
    assert handler._build_generation_config({"frequency_penalty": 0}, GenerationConfig(), use_cb=True) is not None


BAD_CHAT_REQUESTS = [  # (what the request gets wrong, the fields sent, a word the error must say)
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
    ("max_tokens a string", {"max_tokens": "ten"}, "max_tokens"),
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("top_p of 0", {"top_p": 0}, "top_p"),
    ("n of 0", {"n": 0}, "n must"),
    ("n > 1 streamed", {"n": 2, "stream": True}, "n > 1"),
    ("messages a string", {"messages": "hello"}, "messages"),
    ("an unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ("content a number", {"messages": [{"role": "user", "content": 3}]}, "content"),
    ("logit_bias on a word", {"logit_bias": {"cat": 5}}, "logit_bias"),
    ("logit_bias past the vocabulary, streamed", {"logit_bias": {"99999": 5}, "stream": True}, "99999"),
    ("generation_config not JSON", {"generation_config": "{beams"}, "generation_config"),
    ("a generation_config generate() refuses", {"generation_config": '{"max_new_tokens": 0}'}, "max_new_tokens"),
    ("a generation_config value generate() refuses", {"generation_config": '{"top_k": "many"}'}, "generate() refused"),
    (
        "tool_calls with arguments not JSON",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        },
        "arguments",
    ),
    ("chat_template_kwargs setting what the server sets", {"chat_template_kwargs": {"tokenize": False}}, "tokenize"),
    ("an unknown model", {"model": "no/such-model"}, "no/such-model"),
    ("a field the API does not have", {"colour": "blue"}, "colour"),
    ("past the context limit", {"max_tokens": MAX_CONTEXT}, "context limit"),
    # what transformers serve accepts and ignores (it only logs them): refused, unless it changes nothing
    ("logprobs asked for", {"logprobs": True}, "does not support logprobs"),
    ("frequency_penalty past 2", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("presence_penalty a string", {"presence_penalty": "some"}, "presence_penalty"),
    ("a JSON response_format", {"response_format": {"type": "json_object"}}, "does not support response_format"),
    ("a verbosity", {"verbosity": "low"}, "does not support verbosity"),
    # what transformers' chat template rendering drops in silence
    (
        "tools the chat template never renders",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        "does not render tools",
    ),
    (
        "a message's name that the chat template leaves out",
        {"messages": [{"role": "user", "name": "alice", "content": "hi"}]},
        "messages[0].name: this model's chat template does not render",
    ),
    (
        "an image for a model that reads text",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
        "messages[0].content[0] is a part of type 'image_url'",
    ),
    ("max_completion_tokens past the context limit", {"max_completion_tokens": MAX_CONTEXT}, "max_completion_tokens ("),
]


@pytest.mark.parametrize(
    "fields,word", [case[1:] for case in BAD_CHAT_REQUESTS], ids=[case[0] for case in BAD_CHAT_REQUESTS]
)
def test_bad_chat_requests_get_a_4xx_naming_the_problem(client, model_name, fields, word):
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            **{key: value for key, value in body.items() if key in ("model", "messages")}, extra_body=body
        )
    assert 400 <= refused.value.status_code < 500, refused.value
    assert word in str(refused.value.body), refused.value.body


def test_a_message_name_reaches_a_chat_template_that_renders_it():
    """transformers' messages for the template leave `name` out; `gpn serve`'s keep it (the template decides)."""
    from transformers.cli.serving.utils import Modality

    from modeling_gpn.serve.handlers import StateKeepingChatCompletionHandler

    messages = [{"role": "user", "name": "alice", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    parsed = StateKeepingChatCompletionHandler.get_processor_inputs_from_messages(messages, Modality.LLM)
    assert [message.get("name") for message in parsed] == ["alice", None]


def test_a_stream_leaves_usage_out_when_the_request_says_include_usage_false(client, model_name):
    """transformers sends usage in a stream's last chunk whatever `stream_options` says."""
    for include_usage in (False, True, None):
        options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
        chat = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, **options
        )
        completion = client.completions.create(model=model_name, prompt="the cat", max_tokens=3, stream=True, **options)
        for stream in (chat, completion):
            usages = [chunk.usage for chunk in stream if chunk.usage is not None]
            assert len(usages) == (include_usage is not False), (include_usage, usages)


def test_bad_completion_requests_and_bodies_get_a_4xx(client, model_name, server):
    for prompt, word in ((123, "prompt"), ("", "empty")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model_name, prompt=prompt, max_tokens=3)
        assert word in str(refused.value.body)
    # half a surrogate pair, escaped alone: valid JSON, not text (transformers: a 500 from the tokenizer)
    for path, field in (
        ("/v1/completions", '"prompt": "to be \\ud83d"'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud83d"}]'),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                urllib.request.Request(
                    server + path,
                    data=f'{{"model": {json.dumps(model_name)}, "max_tokens": 2, {field}}}'.encode(),
                    headers={"Content-Type": "application/json"},
                ),
                timeout=30,
            )
        assert refused.value.code == 400 and "surrogate" in refused.value.read().decode()
    # transformers' /v1/audio/transcriptions (speech models) reads its form with python-multipart, which the serving
    # extra does not bring: without it, transformers answered a bare 500 (an ImportError's traceback in the log)
    from transformers.utils.import_utils import is_multipart_available

    if not is_multipart_available():
        form = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b--\r\n'
        request = urllib.request.Request(
            server + "/v1/audio/transcriptions", data=form, headers={"Content-Type": "multipart/form-data; boundary=b"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 501 and "python-multipart" in refused.value.read().decode()
    request = urllib.request.Request(
        server + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 422
    # a body over --max-request-bytes: refused by its Content-Length, and without one (chunked) once the bytes read
    # pass the limit, the rest read and dropped so that the client reads the answer, not a reset; it was read
    # whole into memory and its prompt tokenized on the event loop. A client that waits for "100 Continue" is
    # answered at once, its body unsent.
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * MAX_REQUEST_BYTES + b'"}]}'
    address = server.removeprefix("http://").split(":")
    for sent in ("declared", "chunked", "expecting 100 Continue"):
        connection = http.client.HTTPConnection(*address, timeout=30)
        headers = {"Content-Type": "application/json"}
        if sent == "expecting 100 Continue":
            connection.putrequest("POST", "/v1/chat/completions")
            for name, value in {**headers, "Content-Length": len(body), "Expect": "100-continue"}.items():
                connection.putheader(name, value)
            connection.endheaders()
        elif sent == "chunked":
            chunks = (body[start : start + 65536] for start in range(0, len(body), 65536))
            connection.request("POST", "/v1/chat/completions", chunks, headers, encode_chunked=True)
        else:  # (a body larger than the sockets' buffers: the client is still writing when the server answers)
            connection.request("POST", "/v1/chat/completions", body + b" " * (15 * MAX_REQUEST_BYTES), headers)
        answer = connection.getresponse()
        error = json.loads(answer.read())["error"]
        assert answer.status == 413, (sent, answer.status, error)
        assert f"at most {MAX_REQUEST_BYTES} bytes (--max-request-bytes)" in error["message"], error
        connection.close()
    assert get(server + "/health")[0] == 200  # and the server is still well


def test_a_large_prompt_is_tokenized_off_the_event_loop(client, model_name, server, holds):
    """A prompt of most of --max-request-bytes takes its tokenizer a second or more, and transformers' handlers
    tokenized it on the server's event loop: every other request (a small completion, /v1/models) waited for it.
    Tokenized in a worker thread, they are answered while it is still being read; it is then refused (its tokens
    pass --max-context), as before. Its tokenization is held (HOLDS_MARKED_PROMPTS) until they are answered: made on
    the event loop, it would hold them too (and let them go after 30 s, answered after it)."""
    wait_until_idle(client, model_name)
    sentence = "to be or not to be, that is the question; the cat sat on the mat. "
    prompt = HELD + sentence * (MAX_REQUEST_BYTES // len(sentence) - 64)
    body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": 1}).encode()
    assert 0.99 * MAX_REQUEST_BYTES < len(body) <= MAX_REQUEST_BYTES  # (taken: the check comes after the tokenizer)
    finished: list[str] = []
    large = http.client.HTTPConnection(*server.removeprefix("http://").split(":"), timeout=120)
    large.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})  # (sent whole)

    def answer_to_the_large() -> None:
        response = large.getresponse()
        finished.append(f"large {response.status} {response.read()[:300]!r}")

    reader = threading.Thread(target=answer_to_the_large)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not (holds / "held").exists():  # (the server has its body: its tokenization has begun)
            assert time.monotonic() < deadline and reader.is_alive(), ("the large prompt was not tokenized", finished)
            time.sleep(0.05)
        small = client.completions.create(model=model_name, prompt="to be", max_tokens=2, temperature=0)
        finished.append(f"small {small.choices[0].finish_reason}")
        finished.append(f"models {get(server + '/v1/models')[0]}")
    finally:
        (holds / "release").touch()
        reader.join(timeout=120)
        large.close()
    assert [entry.split()[0] for entry in finished] == ["small", "models", "large"], finished
    assert finished[2].startswith("large 400") and "--max-context" in finished[2], finished


def test_each_endpoint_renders_and_tokenizes_its_prompt_in_a_worker_thread(model_dir, reference, monkeypatch):
    """Chat, completions and the Responses API each make ahead, in a worker thread, the tokenizer call that
    transformers' handler then makes on the event loop (`prepared`), with its arguments: no tokenizer call is left
    on the loop (the main thread here), nor the decoding of `n` answers that finds where each stopped. A call with
    other arguments is made then, as the tokenizer makes it. What the handler gets is an instance of the
    tokenizer's class (transformers reads a model as a text model by its processor's class), the tokenizer itself
    left as it was."""
    import asyncio

    from transformers.cli.serving import model_manager
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState, Modality

    from modeling_gpn.serve import handlers
    from modeling_gpn.serve.handlers import (
        StateKeepingChatCompletionHandler,
        StateKeepingCompletionHandler,
        StateKeepingResponseHandler,
    )
    from modeling_gpn.serve.models import TransformersWithGPN
    from modeling_gpn.serve.prepared import prepared_processor

    tokenizer_class = type(reference[1])
    on_the_loop = []

    def watching(name: str):
        made = getattr(tokenizer_class, name)

        def watched(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                on_the_loop.append(name)
            return made(self, *args, **kwargs)

        return watched

    for name in ("__call__", "apply_chat_template"):
        monkeypatch.setattr(tokenizer_class, name, watching(name))
    stop_checks = []

    def watched_stop_position(*args, **kwargs):
        stop_checks.append(threading.current_thread() is threading.main_thread())
        return stop_position(*args, **kwargs)

    stop_position = handlers.stop_position
    monkeypatch.setattr(handlers, "stop_position", watched_stop_position)
    monkeypatch.setattr(model_manager, "transformers", TransformersWithGPN())  # as gpn serve does, for this test only
    manager, state = ModelManager(device="cpu", model_timeout=-1), GenerationState()
    try:
        for kind, body in (
            (StateKeepingChatCompletionHandler, {"messages": [{"role": "user", "content": "hi"}]}),
            (StateKeepingResponseHandler, {"input": "hi", "instructions": "be brief", "max_output_tokens": 2}),
            (StateKeepingCompletionHandler, {"prompt": "the cat"}),
            (StateKeepingCompletionHandler, {"prompt": "the cat", "n": 2, "stop": ["zz"]}),
        ):
            request = {"model": str(model_dir), "max_tokens": 2, **body}
            if kind is StateKeepingResponseHandler:
                del request["max_tokens"]
            answered = asyncio.run(bare_handler(kind, manager, state).handle_request(request, "id"))
            assert answered.status_code == 200 and on_the_loop == [], (kind.__name__, on_the_loop)
    finally:
        manager.shutdown()
    assert stop_checks == [False, False]  # (each of the n answers' ends found, in a worker thread)
    mat, cat = (reference[1](text)["input_ids"] for text in ("the mat", "the cat"))
    prepared = prepared_processor(reference[1])
    prepared.prepare("__call__", "the cat", return_tensors="pt")
    on_the_loop.clear()
    assert prepared("the mat")["input_ids"] == mat and on_the_loop == ["__call__"]  # (other arguments: made now)
    assert prepared("the cat", return_tensors="pt")["input_ids"].tolist() == [cat] and on_the_loop == ["__call__"]
    # (a module of no architecture transformers knows: only the processor's class tells it is a text model)
    assert ModelManager.get_model_modality(torch.nn.Linear(1, 1), processor=prepared) is Modality.LLM
    assert prepared.chat_template == reference[1].chat_template and not hasattr(reference[1], "_prepared")


def test_errors_come_in_the_openai_apis_shape(client, model_name, server):
    """An error is the OpenAI API's `{"error": {"message", "type", ...}}`, which the `openai` client reads (its
    exception's message and type): transformers serve answered FastAPI's `{"detail": ...}`, and a stream's error
    as `{"error": "..."}`, whose message the client dropped ("An error occurred during streaming")."""
    from modeling_gpn.serve.errors import as_openai_stream_error

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert refused.value.type == "invalid_request_error"
    assert refused.value.message == "Error code: 400 - max_tokens must be a positive integer, got -1"
    request = urllib.request.Request(
        server + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as unreadable:
        urllib.request.urlopen(request, timeout=10)
    error = json.loads(unreadable.value.read())["error"]
    assert unreadable.value.code == 422 and "JSON decode error" in error["message"], error
    # generate() refuses the request once the stream has begun: the error event says why, stop sequence or not
    for stop in (None, ["zz"]):
        with pytest.raises(openai.APIError) as failed:
            for _ in client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
                stop=stop,
                extra_body={"generation_config": '{"top_k": "many"}'},
            ):
                pass
        assert "not supported between instances of 'str' and 'int'" in failed.value.message, failed.value
    # transformers writes the message between quotes as it is: a quote in it is read back whole
    event = as_openai_stream_error('data: {"error": "no "such" thing"}')
    assert json.loads(event.removeprefix("data: "))["error"]["message"] == 'no "such" thing'


def test_the_queue_limit_refuses_and_a_client_that_goes_away_frees_its_slot(client, model_name, reference):
    wait_until_idle(client, model_name)
    long = dict(model=model_name, max_tokens=MAX_CONTEXT - 100, temperature=0, stream=True)  # minutes, unless cut short
    long["logit_bias"] = never_ending(reference)
    streams = []
    try:
        for index in range(MAX_QUEUED):
            streams.append(
                client.chat.completions.create(messages=[{"role": "user", "content": f"story {index}"}], **long)
            )
        running = iter(streams[0])
        for _ in range(3):  # the first is generating (the others wait for the inference thread)
            next(running)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "one more"}], max_tokens=2
            )
        assert "max-queued-requests" in str(refused.value.body)
        assert refused.value.response.headers["retry-after"] == "1"  # what the `openai` client's retries wait
        with pytest.raises(openai.RateLimitError):  # /v1/responses too
            client.responses.create(model=model_name, input="one more", max_output_tokens=2, stream=False)
        # and transformers' /v1/systemone (typed decisions, on the same inference thread): it let any number in
        decision = json.dumps({"state": "cat", "questions": {"q": {"type": "noul"}}}).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{client.base_url}systemone", data=decision, headers={"Content-Type": "application/json"}
                ),
                timeout=30,
            )
        assert refused.value.code == 429 and "max-queued-requests" in refused.value.read().decode()
        assert refused.value.headers["Retry-After"] == "1"
    finally:
        for stream in streams:
            stream.close()
    # every slot comes back within seconds (the long generations stop at their next token)
    deadline = time.monotonic() + 30
    while not all_admitted(
        client, [{"messages": [{"role": "user", "content": f"again {index}"}], **long} for index in range(MAX_QUEUED)]
    ):
        assert time.monotonic() < deadline, "the slots of the closed streams were not freed"
        time.sleep(0.2)
    wait_until_idle(client, model_name)


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_the_model(server, client, model_name, reference):
    """A non-streamed request whose client goes away (its timeout: the `openai` client would then retry) stops
    generating at its next token: its slot, and the model's inference thread, are free again within seconds, not
    after the minutes its answer of almost MAX_CONTEXT tokens would take."""
    wait_until_idle(client, model_name)
    impatient = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=1)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "a long one"}],
            max_tokens=MAX_CONTEXT - 100,
            logit_bias=never_ending(reference),
        )
    requests = [
        {"model": model_name, "messages": [{"role": "user", "content": f"next {index}"}], "stream": True}
        for index in range(MAX_QUEUED)
    ]
    # (30 s: seconds, not the minutes of its answer; each look opens MAX_QUEUED streams, slow on a busy machine)
    deadline = time.monotonic() + 30
    while not all_admitted(client, requests):
        assert time.monotonic() < deadline, "the abandoned answer still holds its slot"
        time.sleep(0.2)
    reply = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "after"}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].message.content is not None  # the model answers again
    wait_until_idle(client, model_name)


def never_ending(reference) -> dict[str, int]:
    """The logit_bias of an answer that never ends of itself (its EOS never drawn), for the tests that need one
    long: the served model, whose answers depend on what they read, may end any of them early."""
    return {str(reference[0].generation_config.eos_token_id): -100}


def all_admitted(client, requests: list[dict]) -> bool:
    """Whether every one of these streamed requests is taken on at once (each closed straight after)."""
    opened = []
    try:
        for request in requests:
            opened.append(client.chat.completions.create(**request))
        return True
    except openai.RateLimitError:
        return False
    finally:
        for stream in opened:
            stream.close()


def wait_until_idle(client, model_name) -> None:
    """Until a request is admitted again (a slot is freed just after its stream's last chunk)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "done"}], max_tokens=1
            )
            return
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the server stayed busy"
            time.sleep(0.2)


def test_a_conversation_continues_after_the_server_is_stopped_and_restarted(
    launched_servers, model_dir, reference, tmp_path
):
    """With --state-dir, a server stopped with Ctrl-C (SIGINT) writes the states it kept in memory there; one
    restarted on the folder continues the conversation from them (cached tokens), with the same answer. (The first
    server was launched with the module's others, `launched_servers`.) Both serve `--dtype int8`, which gave
    transformers' "not a floating-point dtype" error: the model is quantized as `gpn generate --dtype int8`
    quantizes it (its answers are that model's), and its kept states name their weights int8."""
    import safetensors

    from modeling_gpn.cli.quantization import quantize_for
    from modeling_gpn.serve.state_store import STATE_SUFFIX

    int8 = (quantize_for(copy.deepcopy(reference[0]), "int8"), reference[1])
    messages = [{"role": "system", "content": "the cat sat"}, {"role": "user", "content": "to be or not to be"}]
    process, first_log, states = launched_servers["restart"]
    base = wait_until_up(process, first_log)
    first = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = first.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == expected_chat(int8, messages, 6)
    first_prompt = reply.usage.prompt_tokens
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130, first_log.read_text()[-3000:]  # stopped, quietly
    kept = list(states.glob(f"*{STATE_SUFFIX}"))
    assert kept and all(safetensors.safe_open(path, "pt").metadata()["dtype_name"] == "int8" for path in kept)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "that is the question"},
    ]
    with serving(model_dir, tmp_path / "second.log", "--state-dir", str(states), "--dtype", "int8") as (base, _):
        second = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = second.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == expected_chat(int8, messages, 6)
    assert reply.usage.prompt_tokens_details.cached_tokens >= first_prompt - 1  # (a fresh server: nothing in memory)


def test_ctrl_c_exits_130_in_a_process_that_started_with_sigint_ignored(model_dir):
    """uvicorn catches Ctrl-C, stops gracefully, puts back the SIGINT handler it found and raises the signal again,
    for that handler's KeyboardInterrupt. A server started with SIGINT ignored (a background job of a
    non-interactive shell) found SIG_IGN: the signal raised again was ignored and the server exited 0 after a
    Ctrl-C. Here uvicorn's own
    `capture_signals` stops a stand-in server on a SIGINT, in a process that ignores SIGINT: `gpn serve` exits 130."""
    import uvicorn

    from gpn_cli import build_parser
    from modeling_gpn.serve import server

    def stopped_by_ctrl_c(*args, **kwargs):
        stand_in = uvicorn.Server(uvicorn.Config(app=lambda scope, receive, send: None))
        with stand_in.capture_signals():
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while serving: uvicorn notes it (and would stop)
        # (leaving capture_signals, uvicorn put back the handler it found and raised SIGINT again)

    args = build_parser("serve").parse_args(["serve", str(model_dir)])
    original = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(server, "GPNServe", stopped_by_ctrl_c)
            assert args._run(args) == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # (the handler it found put back)
    finally:
        signal.signal(signal.SIGINT, original)


def test_a_server_not_pinned_keeps_each_models_conversations_apart_and_across_unloads(
    unpinned_server, model_dir, reference, tmp_path
):
    """Without MODEL, each request names its model: two models given the same messages continue each from its own
    states (the same token ids, kept for each), a seeded sample of one is the same while the other samples beside it
    (two inference threads, one generator), and a model unloaded after --model-timeout, loaded again, continues its
    conversation from the states it kept. A PEFT adapter folder of the first (without a tokenizer: the base's is
    read) is served merged: the merged model's answers, its states kept apart from its base's (the same messages
    continued from the base's states would give the base's answer)."""

    from transformers import AutoModelForCausalLM

    from ..tiny_models import saved_lora_adapter

    other_dir = tmp_path / "other-gpn"
    shutil.copytree(model_dir, other_dir)
    state_sensitive_model(reference[0].config, seed=77, tokenizer=reference[1]).save_pretrained(other_dir)
    adapter, merged = saved_lora_adapter(model_dir, tmp_path)
    models = {
        str(model_dir): reference,
        str(other_dir): (AutoModelForCausalLM.from_pretrained(other_dir).eval(), reference[1]),
        str(adapter): (AutoModelForCausalLM.from_pretrained(merged).eval(), reference[1]),
    }
    first = [{"role": "system", "content": "two models"}, {"role": "user", "content": "to be or not to be"}]
    client = openai.OpenAI(base_url=unpinned_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    replies = {}
    for name, model in models.items():
        replies[name] = client.chat.completions.create(model=name, messages=first, max_tokens=6, temperature=0)
        assert replies[name].choices[0].message.content == expected_chat(model, first, 6), name
    assert len({reply.choices[0].message.content for reply in replies.values()}) == 3  # the models differ

    seeded, beside = str(model_dir), str(other_dir)
    request = dict(model=seeded, prompt="the cat sat", max_tokens=48, temperature=1.0, seed=3)
    alone = client.completions.create(**request).choices[0].text
    answers = {}
    start = threading.Barrier(2)

    def sample_beside() -> None:
        start.wait()
        for _ in range(3):
            client.completions.create(model=beside, prompt="to be", max_tokens=48, temperature=1.0)

    sampler = threading.Thread(target=sample_beside)
    sampler.start()
    start.wait()
    answers["seeded"] = client.completions.create(**request).choices[0].text
    sampler.join(timeout=120)
    assert answers["seeded"] == alone

    deadline = time.monotonic() + 60
    while [model.id for model in client.models.list().data if model.id in models]:  # unloaded when idle
        assert time.monotonic() < deadline, "the idle models were not unloaded"
        time.sleep(0.5)
    for name, model in models.items():
        messages = first + [
            {"role": "assistant", "content": replies[name].choices[0].message.content},
            {"role": "user", "content": "that is the question"},
        ]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        assert reply.choices[0].message.content == expected_chat(model, messages, 6), name
        assert reply.usage.prompt_tokens_details.cached_tokens >= replies[name].usage.prompt_tokens - 1, name


def test_gpn_serve_help_has_transformers_serve_options(capsys):
    from gpn_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--continuous-batching",
        "--trust-remote-code",
        "--dtype",
        "--state-store-bytes",
        "--state-dir",
        "--max-context",
        "--max-queued-requests",
    ):
        assert option in text
    # transformers' help names its parameter force_model; gpn serve takes it as the positional MODEL
    assert "force_model" not in text and "Ignored when MODEL is given" in " ".join(text.split())


def test_gpn_serve_that_cannot_start_says_why_without_a_traceback(tmp_path, capsys):
    """A --state-dir that cannot be a folder, a MODEL folder that is not there, a folder that holds no model, a
    model transformers cannot load: one line naming the problem and a non-zero exit (they were tracebacks:
    NotADirectoryError from the state store, transformers' "Repo id must be in the form ...", its error from the
    preload). MODEL is checked as gpn eval, generate and inspect check theirs: a folder without config.json is
    refused with the arguments (exit 2), before anything loads; so is --dtype int8 | int4 with --quantization."""
    from gpn_cli import build_parser

    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text("{}")
    (tmp_path / "adapter").mkdir()  # (a PEFT adapter folder of it: --quantization would round the adapter away)
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "unknown")})
    )
    for arguments, status, words in (
        (
            [str(tmp_path / "adapter"), "--quantization", "bnb-4bit", "--device", "cpu"],
            2,
            f"gpn serve: {tmp_path / 'adapter'} is a PEFT adapter: --quantization applies to a whole model; merge",
        ),
        ([str(tmp_path / "unknown"), "--state-dir", str(tmp_path / "a-file" / "states")], 2, "--state-dir"),
        (  # (0 would delete every state once written, and every other server's on the folder)
            [str(tmp_path / "unknown"), "--state-dir", str(tmp_path / "states"), "--state-dir-bytes", "0"],
            2,
            "gpn serve: --state-dir-bytes must be more than 0 with --state-dir, got 0",
        ),
        ([str(tmp_path / "no-such-model")], 2, "does not exist"),
        (  # (torchao's quantization and bitsandbytes': torchao cannot quantize bitsandbytes' layers)
            [str(tmp_path / "unknown"), "--dtype", "int8", "--quantization", "bnb-8bit"],
            2,
            "gpn serve: --dtype int8 and --quantization bnb-8bit are two quantizations: give one",
        ),
        ([str(tmp_path / "empty"), "--device", "cpu"], 2, "is not a model folder: it has no config.json"),
        ([str(tmp_path / "unknown"), "--device", "cpu"], 1, "gpn serve: cannot start:"),
    ):
        args = build_parser("serve").parse_args(["serve", *arguments])
        assert args._run(args) == status, arguments
        assert words in capsys.readouterr().err, arguments


def test_gpnserve_made_from_python_refuses_two_quantizations_before_it_serves(monkeypatch):
    """`GPNServe(dtype="int8" | "int4", quantization=...)`, made from Python rather than by `gpn serve` (which
    refuses it with its arguments), is refused as it is made: torchao cannot quantize bitsandbytes' layers, and
    the server would have started, each model's load failing."""
    from modeling_gpn.serve import server

    class Built(Exception):
        pass

    def built(*args, **kwargs):  # (past the checks: the server would be built and serve, here it stops)
        raise Built

    monkeypatch.setattr(server, "_with_policy", built)
    with pytest.raises(ValueError, match="--dtype int4 and --quantization bnb-4bit are two quantizations"):
        server.GPNServe(dtype="int4", quantization="bnb-4bit", state_store_bytes=0)
    with pytest.raises(Built):  # (one quantization: past the check)
        server.GPNServe(dtype="int4", state_store_bytes=0)


def test_gpn_serve_refuses_a_state_bound_below_one_state_of_its_model(model_dir, tmp_path, capsys, monkeypatch):
    """A positive --state-dir-bytes smaller than one state of the pinned model deleted every kept conversation once
    written (logged once, at the first); a --state-store-bytes as small, without --state-dir, kept none. Both are
    refused with the arguments, naming the flag, the value and the least that holds one state, read from the
    model's config (`StateStore.smallest_files_bytes`, checked against real states in test_serve_store.py)."""
    from gpn_cli import build_parser
    from modeling_gpn import GPNConfig
    from modeling_gpn.serve import server
    from modeling_gpn.serve.state_store import StateStore

    class Started(Exception):
        pass

    def started(*args, **kwargs):  # (past the checks: the server would load the model and serve, here it stops)
        raise Started

    monkeypatch.setattr(server, "GPNServe", started)
    config = GPNConfig.from_pretrained(model_dir)
    files, memory = StateStore.smallest_files_bytes(config, "float32"), StateStore.smallest_entry_bytes(config)
    states = str(tmp_path / "states")
    for arguments, words in (
        (["--state-dir", states, "--state-dir-bytes", str(files - 1)], f"--state-dir-bytes {files - 1} is smaller"),
        (["--state-store-bytes", str(memory - 1)], f"--state-store-bytes {memory - 1} is smaller"),
    ):
        args = build_parser("serve").parse_args(["serve", str(model_dir), *arguments])
        assert args._run(args) == 2, arguments
        err = capsys.readouterr().err
        assert words in err and str(files if "dir" in words else memory) in err and len(err.splitlines()) == 1, err
    for arguments in (  # (the least is allowed, and any memory bound with --state-dir: every state goes to a file)
        ["--state-dir", states, "--state-dir-bytes", str(files)],
        ["--state-store-bytes", str(memory)],
        ["--state-dir", states, "--state-dir-bytes", str(files), "--state-store-bytes", "1"],
    ):
        args = build_parser("serve").parse_args(["serve", str(model_dir), *arguments])
        with pytest.raises(Started):
            args._run(args)


def test_gpn_serve_refuses_a_state_bound_below_one_state_of_a_model_quantized_otherwise(
    model_dir, tmp_path, capsys, monkeypatch
):
    """A folder quantized otherwise than torchao's int8 and int4 (int8 values through `IntxWeightOnlyConfig`) names
    a state's dtype by its tensors' class, which its config does not tell: the check before the load was a lower
    bound, and a --state-dir-bytes below the real state was served, every kept conversation deleted once written.
    The model loaded is checked exactly (`StateStore.refuse_a_model_over_the_folder_bound`): one byte below its
    smallest state cannot start, naming the least; the least starts."""
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the models")
    from torchao.quantization.granularity import PerGroup
    from transformers import AutoModelForCausalLM, TorchAoConfig
    from transformers.cli.serving import server as serving_server

    from gpn_cli import build_parser
    from modeling_gpn.serve.state_store import StateStore

    class Started(Exception):
        pass

    def started(*args, **kwargs):  # (past the model's load: the server would serve, here it stops)
        raise Started

    monkeypatch.setattr(serving_server, "build_server", started)
    folder = tmp_path / "intx-int8"
    quantization = torchao.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(16))
    AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, quantization_config=TorchAoConfig(quantization)
    ).save_pretrained(folder)
    for path in model_dir.iterdir():  # (its tokenizer)
        if not (folder / path.name).exists():
            shutil.copy(path, folder / path.name)
    quantized = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        state = quantized(torch.tensor([[7]]), use_cache=True, logits_to_keep=1).cache
    StateStore(0, spill_dir=tmp_path / "one").keep(quantized, [7], state)
    least = sum(path.stat().st_size for path in (tmp_path / "one").iterdir() if not path.name.startswith("."))
    states = str(tmp_path / "states")
    args = build_parser("serve").parse_args(
        ["serve", str(folder), "--device", "cpu", "--state-dir", states, "--state-dir-bytes", str(least - 1)]
    )
    assert args._run(args) == 1
    err = capsys.readouterr().err
    assert f"--state-dir-bytes {least - 1} is smaller" in err and f"at least {least} bytes" in err, err
    args = build_parser("serve").parse_args(
        ["serve", str(folder), "--device", "cpu", "--state-dir", states, "--state-dir-bytes", str(least)]
    )
    with pytest.raises(Started):
        args._run(args)


def test_gpn_serve_on_a_transformers_outside_the_serving_pin_is_refused_by_version(tmp_path, capsys, monkeypatch):
    """gpn allows transformers 5.25, whose serve runs each model in a process no hook of gpn serve reaches
    (CONTRIBUTING.md): `gpn serve` there is refused in one line naming the version and the extra's pin, before
    an import of a moved name fails (the old line blamed missing dependencies) or anything loads."""
    import transformers

    from gpn_cli import build_parser

    args = build_parser("serve").parse_args(["serve", str(tmp_path / "no-such-model")])
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    assert args._run(args) == 2
    err = capsys.readouterr().err
    assert "gpn serve runs on transformers<5.25,>=5.24" in err and "this environment has 5.25.0" in err, err
    assert "does not exist" not in err and len(err.strip().splitlines()) == 1


def test_a_gpn_whose_weights_hold_nan_is_not_served(model_dir, tmp_path, monkeypatch):
    """The serving model manager builds a GPN with its weights checked as gpn eval, generate and inspect check theirs:
    a weight holding NaN is refused at load (each request failed at generate()'s check of the logits instead), as are
    weights the files lack (drawn at random and served in silence). (`gpn serve` says a preload's error in one line: test_gpn_serve_that_cannot_start...)"""
    from transformers.cli.serving import model_manager
    from transformers.cli.serving.model_manager import ModelManager

    from modeling_gpn.serve.models import TransformersWithGPN

    poisoned = copy_with_a_nan_weight(model_dir, tmp_path / "nan")
    monkeypatch.setattr(model_manager, "transformers", TransformersWithGPN())  # as gpn serve does, for this test only
    with pytest.raises(ValueError, match=r"has parameters holding NaN or inf \(loaded as torch.float32\): model\."):
        ModelManager(device="cpu", model_timeout=-1).load_model_and_processor(str(poisoned))


def test_a_server_not_pinned_answers_an_unknown_model_with_404(tmp_path):
    """Without MODEL, each request's `model` is loaded: one that cannot be is a 404 naming it (transformers: a 500)."""
    import asyncio

    from fastapi import HTTPException

    from modeling_gpn.serve.handlers import StateKeepingChatCompletionHandler

    handler = bare_handler(StateKeepingChatCompletionHandler)
    for body, status, word in (
        (
            {"model": str(tmp_path / "no-such-model"), "messages": [{"role": "user", "content": "hi"}]},
            404,
            "no-such-model",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model is required"),
    ):
        with pytest.raises(HTTPException) as refused:
            asyncio.run(handler.handle_request(body, "request-id"))
        assert refused.value.status_code == status and word in refused.value.detail
    assert handler.policy.admission.active == 0  # the refused requests gave their slot back


def test_chat_to_a_model_without_a_chat_template_is_a_400_that_points_to_completions(tmp_path, monkeypatch):
    """A model `gpn train` makes has a tokenizer without a chat template: a chat or Responses request to it is a
    400 saying so (transformers' handler raised a ValueError from `apply_chat_template`: a 500 and a traceback),
    and `/v1/completions`, which needs no template, still answers."""
    import asyncio

    from fastapi import HTTPException
    from transformers.cli.serving import model_manager
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    from modeling_gpn.data import train_bpe_tokenizer
    from modeling_gpn.serve.handlers import (
        StateKeepingChatCompletionHandler,
        StateKeepingCompletionHandler,
        StateKeepingResponseHandler,
    )
    from modeling_gpn.serve.models import TransformersWithGPN

    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20], 300)
    assert tokenizer.chat_template is None
    tokenizer.save_pretrained(tmp_path)
    perturbed_model(
        tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id), seed=3
    ).save_pretrained(tmp_path)
    monkeypatch.setattr(model_manager, "transformers", TransformersWithGPN())  # as gpn serve does, for this test only
    manager, state = ModelManager(device="cpu", model_timeout=-1), GenerationState()

    def handler(kind):
        return bare_handler(kind, manager, state)

    for kind, body in (
        (StateKeepingChatCompletionHandler, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        (StateKeepingResponseHandler, {"input": "hi", "max_output_tokens": 4}),
    ):
        refused_handler = handler(kind)
        with pytest.raises(HTTPException) as refused:
            asyncio.run(refused_handler.handle_request({"model": str(tmp_path), **body}, "id"))
        assert refused.value.status_code == 400, refused.value.detail
        assert "no chat template" in refused.value.detail and "/v1/completions" in refused.value.detail
        assert refused_handler.policy.admission.active == 0
    answered = asyncio.run(
        handler(StateKeepingCompletionHandler).handle_request(
            {"model": str(tmp_path), "prompt": "the cat", "max_tokens": 4}, "id"
        )
    )
    assert answered.status_code == 200
    manager.shutdown()


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stderr_is_a_terminal", "no_color", "coloured"),
    [(True, "", True), (False, "", False), (True, "1", False)],
    ids=["terminal", "stderr-to-a-file", "NO_COLOR"],
)
def test_the_servers_log_lines_are_coloured_only_on_a_terminal(monkeypatch, stderr_is_a_terminal, no_color, coloured):
    """uvicorn coloured its log lines, written to standard error, where standard output was a terminal: `gpn serve
    2> server.log` at a terminal filled the file with escape codes, and NO_COLOR (https://no-color.org) changed
    nothing. Colours are now used only where both are terminals and NO_COLOR is unset. (A real server, not pinned
    to a model, started in this process and stopped once it has said it runs.)"""
    from modeling_gpn.serve.server import GPNServe

    err = Terminal() if stderr_is_a_terminal else io.StringIO()  # (standard output a terminal in every case)
    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("NO_COLOR", no_color)
    server = GPNServe(host="127.0.0.1", port=0, non_blocking=True)  # (a port the system gives it: never taken)
    try:
        deadline = time.monotonic() + 30
        while "Uvicorn running" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        server.kill_server()
    assert "Uvicorn running" in err.getvalue()
    assert ("\x1b[" in err.getvalue()) == coloured, err.getvalue()
