"""`gpn generate` prints what `model.generate()` gives with the same settings: greedy, seeded sampling and
beams, a batch of prompts of different lengths (left padded), and the text of a SentencePiece tokenizer's
continuation as the decoded whole has it. (Bad arguments: tests/tools/test_faults_io.py; --state and
--save-state: tests/model/test_state.py.)"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from gpn_cli import main as gpn_main

from ..environment import require_shared
from ..tiny_models import perturbed_model, tiny_config

PROMPTS = ["the cat", "to be or not to be the cat sat"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A tiny GPN folder with its own byte-level BPE tokenizer, which stops at its EOS."""
    from modeling_gpn.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("generate-cli")
    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    tokenizer.save_pretrained(folder)
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    perturbed_model(config, seed=3).save_pretrained(folder)
    return folder


def printed_texts(capsys, folder, *args) -> list[str]:
    """The texts `gpn generate FOLDER ARGS` printed, one per prompt (each followed by a line of dashes)."""
    code = gpn_main(["generate", str(folder), *map(str, args), "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.split("\n" + "-" * 40 + "\n")[:-1]


def generated_texts(folder, prompts: list[str], seed: int = 0, half: bool = False, **settings) -> list[str]:
    """What `model.generate()` gives for `prompts` in one left-padded batch, each decoded whole (`half`: of
    `model.half()`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = model.half() if half else model
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(**batch, pad_token_id=tokenizer.pad_token_id, **settings)
    return tokenizer.batch_decode(output, skip_special_tokens=True)


CASES = {
    "greedy": ([], dict(do_sample=False)),
    "sampled": (["--sample", "--seed", "5"], dict(do_sample=True, temperature=0.8, top_p=0.95, seed=5)),
    "sampled-settings": (
        ["--sample", "--seed", "3", "--temperature", "1.5", "--top-p", "0.5"],
        dict(do_sample=True, temperature=1.5, top_p=0.5, seed=3),
    ),
    "beams": (["--num-beams", "3"], dict(do_sample=False, num_beams=3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one-prompt", "two-prompts"])
def test_generate_prints_what_model_generate_gives(bpe_dir, capsys, case, prompts):
    options, settings = CASES[case]
    printed = printed_texts(capsys, bpe_dir, *prompts, "--max-new-tokens", 10, *options)
    assert printed == generated_texts(bpe_dir, prompts, max_new_tokens=10, **settings)


def test_generate_in_float16_prints_what_model_half_gives_and_keeps_its_states_to_float16(bpe_dir, capsys, tmp_path):
    """`--dtype float16` (GPUs without bf16) runs `model.half()`: its tokens, and its state file names float16 weights,
    so that a model in another dtype refuses to continue it (as a bf16 state is refused), and float16 continues it."""
    from safetensors import safe_open

    state = tmp_path / "half.safetensors"
    printed = printed_texts(
        capsys, bpe_dir, *PROMPTS, "--max-new-tokens", 8, "--dtype", "float16", "--save-state", state
    )
    assert printed == generated_texts(bpe_dir, PROMPTS, half=True, max_new_tokens=8, do_sample=False)
    with safe_open(state, "pt") as saved:
        assert saved.metadata()["weights_dtype"] == "float16"
    code = gpn_main(["generate", str(bpe_dir), "--state", str(state), " on", " the", "--device", "cpu"])
    assert code == 2 and "computed with float16 weights; this model's are float32" in capsys.readouterr().err
    continued = ["generate", str(bpe_dir), "--state", str(state), " on", " the", "--max-new-tokens", "2"]
    assert gpn_main([*continued, "--device", "cpu", "--dtype", "float16"]) == 0, capsys.readouterr().err


def test_a_batch_prints_what_each_prompt_gives_alone_when_greedy(bpe_dir, capsys):
    """Left padding changes nothing: each row of a greedy batch is its prompt's own greedy text. (The short
    prompts read 8 and 7 pad tokens first; a row whose state read them gives another text here. "the cat" of
    PROMPTS did not show it: its greedy tokens kept their lead over the changed logits.)"""
    prompts = ["the", "sat on", PROMPTS[1]]
    batch = printed_texts(capsys, bpe_dir, *prompts, "--max-new-tokens", 10)
    assert batch == [printed_texts(capsys, bpe_dir, prompt, "--max-new-tokens", 10)[0] for prompt in prompts]


def test_a_batch_of_a_llama_prints_what_each_prompt_gives_alone_when_greedy(bpe_dir, tmp_path, capsys):
    """A GPN's padded positions are inert, so no GPN batch can tell left padding from right; a Llama's cannot be
    (`gpn generate` runs the study's Llama baselines): padded on the right, a short prompt's first new token is
    read from a pad position. A tiny random Llama, with the GPN tests' tokenizer: each row of a greedy batch of
    prompts of different lengths is the prompt's own greedy text."""
    from transformers import AutoTokenizer

    from ..tiny_models import saved_tiny_llama

    # (weights large enough that each token's logits depend on what it reads)
    saved_tiny_llama(tmp_path, AutoTokenizer.from_pretrained(bpe_dir), initializer_range=0.5)
    prompts = ["the", PROMPTS[1]]
    batch = printed_texts(capsys, tmp_path, *prompts, "--max-new-tokens", 6)
    assert batch == [printed_texts(capsys, tmp_path, prompt, "--max-new-tokens", 6)[0] for prompt in prompts]


def test_a_sentencepiece_continuation_keeps_its_space(tmp_path, capsys):
    """With Llama 2's tokenizer (the paper's models'), the new tokens were decoded alone, which drops the
    space a word-start piece opens with: "The cat sat" + "▁controls..." printed as "The cat satcontrols...".
    The printed text is the decoded whole, as `tokenizer.decode(model.generate(...)[0])` gives it."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer")).save_pretrained(tmp_path)
    perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1)).save_pretrained(tmp_path)
    prompts = ["Hello", "The cat sat"]
    printed = printed_texts(capsys, tmp_path, *prompts, "--max-new-tokens", 6)
    expected = generated_texts(tmp_path, prompts, max_new_tokens=6, do_sample=False)
    assert printed == expected
    assert any(text[len(prompt)] == " " for prompt, text in zip(prompts, expected))  # (the case in point)


def test_a_conversation_whose_answer_ends_inside_a_character_continues_as_its_whole_decodes(
    tmp_path, capsys, monkeypatch
):
    """Llama 2's tokenizer spells 龘 in byte tokens (`<0xE9><0xBE><0x98>`); the model's generation_config biases it to
    answer `<0xE9><0xBE>`, cut by --max-new-tokens inside the character. Continued with --state and a non-ASCII prompt
    (on standard input; the first on the command line), the two turns print what `tokenizer.decode` gives for the whole
    conversation's ids, the unfinished character as one U+FFFD a byte, and the states read exactly the ids
    `tokenizer(prompt)` and `continuation_ids` give (their fingerprints are those of one forward over the whole)."""
    import io

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from modeling_gpn.data.tokenizer import continuation_ids
    from modeling_gpn.modeling_gpn import GPNCache

    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    tokenizer.save_pretrained(tmp_path)
    perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1)).save_pretrained(tmp_path)
    e9, be = 3 + 0xE9, 3 + 0xBE  # (byte b is token 3 + b)
    settings = GenerationConfig.from_pretrained(tmp_path)
    settings.sequence_bias = [[[e9], 100.0], [[e9, be], 300.0]]
    settings.save_pretrained(tmp_path)
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    turn = printed_texts(capsys, tmp_path, "Hello wörld", "--max-new-tokens", 2, "--save-state", first)[0]
    monkeypatch.setattr("sys.stdin", io.StringIO(" Ünïcode 你好\n"))
    turn += printed_texts(capsys, tmp_path, "--state", first, "-", "--max-new-tokens", 3, "--save-state", second)[0]
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        answer = model.generate(**tokenizer("Hello wörld", return_tensors="pt"), max_new_tokens=2, do_sample=False)
        assert answer[0, -2:].tolist() == [e9, be]  # (the case in point: an answer ending inside a character)
        following = torch.tensor(continuation_ids(tokenizer, [" Ünïcode 你好"]))
        whole = model.generate(torch.cat([answer, following], 1), max_new_tokens=3, do_sample=False)
        for ids, state in ((answer, first), (whole, second)):
            read = GPNCache.load(state, model, tokenizer=tokenizer)
            assert torch.equal(read.read_fingerprint(), model(ids, use_cache=True).cache.read_fingerprint())
    assert (
        turn
        == tokenizer.decode(whole[0], skip_special_tokens=True)
        == "Hello wörld\ufffd\ufffd Ünïcode 你好" + turn[-3:]
    )


class RecordedWrites:
    """A standard output that keeps each write apart."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tokenizer", ["byte-level BPE", "Llama 2 SentencePiece"])
def test_one_prompt_is_printed_as_it_is_generated(bpe_dir, tmp_path, monkeypatch, tokenizer):
    """One prompt's text is written piece by piece while generate() runs (it was printed once at the end): the
    prompt, then a piece per token or so; what it prints in all is what --no-stream prints, which is what
    model.generate() gives (above), a SentencePiece word's space included."""
    folder = bpe_dir
    if tokenizer != "byte-level BPE":
        from transformers import AutoTokenizer

        folder = tmp_path
        AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer")).save_pretrained(folder)
        perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1)).save_pretrained(folder)
    outputs = {}
    for stream in ([], ["--no-stream"]):
        stdout = RecordedWrites()
        monkeypatch.setattr("sys.stdout", stdout)
        assert (
            gpn_main(["generate", str(folder), "The cat sat", "--max-new-tokens", "8", "--device", "cpu", *stream]) == 0
        )
        outputs[bool(stream)] = stdout.writes
    streamed, at_the_end = outputs[False], outputs[True]
    assert "".join(streamed) == "".join(at_the_end)
    assert streamed[0] == "The cat sat" and len(streamed) >= 5, streamed  # the prompt, pieces, the end, the dashes
    assert len(at_the_end) == 4, at_the_end  # (print: the text and its newline, the dashes and theirs)


