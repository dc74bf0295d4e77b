"""Time to first token by turn of a conversation, served: `gpn serve` with and without its state store,
beside a parameter-matched Llama on `transformers serve`; and requests/s with 1, 4 and 16 clients at once.

    python benchmarks/serve_ttft.py                      # 20 turns x 3 conversations, then 1/4/16 clients
    python benchmarks/serve_ttft.py --turns 4 --repeats 1 --clients 1 4   # a quick look

Three server processes on 127.0.0.1, driven one at a time with the `openai` client: `gpn serve` on the
`small` GPN (10.8M parameters), the same with `--state-store-bytes 0`, and `transformers serve` on the Llama
`gpn bench` matches to it (hidden = the GPN's embedding width, layers for the same parameter count), both
randomly initialised, with a byte-level BPE of the GPN's vocabulary trained on the Shakespeare plays and a
chat template (no Hub access: everything is made here, in --work). Each conversation adds `--turn-tokens`
tokens of Shakespeare as the user's turn and a `--answer-tokens` greedy answer; time to first token is from
sending the streamed request to its first content chunk, medians over `--repeats` conversations (different
texts; the servers take turns in a rotating order). Tokens that decode to no complete character, and the
end tokens, are banned through `logit_bias` for every server, so each answer is streamed from its first
token and has its full length. The GPN's answers with and without the store must be identical (checked).
The floor is the model alone in this process: the turn's new tokens and the first answer token, read from a
state in one forward, i.e. what the store leaves to compute (measured between the conversations).

Requests/s: `c` clients at once, each its own conversation of `--load-turns` turns (not streamed),
over the wall time of all of them; medians of `--load-rounds` rounds, the servers in a rotating order. All figures are from a shared machine (see the load column).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/gpn-serve-bench"), help="folder for the models (reused)"
    )
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=200, help="tokens of text each user turn adds")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per server (medians)")
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--load-turns", type=int, default=3, help="turns of each client's conversation (requests/s)")
    parser.add_argument("--load-rounds", type=int, default=2, help="rounds of the requests/s runs (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every server and of the floor")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    return parser.parse_args()


# --------------------------------------------------------------------------------------------------
# The models, the texts
# --------------------------------------------------------------------------------------------------


def make_models(work: Path) -> tuple[Path, Path]:
    """The small GPN and its matched Llama, sharing a BPE tokenizer with a chat template (made once)."""
    gpn_dir, llama_dir = work / "gpn-small", work / "llama-matched"
    if (gpn_dir / "config.json").exists() and (llama_dir / "config.json").exists():
        return gpn_dir, llama_dir
    from modeling_gpn.bench import build_gpn, count_params, matched_llama
    from modeling_gpn.configuration import load_preset
    from modeling_gpn.data import shakespeare_documents, train_bpe_tokenizer

    vocab = load_preset("small").vocab_size
    print(f"training a {vocab}-token BPE on the plays ...", file=sys.stderr, flush=True)
    tokenizer = train_bpe_tokenizer(shakespeare_documents(), vocab - len(SPECIALS))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = CHAT_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    gpn = build_gpn("small", torch.float32, "cpu", 0)
    gpn.config.eos_token_id = gpn.generation_config.eos_token_id = end
    llama = matched_llama(gpn.config, count_params(gpn), torch.float32, "cpu")
    llama.config.eos_token_id = llama.generation_config.eos_token_id = end
    for folder, model in ((gpn_dir, gpn), (llama_dir, llama)):
        tokenizer.save_pretrained(folder)
        model.save_pretrained(folder)
    return gpn_dir, llama_dir


class Texts:
    """User turns of about `tokens` tokens each, consecutive pieces of the plays, never one piece twice: a
    conversation the store has seen would be answered from its states, which would flatter the store."""

    def __init__(self, tokenizer, tokens: int):
        from modeling_gpn.data import shakespeare_documents

        self.tokenizer, self.tokens, self.used = tokenizer, tokens, 0
        self.ids = tokenizer(" ".join(shakespeare_documents()), add_special_tokens=False)["input_ids"]

    def turns(self, count: int) -> list[str]:
        start, self.used = self.used, self.used + count * self.tokens
        if self.used > len(self.ids):
            raise ValueError(f"the plays hold {len(self.ids)} tokens: too few for this many turns")
        return [
            self.tokenizer.decode(self.ids[start + i * self.tokens : start + (i + 1) * self.tokens])
            for i in range(count)
        ]


def banned_tokens(tokenizer) -> dict[str, float]:
    """logit_bias banning the tokens that decode to no complete character, and the special tokens."""
    banned = {i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])} | set(tokenizer.all_special_ids)
    return {str(i): -100.0 for i in sorted(banned)}  # floats: transformers serve refuses integer biases


# --------------------------------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------------------------------


# The line a server says where it listens with (uvicorn's, for gpn serve and transformers serve alike), the port the
# system gave it under `--port 0` included.
LISTENING = re.compile(r"^.*Uvicorn running on http://127\.0\.0\.1:(\d+) \(Press CTRL\+C to quit\)$", re.MULTILINE)


class Server:
    def __init__(self, name: str, command: list[str], log: Path, threads: int):
        # Port 0: the server binds a port the system gives it and says which in its log (`wait` reads it). A port
        # found free here and bound by the server after its imports could be taken meanwhile by anything else.
        self.name, self.port, self.log = name, 0, log
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "w", encoding="utf-8") as out:
            self.process = subprocess.Popen(
                [*command, "--port", "0"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
            )

    def wait(self, timeout: float = 300) -> None:
        """Until the server answers /health on the port its log names (`self.port` set to it)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            listening = LISTENING.search(self.log.read_text(encoding="utf-8"))
            if listening and int(listening[1]) != 0:
                try:
                    url = f"http://127.0.0.1:{listening[1]}/health"
                    with urllib.request.urlopen(url, timeout=5) as response:
                        if response.status == 200:
                            self.port = int(listening[1])
                            return
                except OSError:
                    pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text(encoding='utf-8')[-3000:]}")
            time.sleep(0.5)

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=600)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=20)


