"""`gpn inspect` and the measurements behind it, on constructed cases with known answers."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from modeling_gpn import analysis
from modeling_gpn.inspect import Ablation, ablated_logits, ablated_states, collect

from ..environment import require_shared
from ..tiny_models import perturbed_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------
# Memory retention: heads with constant decays
# --------------------------------------------------------------------------------------------------


def test_constant_decays_give_exact_half_lives_and_pools():
    lives = np.array([100.0, 2.0, 1000.0, 1.0, 40.0, 3.0, 300.0])  # 1000 lies past the 400-token window
    gammas = np.broadcast_to(-1.0 / lives, (3, 400, lives.size))
    result = analysis.memory_retention(gammas)
    np.testing.assert_allclose(result["half_lives"], lives, rtol=1e-9)
    np.testing.assert_allclose(result["mean_rate_half_lives"], lives, rtol=1e-12)
    assert result["half_life_beyond_window"].tolist() == [False, False, True, False, False, False, False]
    np.testing.assert_allclose(result["curves"][10], np.exp(-10.0 / lives), rtol=1e-9)
    assert result["split"] and result["fast_heads"] == [1, 3, 5] and result["slow_heads"] == [0, 2, 4, 6]
    assert 3.0 < result["threshold"] < 40.0


def test_retention_averages_over_the_starts_that_have_k_steps_left():
    """The documented definition, on decays that change along the window (constant decays give every definition
    the same curve): R(k) = mean over windows and starts s = 0..T-k of exp(gamma_s + ... + gamma_{s+k-1}). Here
    the first half of a window forgets fast and the second slowly, so the paper's product from the first token
    alone, or a product of mean retentions, gives other curves."""
    length, rng = 12, np.random.default_rng(7)
    gammas = np.concatenate([np.full((2, length // 2, 2), -1.0), np.full((2, length // 2, 2), -0.05)], axis=1)
    gammas = gammas * rng.uniform(0.5, 1.5, gammas.shape)
    curves = analysis.retention_curves(gammas)
    assert curves.shape == (length + 1, 2) and np.all(curves[0] == 1.0)
    for k in range(1, length + 1):
        products = [np.exp(gammas[n, s : s + k].sum(axis=0)) for n in range(2) for s in range(length - k + 1)]
        np.testing.assert_allclose(curves[k], np.mean(products, axis=0), rtol=1e-12)
    from_first_token = np.exp(gammas[:, :4].sum(axis=1)).mean(axis=0)
    assert np.all(curves[4] > 10 * from_first_token)  # so the check tells the definitions apart


def test_pool_split_refuses_a_split_without_two_timescales():
    assert analysis.split_pools([5.0, 6.0, 7.0, 8.0])["split"] is False
    assert analysis.split_pools([5.0])["fast_heads"] == []
    two = analysis.split_pools([1.0, 1.2, 50.0, 60.0, math.inf])
    assert two["fast_heads"] == [0, 1] and two["slow_heads"] == [2, 3, 4]


def test_constant_decays_set_in_a_model_come_back_from_its_forward_pass():
    model = perturbed_model(tiny_config())
    lives = torch.tensor([1.5, 4.0, 60.0])
    with torch.no_grad():
        write = model.model.memory_write
        write.decay.weight.zero_()
        write.A_log.zero_()
        rate = 1.0 / lives  # gamma = -exp(0) * softplus(dt_bias) = -1/h
        write.dt_bias.copy_(rate + torch.log(-torch.expm1(-rate)))
    windows = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(0))
    collected = collect(model, windows, batch_size=2, progress=False)
    assert collected.states.shape == (2, 80, 48) and collected.gammas.shape == (2, 80, 3)
    result = analysis.memory_retention(collected.gammas)
    np.testing.assert_allclose(result["half_lives"], lives.numpy(), rtol=1e-4)
    assert result["fast_heads"] == [0, 1] and result["slow_heads"] == [2]


def test_the_losses_decode_a_few_positions_at_a_time_and_equal_the_full_logits(monkeypatch):
    """collect, the ablations' and the decoded perplexity gave the loss of a whole batch's (batch, T, vocab)
    logits at once (gigabytes for long windows at a LLaMA-sized vocabulary); they decode p_t a few positions at a
    time now, with the same loss."""
    import torch.nn.functional as F

    from modeling_gpn.inspect import ablation_perplexity, decoded_perplexity, states

    model = perturbed_model(tiny_config())
    windows = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = F.cross_entropy(
            model(windows).logits[:, :-1].reshape(-1, 97), windows[:, 1:].reshape(-1), reduction="sum"
        )
    monkeypatch.setattr(states, "NLL_CHUNK_POSITIONS", 7)
    rows = []
    logits_of = model.logits_of  # every logit the forward or `decode` makes passes here: count its rows
    monkeypatch.setattr(model, "logits_of", lambda hidden: rows.append(hidden[..., 0].numel()) or logits_of(hidden))
    collected = collect(model, windows, batch_size=2, progress=False)
    ablated = ablation_perplexity(model, windows, Ablation(), batch_size=2, progress=False)
    decoded = decoded_perplexity(model, collected.states, windows)
    assert rows and max(rows) <= 7
    assert collected.nll_count == ablated["tokens"] == decoded["tokens"] == 58
    for nll in (collected.nll_sum, ablated["nll"] * 58, decoded["nll"] * 58):
        assert nll == pytest.approx(full.item(), rel=1e-5)


# --------------------------------------------------------------------------------------------------
# Geometry: states with a known covariance
# --------------------------------------------------------------------------------------------------


def states_with_covariance(eigenvalues: np.ndarray, dim: int, num: int, seed: int = 0) -> np.ndarray:
    """`num` states in R^dim whose sample covariance (1/N) is exactly Q diag(eigenvalues) Q^T."""
    rng = np.random.default_rng(seed)
    rank = eigenvalues.size
    z = rng.standard_normal((num, rank))
    z -= z.mean(axis=0)
    q_z, _ = np.linalg.qr(z)  # orthonormal columns, still zero-mean
    whitened = q_z * math.sqrt(num)  # z^T z / N = I
    basis, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    offset = rng.standard_normal(dim) * 5
    return whitened * np.sqrt(eigenvalues) @ basis[:, :rank].T + offset


def expected_spectrum(eigenvalues: np.ndarray) -> dict:
    lam = np.sort(eigenvalues)[::-1]
    total, running, counts = lam.sum(), 0.0, {}
    for i, value in enumerate(lam, start=1):
        running += value
        for frac in (0.9, 0.99):
            if frac not in counts and running / total >= frac:
                counts[frac] = i
    return {
        "stable_rank": total / lam[0],
        "participation_ratio": total**2 / (lam**2).sum(),
        "components_for_90pct": counts[0.9],
        "components_for_99pct": counts[0.99],
    }


@pytest.mark.parametrize(
    "dim,num,eigenvalues",
    [
        (40, 500, np.geomspace(30.0, 0.05, 40)),  # more states than dimensions: covariance path
        (60, 30, np.array([50.0, 20, 9, 7, 3, 2.5, 1, 0.4, 0.2, 0.05])),  # fewer: Gram path, rank 10
    ],
)
def test_geometry_recovers_a_known_covariance(dim, num, eigenvalues):
    states = states_with_covariance(eigenvalues, dim, num)
    geometry = analysis.state_geometry(states)
    expected = expected_spectrum(eigenvalues)
    assert geometry["components_for_90pct"] == expected["components_for_90pct"]
    assert geometry["components_for_99pct"] == expected["components_for_99pct"]
    assert geometry["stable_rank"] == pytest.approx(expected["stable_rank"], rel=1e-9)
    assert geometry["participation_ratio"] == pytest.approx(expected["participation_ratio"], rel=1e-9)
    np.testing.assert_allclose(geometry["eigenvalues"][: eigenvalues.size], np.sort(eigenvalues)[::-1], rtol=1e-8)
    np.testing.assert_allclose(geometry["norms"], np.linalg.norm(states, axis=1))


def test_geometry_counts_dead_dimensions_and_reads_correlations():
    rng = np.random.default_rng(1)
    states = rng.standard_normal((4000, 6)) * np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    states[:, 1] = 0.5 * states[:, 0] / 1.0 * 2.0 + 0.0  # dim 1 = dim 0 exactly (correlation 1)
    states[:, 4] = 7.0  # dead: constant
    states[:, 5] = 7.0 + 1e-9 * rng.standard_normal(4000)  # dead: below 1e-3 x median std
    geometry = analysis.state_geometry(states)
    assert geometry["dead_dims"] == 2
    assert geometry["offdiag_corr_max_abs"] == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(geometry["sorted_dim_std"], np.sort(states.std(axis=0))[::-1])
    with pytest.raises(ValueError, match="NaN"):
        analysis.state_geometry(np.full((3, 4), np.nan))


# --------------------------------------------------------------------------------------------------
# The mean direction and horizons
# --------------------------------------------------------------------------------------------------


def test_a_planted_mean_direction_is_recovered_with_its_decoded_tokens():
    from modeling_gpn import GPNForCausalLM

    torch.manual_seed(0)
    model = GPNForCausalLM(tiny_config()).eval()
    planted = [42, 5, 17]  # in decreasing logit order
    unit = torch.nn.functional.normalize(torch.randn(32), dim=0)
    with torch.no_grad():
        for scale, token in zip((3.0, 2.0, 1.0), planted):
            model.model.embed_tokens.weight[token] = scale * unit
        # a state direction the decoder maps onto `unit`: W_dec v = unit (W_dec is 32 x 48, full row rank)
        direction = torch.linalg.lstsq(model.model.decode_proj.weight.double(), unit.double()[:, None]).solution[:, 0]
    direction = direction.numpy() * 40 / np.linalg.norm(direction.numpy())

    rng = np.random.default_rng(0)
    noise = rng.standard_normal((8, 50, 48)) * 3
    noise -= noise.reshape(-1, 48).mean(axis=0)  # exactly zero mean: the mean is the planted vector
    states = direction + noise

    @torch.no_grad()
    def decode(vector):
        return model.decode(torch.tensor(vector, dtype=torch.float32)[None])[0].numpy()

    counts = np.zeros(97)
    counts[planted] = [300, 200, 100]
    counts[[1, 2, 3]] = [1, 2, 3]
    result = analysis.mean_direction(states, decode, unigram_counts=counts, top_k=5)
    np.testing.assert_allclose(result["s_bar"], direction, atol=1e-9)
    assert result["norm"] == pytest.approx(40.0)
    assert result["top_ids"][:3] == planted
    assert result["batch_cosine_mean"] > 0.98 and result["num_batches"] == 8
    assert result["running_mean_cosine"][-1] > 0.99  # each sequence's own mean is s̄ plus noise
    assert result["running_mean_reaches_0.98_at_token"] is not None
    assert result["spearman_unigram_seen_tokens"] > 0.5  # the three planted tokens are the most frequent


def test_spearman_matches_known_values():
    assert analysis.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert analysis.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    np.testing.assert_allclose(analysis.rankdata([10, 20, 20, 5]), [2.0, 3.5, 3.5, 1.0])
    # with ties: Pearson of the average ranks [1, 2.5, 2.5, 4] and [1, 2, 3, 4] = 0.9486833
    assert analysis.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10), rel=1e-12)


def test_horizons_of_an_alternating_state():
    """p_t = a + (-1)^t b with a ⟂ b: raw cos(k) = (|a|^2 + (-1)^k |b|^2) / (|a|^2 + |b|^2), centred (-1)^k."""
    a, b = np.zeros(6), np.zeros(6)
    a[0], b[1] = 3.0, 1.0
    signs = (-1.0) ** np.arange(20)
    states = np.stack([a + s * b for s in signs])[None].repeat(2, axis=0)
    result = analysis.state_horizons(states, lags=[1, 2, 3, 10])
    np.testing.assert_allclose(result["raw"], [(9 - 1) / 10, 1, 0.8, 1])
    np.testing.assert_allclose(result["centred"], [-1, 1, -1, 1])


def test_horizons_and_retention_pair_no_positions_across_a_reset():
    """Statistics that pair positions (the horizons' cos(p_t, p_t+k), the retention's products of consecutive e^γ)
    paired positions of different documents, across a reset the model ran. With documents, only pairs inside one
    document count: here every state of a document is one direction (+a in the first, -a in the second), so
    every pair inside a document has cosine 1 and every pair across has -1; the decays differ by document."""
    a = np.zeros((1, 10, 4))
    a[..., 0] = 1.0
    states = np.concatenate([a[:, :4] * 2.0, -a[:, :6]], axis=1).repeat(2, axis=0)  # documents of 4 and 6 positions
    documents = np.array([[0] * 4 + [1] * 6] * 2)
    paired = analysis.state_horizons(states, lags=[1, 3, 5], documents=documents)
    np.testing.assert_allclose(paired["raw"], [1.0, 1.0, 1.0])
    carried = analysis.state_horizons(states, lags=[1, 3, 5])
    assert carried["raw"][0] < 1.0  # across the reset they pair: the check can fail
    assert analysis.state_horizons(states, lags=[6], documents=documents)["raw"][0] != 1.0  # (NaN: no pair)

    gammas = np.concatenate([np.full((2, 4, 1), -1.0), np.full((2, 6, 1), -0.1)], axis=1)
    curves = analysis.retention_curves(gammas, documents=documents)
    assert curves.shape == (7, 1)  # to the longest document
    for k in range(1, 7):
        inside = [
            np.exp(gammas[n, s : s + k].sum())
            for n in range(2)
            for s in range(10 - k + 1)
            if (s < 4) == (s + k - 1 < 4)
        ]
        np.testing.assert_allclose(curves[k, 0], np.mean(inside), rtol=1e-12)
    assert not np.allclose(analysis.retention_curves(gammas)[1:7], curves[1:])  # the check can fail
    result = analysis.memory_retention(gammas, documents=documents)
    assert result["max_lag"] == 6 and np.isfinite(result["half_lives"]).all()


# --------------------------------------------------------------------------------------------------
# Causal ablations
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"num_predict_layers": 2}, {"use_memory": False}])
def test_unablated_recurrence_reproduces_the_model_exactly(overrides):
    model = perturbed_model(tiny_config(**overrides))
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = model(ids).logits  # the default forward runs the fast (folded-weight) recurrence
        model.model.use_fast_path = False
        plain = model(ids).logits  # the plain per-step loop, built from the same pieces as ablated_logits
        assert torch.equal(ablated_logits(model, ids), plain)
        assert torch.equal(ablated_logits(model, ids, Ablation(decode_shift=torch.zeros(48))), plain)
        torch.testing.assert_close(ablated_logits(model, ids), fast, rtol=1e-4, atol=1e-4)


def test_ablations_change_what_they_claim_to():
    model = perturbed_model(tiny_config())
    model.model.use_fast_path = False  # compare with the plain loop, bit for bit
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(2))
    shift = torch.randn(48)
    with torch.no_grad():
        out = model(ids, output_predicted_states=True)
        base, states = out.logits, out.predicted_states
        decoded = ablated_logits(model, ids, Ablation(decode_shift=shift))
        torch.testing.assert_close(decoded, model.decode(states - shift))
        carried = ablated_logits(model, ids, Ablation(carry_shift=shift))
        assert torch.equal(carried[:, 0], base[:, 0]) and not torch.allclose(carried[:, 1:], base[:, 1:])
        reads_off = ablated_logits(model, ids, Ablation(reads_off=True))
        all_heads_off = ablated_logits(model, ids, Ablation(heads_off=(0, 1, 2)))
        assert torch.equal(reads_off, all_heads_off)  # a zero memory reads back exactly nothing
        assert not torch.allclose(reads_off, base)
        one_off = ablated_logits(model, ids, Ablation(heads_off=(1,)))
        assert not torch.allclose(one_off, base) and not torch.allclose(one_off, reads_off)
        with pytest.raises(ValueError, match="do not exist"):
            ablated_logits(model, ids, Ablation(heads_off=(3,)))
        with pytest.raises(ValueError, match="no memory"):
            ablated_logits(perturbed_model(tiny_config(use_memory=False)), ids, Ablation(reads_off=True))


def test_removing_memory_heads_leaves_the_other_heads_reads_as_they_were():
    """The read's output norm runs over all heads' reads together: keeping some heads' memory at zero scaled the
    other heads' read up (on the tiny-cpu model the slow pool "off" cost +64%, more than every read off, +36%;
    removed after the norm, +20%). Removing heads A, and separately the other heads B, must remove complementary
    parts of one read: at the first token, where every run has the same state and memory,
    p(A off) + p(B off) = p(nothing off) + p(every read off)."""
    model = perturbed_model(tiny_config())
    ids = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():

        def first_state(ablation):
            return ablated_states(model, ids, ablation)[:, 0].double()

        base, no_reads = first_state(Ablation()), first_state(Ablation(reads_off=True))
        fast, slow = first_state(Ablation(heads_off=(0,))), first_state(Ablation(heads_off=(1, 2)))
    assert (base - no_reads).abs().max() > 0.1  # the first token's read matters, so the check can fail
    torch.testing.assert_close(fast + slow, base + no_reads, rtol=0, atol=1e-5)
    assert (fast - base).abs().max() > 0.01 and (slow - base).abs().max() > 0.01


# --------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_vocab_model(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_gpn")
    # (LLaMA-2's end of text: a config ending generate() elsewhere is warned of)
    perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer")).save_pretrained(folder)
    return folder


def test_gpn_inspect_end_to_end(tiny_llama_vocab_model, tmp_path, capfd):
    """The whole command; `--quiet` shows no progress bar of any library (transformers' "Loading weights" showed),
    and a second run into the same folder is refused before the model loads: it overwrote the report without
    notice, and under --no-ablations the first run's ablations.png stayed beside the new report as its own."""
    import matplotlib.image

    from gpn_cli import main

    text = require_shared("data/tinyshakespeare/input.txt")
    output = tmp_path / "report"
    arguments = ["inspect", str(tiny_llama_vocab_model), "--data", str(text), "--tokens", "600", "--seq-len", "64"]
    capfd.readouterr()
    code = main([*arguments, "--batch-size", "5", "--output", str(output), "--quiet"])
    assert code == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s]" not in err, err
    assert "gpn inspect: warning" not in err, err  # (its generation config ends at its tokenizer's end of text)
    written = {path.name: path.read_bytes() for path in output.iterdir()}
    assert main([*arguments, "--no-ablations", "--output", str(output), "--quiet"]) == 2
    assert capfd.readouterr().err == (
        f"gpn inspect: error: --output {output} already holds a report (report.json, report.md, geometry.png, "
        "mean_direction.png, horizons.png, ablations.png); choose another folder, or give --overwrite to replace it\n"
    )
    assert {path.name: path.read_bytes() for path in output.iterdir()} == written
    # --overwrite replaces it, once the new report is made: the figure the new run does not draw is removed
    assert main([*arguments, "--no-ablations", "--output", str(output), "--quiet", "--overwrite"]) == 0
    assert not (output / "ablations.png").exists()
    assert json.loads((output / "report.json").read_text())["figures"] == [
        "geometry.png",
        "mean_direction.png",
        "horizons.png",
    ]
    for name, data in written.items():
        (output / name).write_bytes(data)  # (the first run's report, for the checks below)
    report = json.loads((output / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert report["data"]["windows"] == 9 and report["data"]["tokens"] == 576  # 600 // 64 windows
    assert report["geometry"]["num_states"] == 576 and report["geometry"]["state_dim"] == 48
    assert len(report["mean_direction"]["top_tokens"]) == 10
    assert len(report["memory"]["half_lives"]) == 3
    rows = {row["name"]: row for row in report["ablations"]["rows"]}
    assert {"baseline", "mean_removed_decode", "mean_removed_recurrence", "memory_reads_off"} <= set(rows)
    assert all(math.isfinite(row["perplexity"]) for row in rows.values())
    assert rows["baseline"]["perplexity"] == pytest.approx(report["data"]["perplexity"])
    markdown = (output / "report.md").read_text()
    for heading in ("## State geometry", "## Mean direction", "## Horizons", "## Memory retention", "## Causal tests"):
        assert heading in markdown
    assert sorted(report["figures"]) == ["ablations.png", "geometry.png", "horizons.png", "mean_direction.png"]
    for name in report["figures"]:
        image = matplotlib.image.imread(output / name)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600


def test_gpn_inspect_says_when_the_model_was_trained_with_document_resets(tiny_llama_vocab_model, tmp_path):
    """inspect's windows join documents with EOS and run the state on across them; a model trained with
    `--reset-at-document-start` never ran that way, and the report said nothing. Its run folder's
    train_config.json (beside RUN/model) tells, and the report's header says so."""
    from gpn_cli import main

    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"the cat sat on mat {i}. " * 8}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    shutil.copytree(tiny_llama_vocab_model, run / "model")
    reports = {}
    for resets in (False, True):
        (run / "train_config.json").write_text(json.dumps({"reset_at_document_start": resets, "lr": 0.001}))
        output = tmp_path / f"report-{resets}"
        arguments = ["inspect", str(run / "model"), "--data", str(text), "--tokens", "128", "--seq-len", "64"]
        assert main([*arguments, "--no-ablations", "--output", str(output), "--quiet"]) == 0
        reports[resets] = json.loads((output / "report.json").read_text()), (output / "report.md").read_text()
    assert reports[True][0]["data"]["trained_with_document_resets"] is True
    assert reports[False][0]["data"]["trained_with_document_resets"] is False
    assert "trained with `--reset-at-document-start`" in reports[True][1]
    assert "reset-at-document-start" not in reports[False][1]


def test_gpn_inspect_warns_of_a_model_whose_generation_ends_at_another_token(tiny_llama_vocab_model, tmp_path, capsys):
    """A folder whose configs end generate() at an ordinary token (13, LLaMA-2's byte 0x0A), not at its tokenizer's
    end of text (2): inspect's analysis reads no EOS id of the config, so it runs, with one warning line naming both
    ids (gpn generate and gpn serve refuse such a folder). (The folder whose ids agree is inspected without one:
    `test_gpn_inspect_end_to_end`.)"""
    from gpn_cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_vocab_model, folder)
    for name in ("config.json", "generation_config.json"):
        settings = json.loads((folder / name).read_text(encoding="utf-8"))
        settings["eos_token_id"] = 13
        (folder / name).write_text(json.dumps(settings), encoding="utf-8")
    text = require_shared("data/tinyshakespeare/input.txt")
    output = tmp_path / "report"
    arguments = [str(folder), "--data", str(text), "--tokens", "128", "--seq-len", "64", "--no-ablations"]
    capsys.readouterr()
    assert main(["inspect", *arguments, "--output", str(output), "--quiet"]) == 0
    assert (output / "report.json").is_file()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn inspect: warning: ")]
    assert len(warnings) == 1, warnings
    assert "generation config ends generate() at token id 13 ('<0x0A>')" in warnings[0]
    assert "end of text 2 ('</s>')" in warnings[0]