def test_a_character_split_over_byte_tokens_is_printed_whole_once_it_is_complete(monkeypatch):
    """Llama 2's tokenizer spells a rare character (龘) in byte tokens, `<0xE9><0xBE><0x98>`. The stream decodes
    the new tokens after the prompt's last 8; those 8 began inside a character of the prompt "x 龘龘龘", and the
    answer's bytes continuing that run decoded as replacement characters: "������ world" was printed, then the whole
    again. Each piece printed holds no U+FFFD; what is printed in all is the decoded continuation, ending bytes of an
    unfinished character included (as `tokenizer.decode` shows them)."""
    from transformers import AutoTokenizer

    from modeling_gpn.cli.generate import PrintingStreamer, continuation

    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    for prompt, answer in (("x 龘龘龘", "龘龘 world 🙂"), ("x 🙂🙂", "🙂 ok 龘"), ("你好", "龘!龘")):
        prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"][1:]  # (less the word start "▁")
        for new_ids in (answer_ids, answer_ids[:-1]):  # (the second ends inside a character)
            stdout = RecordedWrites()
            monkeypatch.setattr("sys.stdout", stdout)
            streamer = PrintingStreamer(tokenizer, prompt_ids, prompt)
            for ids in [prompt_ids[None], *torch.tensor(new_ids)[:, None]]:
                streamer.put(ids)
            whole = continuation(tokenizer, prompt_ids, torch.tensor(new_ids))
            assert not any("\ufffd" in piece for piece in stdout.writes), stdout.writes
            assert "".join(stdout.writes) + streamer.rest(whole) == prompt + whole, (prompt, new_ids)
        assert whole.endswith("\ufffd") and "\ufffd" not in answer


