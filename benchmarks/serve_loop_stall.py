"""How long one large request holds `gpn serve`'s event loop: the longest a `/health` request waits while a large
prompt is in flight.

    python benchmarks/serve_loop_stall.py                          # this checkout's gpn serve
    python benchmarks/serve_loop_stall.py --source /tmp/gpn-before # another checkout's (a `git worktree` of a commit)

A tiny GPN (random weights) with LLaMA-2's tokenizer (from GPN_SHARED_DIR, default ../shared) and a chat template
is served by `gpn serve` from `--source`, on CPU, with `--max-request-bytes` above the largest body sent and the
default `--max-context`. For each size and endpoint, one request carries that much of the Shakespeare text
(repeated) as its prompt (`/v1/completions`) or as one user message (`/v1/chat/completions`); the server
tokenizes it and refuses it (its tokens pass `--max-context`: no generation). Meanwhile a client asks `/health`
over and over, each on its own connection, one after another: the figure is the longest of those waits that began
while the large request was in flight (on an event loop the large request holds, a wait as long as its
tokenization). The large request's own time is given beside it. Not a test: the figures go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--source", type=Path, default=REPO_ROOT, help="the checkout whose gpn serve is started")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpn-serve-loop-stall"), help="folder for the model")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1, 2, 4], help="prompt sizes, MiB")
    parser.add_argument("--endpoints", nargs="+", default=["completions", "chat"], choices=["completions", "chat"])
    return parser.parse_args()


def shared_dir() -> Path:
    return Path(os.environ.get("GPN_SHARED_DIR", REPO_ROOT.parent / "shared"))


def make_model(folder: Path) -> Path:
    """A tiny GPN folder with LLaMA-2's tokenizer and a chat template (made once)."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer

    from modeling_gpn.bench.models import perturbed_gpn, tiny_config

    tokenizer = AutoTokenizer.from_pretrained(shared_dir() / "data" / "llama2-tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    perturbed_gpn(config, 0).save_pretrained(folder)
    return folder


# The line gpn serve says where it listens with (uvicorn's), the port the system gave it under `--port 0` included.
LISTENING = re.compile(r"^.*Uvicorn running on http://127\.0\.0\.1:(\d+) \(Press CTRL\+C to quit\)$", re.MULTILINE)


def listening_port(server: subprocess.Popen, log: Path, timeout: float = 180) -> int:
    """The port the server started on `--port 0` listens on (its log names it), once /health answers there."""
    deadline = time.monotonic() + timeout
    while True:
        listening = LISTENING.search(log.read_text(encoding="utf-8"))
        if listening and int(listening[1]) != 0:
            try:
                health_wait(int(listening[1]))
                return int(listening[1])
            except OSError:
                pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gpn serve did not start: see {log}")
        time.sleep(0.2)


def health_wait(port: int) -> float:
    """Seconds from asking /health on a new connection to its answer."""
    began = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("GET", "/health")
    connection.getresponse().read()
    connection.close()
    return time.perf_counter() - began


def measure(port: int, model: str, endpoint: str, text: str) -> tuple[float, float, int, str]:
    """(the longest /health wait begun while the request was in flight, the request's seconds, /health answers,
    the request's status and the start of its answer)."""
    if endpoint == "completions":
        path, body = "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}
    else:
        path, body = "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}
    data = json.dumps(body).encode()
    done = threading.Event()
    outcome: dict[str, object] = {}

    def large() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        began = time.perf_counter()
        connection.request("POST", path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        outcome["seconds"] = time.perf_counter() - began
        outcome["answer"] = f"{response.status} {answer[:90].decode(errors='replace')}"
        connection.close()
        done.set()

    worker = threading.Thread(target=large)
    worker.start()
    waits = []
    while not done.is_set():
        waits.append(health_wait(port))
    worker.join()
    return max(waits), float(outcome["seconds"]), len(waits), str(outcome["answer"])


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = make_model(args.work / "model")
    plays = (shared_dir() / "data" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    largest = int(max(args.sizes) * MIB)
    text = (plays * (largest // len(plays) + 1))[:largest]
    source = args.source.resolve()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True, check=False
    ).stdout.strip()
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "gpn_cli", "serve", str(model), "--host", "127.0.0.1", "--port", "0"]
    command += ["--device", "cpu", "--max-request-bytes", str(largest + MIB)]
    log = open(args.work / "server.log", "w", encoding="utf-8")  # noqa: SIM115 - open while the server runs
    server = subprocess.Popen(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Port 0: the system gives the server a port and its log names it. A port found free here and bound by the
        # server after its imports could be taken meanwhile by anything else on the machine.
        port = listening_port(server, args.work / "server.log")
        load = os.getloadavg()[0]
        print(f"gpn serve from {source} (commit {commit}), load average {load:.1f} before")
        print("| endpoint | prompt | longest /health wait (s) | the large request (s) | /health answers | its answer |")
        print("|---|---|---|---|---|---|")
        health_wait(port)
        for endpoint in args.endpoints:
            for size in args.sizes:
                longest, seconds, answers, answer = measure(port, str(model), endpoint, text[: int(size * MIB)])
                print(f"| {endpoint} | {size:g} MiB | {longest:.3f} | {seconds:.2f} | {answers} | {answer[:60]} |")
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    main()