# --------------------------------------------------------------------------------------------------
# Document resets: a model trained with --reset-at-document-start, inspected in its own regime
# --------------------------------------------------------------------------------------------------

EOS = 0  # tiny_config's eos_token_id


def two_documents(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two documents, each ending in EOS, and the window (1, 23) that joins them as inspect's windows do."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.cat([torch.randint(1, 97, (9,), generator=generator), torch.tensor([EOS])])
    second = torch.cat([torch.randint(1, 97, (12,), generator=generator), torch.tensor([EOS])])
    return first[None], second[None], torch.cat([first, second])[None]


@pytest.mark.parametrize("overrides", [{}, {"num_predict_layers": 2}, {"use_memory": False}])
def test_with_resets_a_window_of_two_documents_collects_each_document_as_if_alone(overrides):
    """inspect ran a model trained with --reset-at-document-start with its state carried across the documents of a
    window. With resets, the window's p_t and gamma_t are, position for position, each document's inspected alone."""
    model = perturbed_model(tiny_config(**overrides))
    first, second, window = two_documents(seed=8)
    joined = collect(model, window, progress=False, reset_after=EOS)
    alone = [collect(model, document, progress=False) for document in (first, second)]
    np.testing.assert_allclose(joined.states, np.concatenate([a.states for a in alone], axis=1), rtol=0, atol=1e-5)
    if joined.gammas is not None:
        np.testing.assert_allclose(joined.gammas, np.concatenate([a.gammas for a in alone], axis=1), rtol=0, atol=1e-6)
    carried = collect(model, window, progress=False)
    assert (
        np.abs(carried.states[:, 10:] - alone[1].states).max() > 0.1
    )  # without resets they differ: the check can fail


@pytest.mark.parametrize(
    "ablation",
    [Ablation(), Ablation("carry", carry_shift=torch.full((48,), 0.3)), Ablation("heads", heads_off=(1,))],
    ids=lambda ablation: ablation.name,
)
def test_with_resets_an_ablation_runs_each_document_as_if_alone(ablation):
    """inspect's own time loop (the baseline and every causal test) carried the state across documents too. With
    resets its logits are each document's alone, and its perplexity is the documents' losses summed one by one
    (the token after an EOS is predicted at the EOS, from the previous document's state, as in training)."""
    import torch.nn.functional as F

    from modeling_gpn.inspect import ablation_perplexity

    model = perturbed_model(tiny_config())
    first, second, window = two_documents(seed=9)
    with torch.no_grad():
        joined = ablated_logits(model, window, ablation, reset_after=EOS)
        alone = torch.cat([ablated_logits(model, document, ablation) for document in (first, second)], dim=1)
        torch.testing.assert_close(joined, alone, rtol=0, atol=1e-5)
        assert not torch.allclose(ablated_logits(model, window, ablation)[:, 10:], alone[:, 10:], atol=1e-2)
        result = ablation_perplexity(model, window, ablation, batch_size=1, progress=False, reset_after=EOS)
    per_document = F.cross_entropy(alone[0, :-1], window[0, 1:], reduction="sum")  # each document's own logits
    assert result["tokens"] == 22
    assert result["perplexity"] == pytest.approx(math.exp(per_document.item() / 22), rel=1e-5)


def test_with_resets_the_causal_tests_baseline_is_the_documents_one_by_one():
    """The causal tests' baseline (and every condition) runs with the resets: removing nothing from a model inspected
    with resets gives the forward's perplexity with resets, not the perplexity of the state carried across."""
    from modeling_gpn.inspect import causal_tests

    model = perturbed_model(tiny_config())
    windows = torch.cat([two_documents(seed)[2] for seed in (10, 11)])
    with_resets = collect(model, windows, progress=False, reset_after=EOS)
    carried = collect(model, windows, progress=False)
    rows = causal_tests(model, windows, np.zeros(48), None, batch_size=2, progress=False, reset_after=EOS)["rows"]
    assert rows[0]["name"] == "baseline"
    assert rows[0]["perplexity"] == pytest.approx(with_resets.perplexity, rel=1e-5)
    assert abs(carried.perplexity / with_resets.perplexity - 1) > 1e-3  # the regimes differ, so the check can fail


def test_gpn_inspect_runs_a_model_in_its_own_document_regime(tiny_llama_vocab_model, tmp_path, monkeypatch):
    """The regime follows the model's run folder (train_config.json), and --[no-]reset-at-document-start overrides
    it either way; the report says which ran and why, and its numbers are the ones of that regime."""
    from transformers import AutoTokenizer

    from gpn_cli import main
    from modeling_gpn.inspect import cli, load_model, load_token_windows

    monkeypatch.setattr(cli, "write_figures", lambda report, output: [])  # (drawn and checked end to end above)
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"the cat sat on mat {i}. " * 3}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    shutil.copytree(tiny_llama_vocab_model, run / "model")
    (run / "train_config.json").write_text(json.dumps({"reset_at_document_start": True}))
    bare = tiny_llama_vocab_model  # no train_config.json anywhere

    def inspect(folder, *options) -> tuple[dict, str]:
        output = tmp_path / f"report-{len(list(tmp_path.iterdir()))}"
        arguments = ["inspect", str(folder), "--data", str(text), "--tokens", "128", "--seq-len", "64"]
        causal = [] if "--no-ablations" in options else ["--ablation-tokens", "64"]  # (refused beside it)
        assert main([*arguments, *options, *causal, "--output", str(output), "--quiet"]) == 0
        return json.loads((output / "report.json").read_text()), (output / "report.md").read_text()

    recorded, recorded_md = inspect(run / "model")
    overridden, overridden_md = inspect(run / "model", "--no-reset-at-document-start", "--no-ablations")
    asked, asked_md = inspect(bare, "--reset-at-document-start", "--no-ablations")
    assert [r["data"]["document_resets"] for r in (recorded, overridden, asked)] == [True, False, True]
    assert "train_config.json" in recorded["data"]["document_resets_from"]
    assert overridden["data"]["document_resets_from"] == "--no-reset-at-document-start"
    assert asked["data"]["document_resets_from"] == "--reset-at-document-start"
    assert "each starts from the zero state" in recorded_md and "as in training" in recorded_md
    assert "outside the regime it was trained in" in overridden_md and "(--no-reset-at-document-start)" in overridden_md
    assert "(--reset-at-document-start)" in asked_md

    model = load_model(str(bare))
    windows = load_token_windows(AutoTokenizer.from_pretrained(bare), str(text), 64, 128, progress=False)
    assert int((windows == 2).sum()) >= 2  # documents end inside the windows (2: the llama tokenizer's EOS)
    expected = collect(model, windows, progress=False, reset_after=2).perplexity
    carried = collect(model, windows, progress=False).perplexity
    assert recorded["data"]["perplexity"] == pytest.approx(expected, rel=1e-6)
    assert asked["data"]["perplexity"] == pytest.approx(expected, rel=1e-6)
    assert overridden["data"]["perplexity"] == pytest.approx(carried, rel=1e-6)
    assert abs(carried / expected - 1) > 1e-4  # the regimes differ, so the check can fail
    baseline = {r["name"]: r for r in recorded["ablations"]["rows"]}["baseline"]
    assert baseline["perplexity"] == pytest.approx(
        collect(model, windows[:1], progress=False, reset_after=2).perplexity, rel=1e-5
    )
    assert recorded["horizons"]["max_lag"] < overridden["horizons"]["max_lag"]  # lags inside one document