def test_a_run_of_byte_tokens_that_is_no_character_is_printed_as_the_whole_decodes(tmp_path, monkeypatch):
    """A byte-fallback decoder reads a run of byte tokens as one: 龘 (<0xE9><0xBE><0x98>) followed by <0xE9><0xBE>
    decodes as five U+FFFD. The stream printed 龘 when its last byte came, then nothing more (no later text began
    with what was printed), then the whole continuation again on a line of its own. It now holds a run until it
    ends: what it prints is what --no-stream prints, a run of bytes that ends the answer (9 tokens: 龘 last)
    included."""
    from ..tiny_models import byte_runs_model_dir

    folder = byte_runs_model_dir(tmp_path, require_shared("data/llama2-tokenizer"))
    outputs = {}
    for stream in ([], ["--no-stream"]):
        stdout = RecordedWrites()
        monkeypatch.setattr("sys.stdout", stdout)
        assert gpn_main(["generate", str(folder), "hello", "--max-new-tokens", "9", "--device", "cpu", *stream]) == 0
        outputs[bool(stream)] = stdout.writes
    streamed, at_the_end = outputs[False], outputs[True]
    assert "".join(at_the_end).startswith("hello" + "\ufffd" * 5 + " hello龘\n"), at_the_end  # (the biases work)
    assert "".join(streamed) == "".join(at_the_end), streamed
    assert "\ufffd" * 5 + " hello" in streamed, streamed  # (the run is printed with the token that ends it)