def start_servers(gpn_dir: Path, llama_dir: Path, work: Path, threads: int) -> list[Server]:
    gpn = [sys.executable, "-m", "gpn_cli", "serve", str(gpn_dir), "--host", "127.0.0.1", "--device", "cpu"]
    transformers_cli = Path(sys.executable).with_name("transformers")
    plain = [str(transformers_cli), "serve", str(llama_dir), "--host", "127.0.0.1", "--device", "cpu"]
    specs = [
        ("gpn serve + store", gpn),
        ("gpn serve, no store", [*gpn, "--state-store-bytes", "0"]),
        ("transformers serve (Llama)", plain),
    ]
    servers = [
        Server(name, command, work / f"{index}-{name.split()[0]}.log", threads)
        for index, (name, command) in enumerate(specs)
    ]
    for server in servers:
        server.wait()
    return servers


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


def ask(
    client, model: str, messages: list[dict], answer_tokens: int, bias: dict, stream: bool
) -> tuple[float, str, object]:
    """(seconds to the first content chunk (streamed) or to the whole answer, the answer, the usage)."""
    start = time.perf_counter()
    request = dict(model=model, messages=messages, max_tokens=answer_tokens, temperature=0, logit_bias=bias)
    if not stream:
        reply = client.chat.completions.create(**request)
        return time.perf_counter() - start, reply.choices[0].message.content, reply.usage
    first, parts, usage = None, [], None
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return first, "".join(parts), usage