def test_document_resets_without_an_eos_token_are_one_line(tiny_llama_vocab_model, tmp_path, monkeypatch, capsys):
    """Documents are found by their EOS: resets asked of a tokenizer without one would silently reset nowhere.
    One `gpn inspect: error:` line names the option and what to do, exit 2, nothing written."""
    from gpn_cli import main
    from modeling_gpn.inspect import cli

    load_model_tokenizer = cli.load_model_tokenizer

    def without_eos(*args, **kwargs):
        tokenizer = load_model_tokenizer(*args, **kwargs)
        tokenizer.eos_token = None
        return tokenizer

    monkeypatch.setattr(cli, "load_model_tokenizer", without_eos)
    text = require_shared("data/tinyshakespeare/input.txt")
    output = tmp_path / "report"
    arguments = [str(tiny_llama_vocab_model), "--data", str(text), "--tokens", "128", "--seq-len", "64"]
    assert main(["inspect", *arguments, "--reset-at-document-start", "--output", str(output), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gpn inspect: error: ")]
    assert len(lines) == 1 and "Traceback" not in err and not output.exists(), err
    assert lines[0].startswith(
        "gpn inspect: error: document resets (--reset-at-document-start) need the tokenizer's EOS"
    )


def test_gpn_inspect_of_a_peft_adapter_folder(tiny_llama_vocab_model, tmp_path, capsys):
    """A PEFT adapter folder (what a LoRA fine-tune saves) was refused: "not a model folder: it has no config.json".
    It loads as its base with the adapter attached, and the report is the adapted model's, and says so: it named
    only the adapter folder, and counted the adapter's parameters as the model's."""
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpn_cli import main
    from modeling_gpn.inspect import load_token_windows

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_vocab_model)
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["read_query", "gate"], init_lora_weights=False))
    folder = tmp_path / "adapter"
    adapted.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_vocab_model)
    tokenizer.save_pretrained(folder)
    text = require_shared("data/tinyshakespeare/input.txt")
    arguments = ["--data", str(text), "--tokens", "128", "--seq-len", "64", "--no-ablations", "--quiet"]
    assert main(["inspect", str(folder), *arguments, "--output", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())

    windows = load_token_windows(tokenizer, str(text), 64, 128, progress=False)

    def perplexity() -> float:
        logits = adapted(windows).logits
        return math.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item())

    with torch.no_grad():
        with_adapter = perplexity()
        with adapted.disable_adapter():
            without = perplexity()
    assert report["data"]["perplexity"] == pytest.approx(with_adapter, rel=1e-5)
    assert abs(with_adapter / without - 1) > 1e-3  # the adapter matters, so the check can fail
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    assert report["model"]["adapter"] == {
        "base_model": [str(tiny_llama_vocab_model)],
        "peft_type": ["LORA"],
        "adapter_parameters": lora,
    }
    assert (
        f"({lora:,} of them a LORA adapter's, attached to the base model `{tiny_llama_vocab_model}`: every measurement "
        "and causal test runs the adapted model)." in (tmp_path / "report" / "report.md").read_text()
    )

    # Refused in one line, nothing written: a weights file that lacks some of the adapter's weights (transformers
    # only reported them, attached as initialised), and an adapter of a model that is no GPN, as that model is.
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cut = tmp_path / "adapter-cut"
    shutil.copytree(folder, cut)
    weights = load_file(cut / "adapter_model.safetensors")
    save_file(
        {name: tensor for name, tensor in weights.items() if ".gate." not in name}, cut / "adapter_model.safetensors"
    )
    llama = tmp_path / "llama"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(llama)
    llama_adapter = tmp_path / "llama-adapter"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(llama), LoraConfig(r=2, target_modules=["q_proj"])
    ).save_pretrained(llama_adapter)
    damaged = tmp_path / "adapter-damaged"  # (cut short: one line naming the file, was a traceback)
    shutil.copytree(folder, damaged)
    (damaged / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes()[:100])
    prefix = "base_model.model.model."  # (the keys as the file holds them)
    for model, words in (
        (cut, f"the PEFT adapter {cut} is incomplete: its weights file lacks {prefix}predict_layers.0.gate.lora_A."),
        (damaged, f"the PEFT adapter {damaged}: cannot read its weights file adapter_model.safetensors: "),
        (
            llama_adapter,
            f"gpn inspect analyses GPN models; {str(llama_adapter)!r} is a LlamaForCausalLM (model_type='llama')",
        ),
    ):
        assert main(["inspect", str(model), *arguments, "--output", str(tmp_path / "refused")]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn inspect: error: ")]
        assert len(lines) == 1 and words in lines[0], lines
        assert not (tmp_path / "refused").exists()


def test_gpn_inspect_rejects_bad_input(tiny_llama_vocab_model, tmp_path, capsys):
    """What the arguments name, missing or unusable (too little text for a window, a missing or unsupported data
    file, no model, a model folder without a tokenizer, a Hub dataset's --split or --data-config beside local data,
    which were ignored in silence): exit 2 and one line naming it, nothing written."""
    from gpn_cli import main

    text = require_shared("data/tinyshakespeare/input.txt")
    bad = tmp_path / "notes.md"
    bad.write_text("# a,b\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café résumé\n".encode("latin-1") * 50)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 42}\n')
    nulls = tmp_path / "nulls.jsonl"  # (a line without the field reads as null beside one that has it)
    nulls.write_text('{"text": "some words"}\n{"title": "no text"}\n')
    bare = tmp_path / "without-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_vocab_model / name, bare / name)
    cases = [
        (
            [str(tiny_llama_vocab_model), "--data", str(text), "--tokens", "10", "--seq-len", "64"],
            "at least one window",
        ),
        ([str(tiny_llama_vocab_model), "--data", str(tmp_path / "missing.txt")], "does not exist"),
        (
            [str(tiny_llama_vocab_model), "--data", str(bad), "--tokens", "128", "--seq-len", "64"],
            "notes.md: unknown file type '.md'",
        ),
        ([str(tiny_llama_vocab_model), "--data", str(latin1)], "latin1.txt: it is not UTF-8 text"),
        ([str(tiny_llama_vocab_model), "--data", str(numbers)], "numbers.jsonl: row 1's 'text' holds int, not text"),
        ([str(tiny_llama_vocab_model), "--data", str(nulls)], "nulls.jsonl: row 2 has no 'text' (null"),
        ([str(tmp_path / "no-such-model"), "--data", str(text)], "does not exist"),
        ([str(bare), "--data", str(text)], "holds no tokenizer"),
        (
            [str(tiny_llama_vocab_model), "--data", str(text), "--split", "validation"],
            "--split applies to a Hub dataset",
        ),
        (
            [str(tiny_llama_vocab_model), "--data", str(numbers), "--data-config", "en"],
            "--data-config applies to a Hub",
        ),
    ]
    for arguments, needle in cases:
        output = tmp_path / "report"
        assert main(["inspect", *arguments, "--output", str(output), "--quiet"]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("gpn inspect: error: ")]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
        assert not output.exists()