def test_a_prompt_from_standard_input(bpe_dir, capsys, monkeypatch):
    """`-` is the text on standard input, less the newline that ends it: `echo "the cat" | gpn generate M -`
    prints what `gpn generate M "the cat"` does."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\n"))
    piped = printed_texts(capsys, bpe_dir, "-", "to be", "--max-new-tokens", 6)
    assert piped == printed_texts(capsys, bpe_dir, "the cat", "to be", "--max-new-tokens", 6)
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\n"))
    assert gpn_main(["generate", str(bpe_dir), "-", "-", "--device", "cpu"]) == 2
    assert "can be given once" in capsys.readouterr().err
    # a command started with standard input closed (`gpn generate M - <&-`, a daemon's job) has no sys.stdin:
    # refused in one line, before the model loads (an AttributeError traceback before)
    monkeypatch.setattr("sys.stdin", None)
    assert gpn_main(["generate", str(bpe_dir), "-", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "gpn generate: error: - reads the prompt from standard input, which is closed: give the prompt, or < FILE\n"
    )


def test_a_prompt_of_bytes_the_locale_cannot_decode_is_one_line(bpe_dir, capsys):
    """Under an ASCII locale with UTF-8 mode off (`LC_ALL=C PYTHONUTF8=0`), Python passes a UTF-8 prompt's bytes on
    as lone surrogates ("ü" as "\\udcc3\\udcbc"), on the command line and standard input alike; the tokenizer refused
    them with "TypeError: TextEncodeInput must be ...". One line names the prompt and what to set."""
    assert gpn_main(["generate", str(bpe_dir), "the cat", "w\udcc3\udcbcrld", "--device", "cpu"]) == 2
    assert "prompt 2 holds bytes that are not text in this locale's encoding" in capsys.readouterr().err


def test_sampling_takes_the_models_own_settings_unless_given(bpe_dir, tmp_path, capsys):
    """A model whose generation_config.json sets a temperature and top_p (its authors' choice) samples with them, as
    `model.generate(do_sample=True)` does; --temperature / --top-p given on the command line win; a model that sets
    none samples with the command's defaults (the CASES above)."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "tuned"
    shutil.copytree(bpe_dir, folder)
    tuned = GenerationConfig.from_pretrained(folder)
    tuned.do_sample, tuned.temperature, tuned.top_p = True, 0.3, 0.6  # (as a chat model's file sets them)
    tuned.save_pretrained(folder)
    printed = printed_texts(capsys, folder, PROMPTS[1], "--max-new-tokens", 12, "--sample", "--seed", 7)
    assert printed == generated_texts(folder, PROMPTS[1:], seed=7, max_new_tokens=12, do_sample=True)
    assert printed == generated_texts(
        folder, PROMPTS[1:], seed=7, max_new_tokens=12, do_sample=True, temperature=0.3, top_p=0.6
    )
    given = printed_texts(
        capsys, folder, PROMPTS[1], "--max-new-tokens", 12, "--sample", "--seed", 7, "--temperature", 1.5
    )
    assert given == generated_texts(
        folder, PROMPTS[1:], seed=7, max_new_tokens=12, do_sample=True, temperature=1.5, top_p=0.6
    )


@pytest.fixture(scope="module")
def adapter(bpe_dir, tmp_path_factory):
    """A LoRA adapter folder of `bpe_dir` without a tokenizer (the base's is read), and the model merged from it."""
    from ..tiny_models import saved_lora_adapter

    return saved_lora_adapter(bpe_dir, tmp_path_factory.mktemp("adapter"))


def test_generate_of_a_peft_adapter_folder_is_the_merged_models(bpe_dir, adapter, tmp_path, capsys):
    """A PEFT adapter folder (a LoRA fine-tune's) was refused: "not a model folder: it has no config.json". It runs
    merged into its base: the text of the merged model saved whole, and of the PeftModel in Python; one line on
    stderr names the base and whose tokenizer. Its states are the adapted model's: --save-state then --state
    continues, and a state of the base is refused on it, as its state on the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, merged = adapter
    options = ("--max-new-tokens", 10)
    printed = printed_texts(capsys, folder, *PROMPTS, *options)
    assert (
        printed
        == printed_texts(capsys, merged, *PROMPTS, *options)
        != printed_texts(capsys, bpe_dir, *PROMPTS, *options)
    )
    tokenizer = AutoTokenizer.from_pretrained(bpe_dir, padding_side="left")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bpe_dir), folder).eval()
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        output = peft_model.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert printed == tokenizer.batch_decode(output, skip_special_tokens=True)

    state, base_state = tmp_path / "adapted.safetensors", tmp_path / "base.safetensors"
    assert (
        gpn_main(
            ["generate", str(folder), PROMPTS[0], *map(str, options), "--device", "cpu", "--save-state", str(state)]
        )
        == 0
    )
    note = f"gpn generate: {folder} is a PEFT adapter of {bpe_dir}: run merged into it; tokenizer: the base's (none in"
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn")] == [f"{note} {folder})"]
    continued = printed_texts(capsys, folder, " on the mat", *options, "--state", state)
    assert continued == printed_texts(capsys, merged, " on the mat", *options, "--state", state)
    assert gpn_main(["generate", str(bpe_dir), PROMPTS[0], "--device", "cpu", "--save-state", str(base_state)]) == 0
    for model, other in ((bpe_dir, state), (folder, base_state)):
        capsys.readouterr()
        assert gpn_main(["generate", str(model), "more", "--device", "cpu", "--state", str(other)]) == 2
        assert "holds the state of another model: same configuration, other weights" in capsys.readouterr().err
    # A state the unmerged PeftModel computed is not the merged model's bit for bit (the adapter's product added
    # beside the weights rounds otherwise): refused, the line saying why and what to do.
    peft_state = tmp_path / "peft.safetensors"
    with torch.no_grad():
        peft_model(**tokenizer(PROMPTS[:1], return_tensors="pt"), use_cache=True).cache.save(peft_state)
    assert gpn_main(["generate", str(folder), "more", "--device", "cpu", "--state", str(peft_state)]) == 2
    assert (
        "It was computed by a model with PEFT adapters unmerged (a PeftModel), and this one has none unmerged"
        in capsys.readouterr().err
    )
    # The merged weights are PEFT's merge bit for bit (the adapter's file read once, and given to PEFT).
    from modeling_gpn.cli.loading import load_causal_lm

    # In another dtype (gpn eval --dtype, gpn serve --dtype), the merged model's in it: merged as saved, then cast (the
    # base loaded in bfloat16 and merged there rounded the weights and the adapter's product apart before their sum).
    for dtype in (None, torch.bfloat16):
        merged_weights = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).state_dict()
        loaded_weights = load_causal_lm(str(folder), dtype=dtype).state_dict()
        assert loaded_weights.keys() == merged_weights.keys()
        assert all(torch.equal(loaded_weights[name], merged_weights[name]) for name in merged_weights), dtype


def test_an_adapter_with_weights_its_base_has_no_place_for_is_one_line_and_peft_saved_ones_load(
    bpe_dir, adapter, tmp_path, capsys
):
    """Weights in an adapter's file that the adapted model has no place for (a key renamed by hand, an adapter of
    another model's modules) were dropped in silence by PEFT (transformers' load_adapter only reported them), and
    the model merged or attached lacked what was trained: one line naming them and the adapter, merged (gpn
    generate, eval, serve) or attached (gpn inspect). PEFT renames the file's keys as it loads them (the adapter's
    name inserted, modules_to_save's copy, the embedding's lora_embedding_A and its saved table, DoRA's magnitude):
    adapters PEFT saved from a GPN load, merged into PEFT's merge bit for bit."""
    import shutil

    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from modeling_gpn.cli.loading import load_causal_lm

    weights = load_file(adapter[0] / "adapter_model.safetensors")
    renamed = sorted(name for name in weights if ".fuse_proj.lora_A." in name)
    other_model = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    hand_edited = {
        **{name.replace("lora_A", "lora_a"): tensor.clone() for name, tensor in weights.items() if name in renamed},
        **{name: tensor for name, tensor in weights.items() if name not in renamed},
        renamed[0]: weights[renamed[0]],  # (kept: the file is then complete, only over-full)
        other_model: torch.zeros(4, 48),
    }
    edited = tmp_path / "edited"
    shutil.copytree(adapter[0], edited)
    save_file(hand_edited, edited / "adapter_model.safetensors")
    unplaced = sorted([other_model, *(name.replace("lora_A", "lora_a") for name in renamed)])
    assert gpn_main(["generate", str(edited), "hi", "--device", "cpu"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn generate: error:")]
    assert lines == [
        f"gpn generate: error: the PEFT adapter {edited} does not fit its base: its weights file holds "
        f"{', '.join(unplaced)}, which the adapted model has no place for (PEFT would drop them); save the adapter "
        "again from its model"
    ]
    with pytest.raises(ValueError, match="does not fit its base") as refusal:
        load_causal_lm(str(edited), merge_adapter=False)  # (gpn inspect's: transformers' load_adapter)
    assert other_model.removeprefix("base_model.model.") in str(refusal.value)

    torch.manual_seed(11)
    ids = torch.randint(0, 200, (1, 9))
    for number, settings in enumerate(
        (
            dict(target_modules=["embed_tokens", "gate"]),
            dict(target_modules=["read_query"], modules_to_save=["decode_proj"]),
            dict(target_modules=["gate", "ffn_in"], use_dora=True),
        )
    ):
        saved = tmp_path / f"peft-saved-{number}"
        lora = LoraConfig(r=2, init_lora_weights=False, **settings)
        get_peft_model(AutoModelForCausalLM.from_pretrained(bpe_dir), lora).save_pretrained(saved)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bpe_dir), saved).eval()
        with torch.no_grad():
            unmerged = peft_model(ids).logits
        expected, loaded = peft_model.merge_and_unload().state_dict(), load_causal_lm(str(saved)).state_dict()
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
        # Attached (gpn inspect's), DoRA's too (transformers' load_adapter missed its magnitude vectors, refused as
        # incomplete): the PeftModel's computation bit for bit.
        with torch.no_grad():
            assert torch.equal(load_causal_lm(str(saved), merge_adapter=False)(ids).logits, unmerged)