def converse(server: Server, model: str, turns: list[str], answer_tokens: int, bias: dict) -> list[dict]:
    client, messages, out = server.client(), [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ttft, answer, usage = ask(client, model, messages, answer_tokens, bias, stream=True)
        details = getattr(usage, "prompt_tokens_details", None)
        out.append(
            {
                "ttft": ttft,
                "prompt_tokens": usage.prompt_tokens,
                "cached": getattr(details, "cached_tokens", None) or 0,
                "answer": answer,
            }
        )
        messages.append({"role": "assistant", "content": answer})
    return out


class Floor:
    """The GPN alone in this process: from a state, read `turn_tokens` new tokens and pick the first answer
    token (one forward, as the server's own forward and generate()'s first step together), timed."""

    def __init__(self, gpn_dir: Path, turn_tokens: int, threads: int):
        from transformers import AutoModelForCausalLM

        import modeling_gpn  # noqa: F401

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(gpn_dir).eval()
        self.turn_tokens = turn_tokens
        self.generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.state = self.model(
                torch.randint(10, 8000, (1, 500), generator=self.generator), use_cache=True, logits_to_keep=1
            ).cache
        self.times: list[float] = []

    def measure(self, repeats: int = 3) -> None:
        with torch.no_grad():
            for _ in range(repeats):
                cache, new = (
                    self.state.fork(1),
                    torch.randint(10, 8000, (1, self.turn_tokens), generator=self.generator),
                )
                mask = torch.ones(1, 500 + self.turn_tokens, dtype=torch.long)
                start = time.perf_counter()
                self.model(new, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
                self.times.append(time.perf_counter() - start)


def requests_per_second(server: Server, model: str, texts: list[list[str]], answer_tokens: int, bias: dict) -> float:
    """All clients at once, each its conversation; requests over the wall time."""
    errors: list[BaseException] = []

    def run(turns: list[str]) -> None:
        try:
            client, messages = server.client(), []
            for text in turns:
                messages.append({"role": "user", "content": text})
                _, answer, _ = ask(client, model, messages, answer_tokens, bias, stream=False)
                messages.append({"role": "assistant", "content": answer})
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(turns,)) for turns in texts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{server.name}: {len(errors)} clients failed, e.g. {errors[0]!r}")
    return sum(len(turns) for turns in texts) / (time.perf_counter() - start)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text(encoding="utf-8").split()[:3])


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    import modeling_gpn  # noqa: F401  (registers GPN: the tokenizer's folder names GPN's config)

    args.work.mkdir(parents=True, exist_ok=True)
    gpn_dir, llama_dir = make_models(args.work)
    tokenizer = AutoTokenizer.from_pretrained(gpn_dir)
    bias = banned_tokens(tokenizer)
    texts = Texts(tokenizer, args.turn_tokens)
    loads = [load_average()]
    floor = Floor(gpn_dir, args.turn_tokens, args.threads)
    servers = start_servers(gpn_dir, llama_dir, args.work, args.threads)
    models = {servers[0].name: str(gpn_dir), servers[1].name: str(gpn_dir), servers[2].name: str(llama_dir)}
    try:
        for server in servers:  # warm: the first request folds weights, compiles the template, ...
            ask(server.client(), models[server.name], [{"role": "user", "content": "warm up"}], 2, bias, stream=True)
        floor.measure(1)
        floor.times.clear()
        runs: dict[str, list[list[dict]]] = {server.name: [] for server in servers}
        for repeat in range(args.repeats):
            turns = texts.turns(args.turns)
            floor.measure()  # in the same spell of the machine as the conversations
            for server in servers[repeat % 3 :] + servers[: repeat % 3]:
                print(f"conversation {repeat + 1}/{args.repeats} on {server.name} ...", file=sys.stderr, flush=True)
                loads.append(load_average())
                runs[server.name].append(converse(server, models[server.name], turns, args.answer_tokens, bias))
        store, plain, llama = (runs[server.name] for server in servers)
        identical = sum(
            a["answer"] == b["answer"] for conv_a, conv_b in zip(store, plain) for a, b in zip(conv_a, conv_b)
        )
        throughput: dict[int, dict[str, list[float]]] = {
            clients: {server.name: [] for server in servers} for clients in args.clients
        }
        for round_ in range(args.load_rounds):
            for clients in args.clients:
                conversations = [texts.turns(args.load_turns) for _ in range(clients)]  # new to every server
                for server in servers[round_ % 3 :] + servers[: round_ % 3]:
                    print(f"round {round_ + 1}: {clients} clients on {server.name} ...", file=sys.stderr, flush=True)
                    loads.append(load_average())
                    throughput[clients][server.name].append(
                        requests_per_second(server, models[server.name], conversations, args.answer_tokens, bias)
                    )
    finally:
        for server in servers:
            server.stop()
    loads.append(load_average())
    one_minute = [float(load.split()[0]) for load in loads]

    def median_of(conversations: list[list[dict]], turn: int, key: str) -> float:
        return statistics.median(conversation[turn][key] for conversation in conversations)

    print(
        f"\nTime to first token by turn (ms, median of {args.repeats} conversations; {args.turn_tokens}-token turns, "
        f"{args.answer_tokens}-token answers; torch threads {args.threads}; 1-minute load average "
        f"{min(one_minute):.1f}-{max(one_minute):.1f} on this machine's 2 cores while it ran)\n"
    )
    names = [server.name for server in servers]
    print(
        f"| turn | prompt tokens (GPN) | read with the store | {' | '.join(names)} | no store / store | Llama / store |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for turn in range(args.turns):
        prompt = median_of(store, turn, "prompt_tokens")
        read = prompt - median_of(store, turn, "cached")
        ttfts = [1000 * median_of(runs[name], turn, "ttft") for name in names]
        print(
            f"| {turn + 1} | {prompt:.0f} | {read:.0f} | "
            + " | ".join(f"{t:.0f}" for t in ttfts)
            + f" | {ttfts[1] / ttfts[0]:.1f}x | {ttfts[2] / ttfts[0]:.2f}x |"
        )
    print(
        f"\nfloor, the GPN alone in this process ({args.turn_tokens} new tokens from a state and the first answer token, "
        f"one forward): median {1000 * statistics.median(floor.times):.0f} ms of {len(floor.times)}, measured between the conversations"
    )
    print(f"GPN answers identical with and without the store: {identical} of {args.turns * args.repeats} turns")
    print(
        f"\nRequests/s (each client a {args.load_turns}-turn conversation, {args.answer_tokens}-token answers, not streamed; "
        f"median of {args.load_rounds} rounds, the servers in turn)\n"
    )
    print(f"| clients at once | {' | '.join(names)} |")
    print("|---|---|---|---|")
    for clients, figures in throughput.items():
        print(f"| {clients} | " + " | ".join(f"{statistics.median(figures[name]):.2f}" for name in names) + " |")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": runs,
                    "floor": floor.times,
                    "throughput": throughput,
                    "loads": loads,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