def test_report_of_a_gpn_without_memory(tmp_path):
    """No memory: no retention section, only the two s̄ ablations, and the figures still render."""
    import matplotlib.image
    from transformers import AutoTokenizer

    from modeling_gpn.inspect import build_report, report_json, report_markdown, write_figures

    model = perturbed_model(tiny_config(use_memory=False))
    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    windows = torch.randint(3, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    report = build_report(model, tokenizer, windows, collect(model, windows, progress=False), progress=False)
    assert report["memory"] is None
    assert [row["name"] for row in report["ablations"]["rows"]] == [
        "baseline",
        "mean_removed_decode",
        "mean_removed_recurrence",
    ]
    figures = write_figures(report, tmp_path)
    assert [f.rsplit("/", 1)[-1] for f in figures] == [
        "geometry.png",
        "mean_direction.png",
        "horizons.png",
        "ablations.png",
    ]
    assert matplotlib.image.imread(figures[2]).shape[1] > 600
    json.dumps(report_json(report), allow_nan=False)
    markdown = report_markdown(report, figures)
    assert "## Causal tests" in markdown  # the memory section says it was skipped (it was left out without a word)
    assert "## Memory retention\n\nSkipped: this model has no matrix memory (a GPN), so no decays γ." in markdown
    # the paper's "58%" is not its own 107/132: the comparison column shows both
    assert "| 107 (58% stated; 107/132 = 81%) |" in markdown
    import matplotlib.pyplot as plt

    from modeling_gpn.inspect.figures import ablations_figure, geometry_figure

    title = geometry_figure(plt, report["geometry"]).axes[1].get_title()
    ablations_title = ablations_figure(plt, report["ablations"]).axes[0].get_title()
    plt.close("all")
    assert "all dims: mean |r| = " in title  # the histogram is a sample, the mean is of every pair
    # the perplexities count 4 x 31 predicted tokens (the title gave the windows' 4 x 32 tokens)
    assert ablations_title.endswith(", 124 predicted tokens)"), ablations_title


def test_token_labels_show_a_newline_as_one_escape():
    """The labels of s̄'s decoded tokens and of the data's: a byte-level BPE's newline (gpn train's tokenizer, GPT-2's)
    was shown as its stand-in "Ċ", and the figure escaped the labels a second time (LLaMA's newline showed two backslashes)."""
    import matplotlib.pyplot as plt
    from transformers import AutoTokenizer

    from modeling_gpn.data.tokenizer import train_bpe_tokenizer
    from modeling_gpn.inspect.figures import mean_direction_figure
    from modeling_gpn.inspect.report import _token_label

    byte_level = train_bpe_tokenizer(["the cat\n\tsat on the mat\n"] * 4, vocab_size=270)
    llama = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    newlines = [
        _token_label(byte_level, byte_level.convert_tokens_to_ids("Ċ")),
        _token_label(llama, llama.convert_tokens_to_ids("<0x0A>")),
    ]
    assert newlines == ["\\n", "\\n"]
    assert _token_label(byte_level, byte_level.convert_tokens_to_ids("ĉ")) == "\\t"
    assert _token_label(llama, llama.convert_tokens_to_ids("▁the")) == "␣the"
    mean = {"running_mean_cosine": np.linspace(0.5, 0.9, 8), "norm": 1.0, "share_of_state_norm": 0.5}
    figure = mean_direction_figure(plt, {**mean, "top_tokens": [*newlines, "␣the"], "top_probs": [0.5, 0.3, 0.2]})
    shown = [label.get_text() for label in figure.axes[1].get_yticklabels()]
    plt.close("all")
    assert shown == ["␣the", "\\n", "\\n"]


def test_decode_only_shortcut_matches_the_ablated_recurrence():
    from modeling_gpn.inspect import ablation_perplexity, decoded_perplexity

    model = perturbed_model(tiny_config())
    windows = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(4))
    collected = collect(model, windows, batch_size=2, progress=False)
    shift = torch.randn(48)
    for ablation in (Ablation(), Ablation(decode_shift=shift)):
        shortcut = decoded_perplexity(model, collected.states, windows, ablation.decode_shift, batch_size=2)
        full = ablation_perplexity(model, windows, ablation, batch_size=2, progress=False)
        assert shortcut["tokens"] == full["tokens"] == 3 * 19
        assert shortcut["perplexity"] == pytest.approx(full["perplexity"], rel=1e-5)
    assert collected.perplexity == pytest.approx(
        decoded_perplexity(model, collected.states, windows)["perplexity"], rel=1e-6
    )