def test_an_adapter_whose_base_cannot_be_found_or_whose_weights_are_cut_is_one_line(adapter, tmp_path, capsys):
    """A base folder that is not there, none named, a Hub id that cannot be reached (offline): one line naming the
    adapter and its base, exit 2 (it was "not a model folder: it has no config.json"). A weights file that lacks
    some of the adapter's weights: one line naming them and the adapter (PEFT only warned, and the merge used them
    as initialised). An adapter folder that holds a tokenizer has it read (`tokenizer_source`)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from modeling_gpn.cli.loading import tokenizer_source

    cases = {
        str(
            tmp_path / "gone"
        ): "the base model of the PEFT adapter {adapter} cannot be found: model folder {base} does not exist",
        None: "the PEFT adapter {adapter} names no base model (adapter_config.json's base_model_name_or_path is None)",
        # (offline, as the suite runs: the Hub id is neither a folder nor cached, said before anything loads)
        "gpn-tests/no-such-base": "the base model of the PEFT adapter {adapter} cannot be found: {base} is neither a "
        "folder here",
    }
    for number, (base, words) in enumerate(cases.items()):
        copy = tmp_path / f"adapter-{number}"
        shutil.copytree(adapter[0], copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        (copy / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
        assert gpn_main(["generate", str(copy), "hi", "--device", "cpu"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn generate: error:")]
        assert len(lines) == 1 and words.format(adapter=copy, base=base) in lines[0], lines
    cut = tmp_path / "adapter-cut"
    shutil.copytree(adapter[0], cut)
    weights = load_file(cut / "adapter_model.safetensors")
    lost = sorted(name for name in weights if ".gate." in name)
    save_file({name: tensor for name, tensor in weights.items() if name not in lost}, cut / "adapter_model.safetensors")
    assert gpn_main(["generate", str(cut), "hi", "--device", "cpu"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn generate: error:")]
    assert lines == [
        f"gpn generate: error: the PEFT adapter {cut} is incomplete: its weights file lacks {', '.join(lost)} of the "
        "adapter's weights (PEFT would leave them as initialised); save the adapter again"
    ]
    # A damaged adapter_model.safetensors or adapter_config.json: one line naming the file (PEFT's and safetensors'
    # errors were tracebacks, or named the folder as a model that cannot load).
    weights_bytes = (adapter[0] / "adapter_model.safetensors").read_bytes()
    header_size = int.from_bytes(weights_bytes[:8], "little")
    header = json.loads(weights_bytes[8 : 8 + header_size])
    header[lost[0]]["data_offsets"][1] += 4096  # (a header lying about a tensor's size)
    lying = json.dumps(header).encode().ljust(header_size + 8)
    config = json.loads((adapter[0] / "adapter_config.json").read_text())
    damaged = {
        "cut": ("adapter_model.safetensors", weights_bytes[: len(weights_bytes) // 2]),
        "lying": (
            "adapter_model.safetensors",
            len(lying).to_bytes(8, "little") + lying + weights_bytes[8 + header_size :],
        ),
        "not-json": ("adapter_config.json", b'{"peft_type": "LORA", '),
        "wrong-type": ("adapter_config.json", json.dumps({**config, "r": "four"}).encode()),
    }
    for name, (file, content) in damaged.items():
        copy = tmp_path / f"damaged-{name}"
        shutil.copytree(adapter[0], copy)
        (copy / file).write_bytes(content)
        assert gpn_main(["generate", str(copy), "hi", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("gpn generate: error:")]
        assert len(lines) == 1 and f"the PEFT adapter {copy}: " in lines[0] and file in lines[0], (name, lines)
        assert "Traceback" not in err
    assert tokenizer_source(str(adapter[0])) != str(adapter[0])
    AutoTokenizer.from_pretrained(adapter[1]).save_pretrained(tmp_path / "adapter-0")
    assert tokenizer_source(str(tmp_path / "adapter-0")) == str(tmp_path / "adapter-0")


def test_an_adapter_where_peft_is_not_installed_is_one_line_naming_what_to_install(adapter, monkeypatch, capsys):
    """peft is no dependency of gpn (a fine-tune brings it): an adapter folder given to a `pip install .` without it
    was a traceback from gpn eval ("No module named 'peft'") and a line naming no install from gpn generate. Each
    command that checks its model refuses it before loading anything, in one line naming the PEFT to install, the
    one the tests run (the test extra's pin)."""
    import tomllib

    from modeling_gpn.cli.loading import PEFT_REQUIREMENT

    from ..environment import REPO_ROOT

    folder = adapter[0]
    monkeypatch.setitem(sys.modules, "peft", None)  # (what an environment without peft gives: no spec, no import)
    words = f"{folder} is a PEFT adapter folder, and loading one needs peft, which is not installed: pip install '"
    for command in ("generate", "eval"):
        assert gpn_main([command, str(folder), *(["hi"] if command == "generate" else []), "--device", "cpu"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines == [f"gpn {command}: error: {words}{PEFT_REQUIREMENT}'"], lines
    test_extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert PEFT_REQUIREMENT in test_extra


def test_a_model_whose_config_ends_generate_at_another_token_than_its_tokenizers_eos_is_named(
    bpe_dir, tmp_path, capsys
):
    """A folder whose config.json and generation_config.json end generate() at LLaMA-2's 2 beside a tokenizer whose
    end of text is another id (what `gpn convert --tokenizer` wrote before f3f1b1a): gpn generate and gpn serve's
    model manager refuse it in one line naming both ids and the fix (ends at special tokens only, a chat model's
    end of turn, are taken) (their text would run past its end, or stop at
    an ordinary token), read from generation_config.json or, without one, from config.json; gpn eval warns (its
    scores read no EOS id of the config). `gpn push` refuses it too (tests/tools/test_hub.py)."""
    import shutil

    from modeling_gpn.evaluation.runner import load_model
    from modeling_gpn.serve.models import GPNModelManager

    folder = tmp_path / "old-convert"
    shutil.copytree(bpe_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    eos = config["eos_token_id"]
    assert eos != 2
    for name in ("config.json", "generation_config.json"):
        values = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**values, "eos_token_id": 2}))
    expected = "ends generate() at token id 2 ("
    fix = f"not at its tokenizer's end of text {eos} "
    for without_generation_config in (False, True):
        if without_generation_config:
            (folder / "generation_config.json").unlink()
        assert gpn_main(["generate", str(folder), "the cat", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and fix in err and "eos_token_id" in err, err
    with pytest.raises(ValueError, match=r"ends generate\(\) at token id 2 \("):
        GPNModelManager(device="cpu")._load_processor(str(folder))
    load_model(str(folder))
    assert f"gpn eval: warning: {folder}'s generation config ends generate() at token id 2" in capsys.readouterr().err
    load_model(str(bpe_dir))  # (agreeing ids: not a word)
    assert "warning" not in capsys.readouterr().err
    # Ending at a special token of the tokenizer only (a chat model's end of turn) is the model's choice: taken.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    tokenizer.save_pretrained(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_turn}))
    GPNModelManager(device="cpu")._load_processor(str(folder))


def test_two_runs_continuing_one_state_file_never_drop_a_turn_in_silence(bpe_dir, tmp_path, monkeypatch, capsys):
    """`gpn generate --state F --save-state F` run twice at once (two terminals continuing one conversation): each
    read F, and the later save replaced the earlier one's, whose turn was gone from the conversation without a
    word. A run holds F (an flock) from its start to its save: a second run saving to F meanwhile, started while
    this one is inside generate(), between reading F and writing it, is refused at its start, naming the holder's
    pid, and F is the first run's continuation. (The second run is this process's own `gpn generate`: a flock taken
    through another open conflicts as another process's does; run as a real second process it printed the same,
    at 5 s of CPU for its imports.) A writer that does not hold F (the library's `GPNCache.save`) replacing it
    meanwhile makes the save refuse, naming why, instead of dropping that state."""
    import os

    from transformers import AutoModelForCausalLM

    from modeling_gpn.modeling_gpn import GPNCache

    state = tmp_path / "conversation.safetensors"
    model = AutoModelForCausalLM.from_pretrained(bpe_dir)
    continue_state = ["generate", str(bpe_dir), " on", "--state", str(state), "--save-state", str(state)]
    continue_state += ["--device", "cpu", "--max-new-tokens", "2"]
    assert gpn_main([*continue_state[:3], "--max-new-tokens", "2", "--device", "cpu", "--save-state", str(state)]) == 0
    before = GPNCache.load(state, model).get_seq_length()
    real_generate, seen = type(model).generate, {}

    def generate_beside_another_run(self, *args, **kwargs):  # inside this run's read-continue-write of F
        seen["other"] = gpn_main(continue_state)
        seen["said"] = capsys.readouterr().err
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", generate_beside_another_run)
    capsys.readouterr()
    assert gpn_main(continue_state) == 0
    assert seen["other"] == 2, seen["said"]
    assert (
        f"gpn generate: error: --save-state {state} is in use by another process (pid {os.getpid()}: " in seen["said"]
    )
    assert GPNCache.load(state, model).get_seq_length() > before  # the first run's turn, the other's refused

    def replaced_by_a_writer_that_holds_nothing(self, *args, **kwargs):
        model(torch.tensor([[5, 6, 7]]), use_cache=True).cache.save(state)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", replaced_by_a_writer_that_holds_nothing)
    capsys.readouterr()
    assert gpn_main(continue_state) == 2
    assert (
        "was replaced by another process since this run read it as --state: not overwritten" in capsys.readouterr().err
    )
    assert GPNCache.load(state, model).get_seq_length() == 3  # the other writer's state, kept