def test_the_causal_tests_baseline_runs_the_ablations_time_loop():
    """The baseline was the model's forward (the fast path) and the ablations ran the module-calling loop, which
    rounds differently in bf16: removing nothing (s̄ = 0) reported a perplexity change. The baseline now runs the
    ablations' own loop with nothing removed, so removing nothing changes nothing."""
    from modeling_gpn.inspect import ablation_perplexity, causal_tests

    model = perturbed_model(tiny_config(hidden_size=64)).to(torch.bfloat16)
    windows = torch.randint(0, 97, (3, 64), generator=torch.Generator().manual_seed(6))
    collected = collect(model, windows, batch_size=2, progress=False)
    assert model.model.last_recurrence_path == "fast"
    rows = {
        row["name"]: row
        for row in causal_tests(model, windows, np.zeros(64), None, batch_size=2, progress=False)["rows"]
    }
    loop = ablation_perplexity(model, windows, Ablation(), batch_size=2, progress=False)["perplexity"]
    assert collected.perplexity != loop  # the two paths do differ here, so the check can fail
    assert rows["baseline"]["perplexity"] == loop
    assert rows["mean_removed_recurrence"]["delta_pct"] == 0.0 and rows["mean_removed_decode"]["delta_pct"] == 0.0


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--tokens", "0"], "--tokens must be positive, got 0"),
        (["--seq-len", "0"], "--seq-len must be positive, got 0"),
        (["--max-geometry-states", "1"], "--max-geometry-states must be at least 2, got 1"),
        (["--ablation-tokens", "64", "--no-ablations"], "--ablation-tokens sizes the causal tests, which --no-abl"),
        (["--data", "-"], "--data -: standard input is not read; write the text to a file"),
        (["--output", "{file}"], "--output {file}: {file} is a file, not a folder"),
        (["--output", "{file}/report"], "--output {file}/report: {file} is a file, not a folder"),
        (["--output", "/proc/gpn-report"], "--output /proc/gpn-report: cannot write in /proc"),
        (["--device", "gpu"], "--device 'gpu' is not a torch device"),
        (["--device", "cuda:99"], "--device cuda:99"),  # no CUDA here, or not 100 GPUs
    ],
)
def test_gpn_inspect_checks_its_arguments_before_the_model_loads(arguments, message, tmp_path, capsys, monkeypatch):
    """A bad --output was found only after the whole analysis, as a traceback that lost it; --tokens 0 exited 1
    with a message unlike the others. Each is now one `gpn inspect: error: ...` line, exit 2, nothing loaded."""
    from gpn_cli import main
    from modeling_gpn.inspect import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    file = tmp_path / "file"
    file.write_text("x")
    arguments = [argument.format(file=file) for argument in arguments]
    if "--output" not in arguments:
        arguments += ["--output", str(tmp_path / "report")]
    assert main(["inspect", "some/model", *arguments, "--quiet"]) == 2
    assert capsys.readouterr().err.startswith(f"gpn inspect: error: {message.format(file=file)}")


def test_a_long_text_file_is_tokenized_as_gpn_train_tokenizes_it(tmp_path):
    """A .txt file longer than one piece: `gpn inspect`'s windows are the tokens of the whole file, as `gpn train`'s
    are (`text_file_pieces` and `PieceEncoder`). Tokenized in blocks on their own, each block's first word was
    tokenized as a text's first word (LLaMA's leading "▁"), not as the word after a line break it is."""
    from transformers import AutoTokenizer

    from modeling_gpn.data.corpus import PIECE_CHARS
    from modeling_gpn.inspect import load_token_windows

    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    path = tmp_path / "plays.txt"
    path.write_text(require_shared("data/tinyshakespeare/input.txt").read_text()[: 3 * PIECE_CHARS])
    whole = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = load_token_windows(tokenizer, str(path), seq_len=64, max_tokens=len(whole), progress=False)
    assert windows.numel() > len(whole) - 64
    assert windows.flatten().tolist() == whole[: windows.numel()]


def test_a_folder_is_inspected_on_exactly_the_files_gpn_train_reads(tmp_path):
    """`gpn inspect --data FOLDER` searched the folder on its own: it read Jupyter's `.ipynb_checkpoints/` copies
    and `__*` entries as more documents (which `gpn train` leaves out), took `.text` files `gpn train` did not,
    and left out the `.csv` files it trains on; a blank jsonl row was a document (its whitespace and an EOS) that
    gpn train leaves out. It finds the files as `gpn train --dataset FOLDER` does
    (`CorpusSpec.local_files`), so both read the same documents, in the same order."""
    from modeling_gpn.data import CorpusSpec
    from modeling_gpn.inspect import iter_documents

    folder = tmp_path / "corpus"
    (folder / "plays" / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "__pycache__").mkdir()
    (folder / "plays" / "one.txt").write_text("the first play\nends here\n")
    (folder / "plays" / ".ipynb_checkpoints" / "one-checkpoint.txt").write_text("the first play, an older copy\n")
    (folder / "plays" / "two.text").write_text("the second play\n")
    (folder / "rows.jsonl").write_text('{"text": "a row of the jsonl file"}\n{"text": " \\n"}\n')  # (and a blank one)
    (folder / "rows.csv").write_text('text\n"a row of the csv file"\n')
    (folder / "__pycache__" / "notes.txt").write_text("no part of the corpus\n")
    (folder / "__notes.txt").write_text("no part of the corpus either\n")

    trained = [text for text, _, _ in CorpusSpec(str(folder)).document_pieces()]
    inspected = [text for text, _, _ in iter_documents(str(folder))]
    assert inspected == trained
    assert sorted(trained) == sorted(
        ["the first play\nends here\n", "the second play\n", "a row of the jsonl file", "a row of the csv file"]
    )


def test_a_damaged_weights_file_is_one_line(tmp_path, capsys):
    """A truncated model.safetensors was safetensors' SafetensorError traceback (as in gpn eval)."""
    from gpn_cli import main

    folder = tmp_path / "damaged"
    perturbed_model(tiny_config()).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["inspect", str(folder), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpn inspect: error: cannot load a model from {folder}: SafetensorError: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_load_model_names_a_dtype_it_does_not_take_before_loading(tmp_path):
    """`inspect.load_model` from Python with a dtype the table lacks ("fp16") failed with a bare KeyError naming only
    the value; it says what it takes, before it reads the folder (there is none here)."""
    from modeling_gpn.inspect import load_model

    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'fp16'"):
        load_model(str(tmp_path / "nothing"), dtype="fp16")
