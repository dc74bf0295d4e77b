"""Mutation check: every test that claims a feature fails when that feature is taken away.

For each mutation below, a copy of the repository is made with one feature removed by editing its source
(the fast path, the C memory kernels, prepacking, the Triton path, the chunked loss, the cache, and the
checks behind the tests that once could not fail), the tests that claim that feature run on the copy, and
a table says, per mutation, how many of them ran and how many failed. Every one of them must fail: a test
that passes with its feature gone does not test it. Exit status 0 only then.

Not part of CI (it runs a slice of the suite once per mutation, some 380 of them: tens of minutes on 2 cores). Run from the
repository root, with the test environment active (and GPN_SHARED_DIR set, as for the tests):

    python tests/mutation_check.py                # all mutations
    python tests/mutation_check.py --only triton  # those whose name contains "triton"
    python tests/mutation_check.py --list         # the mutations and the tests each runs
    python tests/mutation_check.py --check-sources  # only check every mutation applies (seconds; CI runs it)

Each mutation names the exact source text it replaces and the test files that claim it. When the code
moves and the text is gone (or no longer unique), or a test file is gone, the mutation no longer applies:
that is an error of this script, reported before anything runs, so the check never prints a table that
silently left a feature untested.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {
    "configuration": "configuration",
    "conversion": "conversion",
    "evaluation": "eval",
}  # modeling_gpn.X: folder


@dataclass(frozen=True)
class Mutation:
    name: str  # the feature removed
    file: str  # relative to the repository root
    old: str  # source text that must occur exactly `occurrences` times
    new: str  # what replaces it (every occurrence)
    tests: tuple[str, ...]  # pytest node ids or `path -k expression` arguments, the tests that claim the feature
    occurrences: int = 1  # more than one: the same line in each instruction set's kernels (all are removed)


FAST_PATH_TESTS = (
    "tests/fast_path/test_fast_path.py -k (fast_equals_plain_outputs and 7-holes) or inference_fast_path or generate_fast or truncation or segmented",
    "tests/fast_path/test_triton_kernels.py::test_inference_on_the_triton_path_equals_plain",
    "tests/fast_path/test_training_graphs.py::test_what_the_sweep_does_not_take_runs_the_fast_path",
)

MUTATIONS = [
    Mutation(
        "fast path (the dispatcher always takes the plain loop)",
        "modeling_gpn/modeling_gpn.py",
        'if not self.use_fast_path or is_tracing():\n            return "plain"',
        'if True:  # MUTATION\n            return "plain"',
        FAST_PATH_TESTS,
    ),
    Mutation(
        "fast path (the plain loop runs, labelled fast)",
        "modeling_gpn/modeling_gpn.py",
        "return fast_recurrence(\n                self,\n                token_inputs,",
        "return self.recurrence_plain(  # MUTATION\n                token_inputs,",
        FAST_PATH_TESTS,
    ),
    Mutation(
        "C memory kernels (never used: the torch ops serve)",
        "modeling_gpn/memory_kernels.py",
        "    if torch.compiler.is_compiling():\n        return False\n    return all(",
        "    if True:  # MUTATION\n        return False\n    return all(",
        (
            "tests/fast_path/test_fast_path.py -k memory-kernels and (7-holes or nan or segmented)",
            "tests/fast_path/test_kernel_safety.py -k memory-kernels and (inference_and_cached or backward_called or chunked)",
        ),
    ),
    Mutation(
        "C step kernels (never chosen: the torch-ops steps serve)",
        "modeling_gpn/fast_recurrence.py",
        '    return not switched_off("GPN_STEP_KERNELS")',
        "    return False  # MUTATION",
        ("tests/fast_path/test_step_kernels.py -k plain_loop or variant or quantization_error or gpn_generate",),
    ),
    Mutation(
        "one-call decode (never chosen: the step kernels and the products serve)",
        "modeling_gpn/fast_recurrence.py",
        '    return step_kernels_enabled() and not switched_off("GPN_DECODE_KERNEL")',
        "    return False  # MUTATION",
        (
            "tests/fast_path/test_decode_call.py -k generate_decodes or beam_search or edited or written or refuses"
            " or usual_output",
            "tests/fast_path/test_step_kernels.py -k (plain_loop or variant or quantization_error) and one-call",
        ),
    ),
    Mutation(
        "one-call decode (hooks, wrappers and replaced forwards not looked for)",
        "modeling_gpn/fast_recurrence.py",
        "    model = lm.model\n    embedding, head = model.embed_tokens, lm.lm_head\n",
        "    return None  # MUTATION\n    model = lm.model\n    embedding, head = model.embed_tokens, lm.lm_head\n",
        ("tests/fast_path/test_decode_call.py -k never_skipped",),
    ),
    Mutation(
        "one-call decode (a plan kept after its modules changed)",
        "modeling_gpn/derived_weights.py",
        "    def unchanged(self) -> bool:\n",
        "    def unchanged(self) -> bool:\n        return True  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k edited and (replaced)",),
    ),
    Mutation(
        "one-call decode (the modules' hooks looked at once, not again after a hook was registered)",
        "modeling_gpn/derived_weights.py",
        "        if registered != self.hooks_seen_at:\n",
        "        if self.hooks_seen_at is None:  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k added_between_two_calls and not replaced",),
    ),
    Mutation(
        "one-call decode (a forward given to a module instance after the plan was built unseen)",
        "modeling_gpn/derived_weights.py",
        '            self._watch(module.__dict__, "forward", None)',
        "            pass  # MUTATION",
        ("tests/fast_path/test_decode_call.py -k added_between_two_calls and fuse_proj",),
    ),
    Mutation(
        "fast path (a method of the equations replaced on an instance, a class or by a subclass not looked for)",
        "modeling_gpn/derived_weights.py",
        "    kind = type(obj)\n    written = methods.get(kind)\n",
        "    return None  # MUTATION\n    kind = type(obj)\n    written = methods.get(kind)\n",
        (
            "tests/fast_path/test_replaced_methods.py -k runs_the_plain_path and not norms",
            "tests/fast_path/test_decode_call.py -k (never_skipped or added_between) and (decoded or logits_of or token_inputs or ffn)",
        ),
    ),
    Mutation(
        "fast path (any subclass of the model taken for a replacement, one that overrides nothing too)",
        "modeling_gpn/derived_weights.py",
        "            return None\n    instance = obj.__dict__\n",
        '            return None\n        return "a subclass"  # MUTATION\n    instance = obj.__dict__\n',
        ("tests/fast_path/test_replaced_methods.py -k overrides_nothing",),
    ),
    Mutation(
        "fast path (the blocks' methods not looked for: a replaced ffn, read or keys skipped)",
        "modeling_gpn/modeling_gpn.py",
        "                or (type(module) in (GPNMemoryWrite, GPNPredictLayer) and replaced_method(module, RECURRENCE_METHODS))\n",
        "",
        ("tests/fast_path/test_replaced_methods.py -k ffn or keys or read",),
    ),
    Mutation(
        "fast path (the model's own methods not looked for: a replaced ground or step skipped)",
        "modeling_gpn/modeling_gpn.py",
        "        method = replaced_method(self, RECURRENCE_METHODS)\n",
        "        method = None  # MUTATION\n",
        ("tests/fast_path/test_replaced_methods.py -k ground or overridden",),
    ),
    Mutation(
        "fast path (a forward assigned to the norms' class not looked for)",
        "modeling_gpn/modeling_gpn.py",
        '        if GPNRMSNorm.forward is not RECURRENCE_METHODS[GPNRMSNorm]["forward"]:\n',
        "        if False:  # MUTATION\n",
        ("tests/fast_path/test_replaced_methods.py -k norms",),
    ),
    Mutation(
        "fast path (a forward set on the segment layer skipped)",
        "modeling_gpn/modeling_gpn.py",
        "        method = replaced_method(segment, RECURRENCE_METHODS)\n",
        "        method = None  # MUTATION\n",
        ("tests/fast_path/test_replaced_methods.py -k segment",),
    ),
    Mutation(
        "one-call decode (the base model's and the causal LM's methods not looked for: decoder, logits skipped)",
        "modeling_gpn/fast_recurrence.py",
        "        method = replaced_method(obj, methods)\n",
        "        method = None  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k never_skipped and (decoded or logits_of or token_inputs)",),
    ),
    Mutation(
        "one-call decode (a method set on a module instance after the plan was built unseen)",
        "modeling_gpn/derived_weights.py",
        "            self._watch_methods(module, methods)\n",
        "",
        ("tests/fast_path/test_decode_call.py -k added_between_two_calls and (decoded or ffn)",),
    ),
    Mutation(
        "one-call decode (a method set on the causal LM after the plan was built unseen)",
        "modeling_gpn/derived_weights.py",
        "            self._watch_methods(caller, methods)\n",
        "            pass  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k added_between_two_calls and logits_of",),
    ),
    Mutation(
        "one-call decode (a quantized weight's attributes not watched: a replaced scale unseen)",
        "modeling_gpn/derived_weights.py",
        "                for attribute, value in held.items():\n                    self._watch(held, attribute, value)\n",
        "",
        ("tests/fast_path/test_decode_call.py -k int8_weights_edited and replaced",),
    ),
    Mutation(
        "one-call decode (a quantized weight's tensors not watched: its data on new storage unseen)",
        "modeling_gpn/derived_weights.py",
        "                tensors += inner\n",
        "",
        ("tests/fast_path/test_decode_call.py -k int8_weights_edited and storage",),
    ),
    Mutation(
        "one-call decode (the logits written into one buffer every call, which the caller holds)",
        "modeling_gpn/memory_kernels.py",
        "        logits = torch.empty(B, self.vocab_rows, dtype=self.logits_dtype)\n",
        "        logits = self.__dict__.setdefault('_reused', torch.empty(B, self.vocab_rows, dtype=self.logits_dtype))\n",
        ("tests/fast_path/test_decode_call.py::test_the_output_is_the_forwards_usual_output",),
    ),
    Mutation(
        "the kernels' switches not read (GPN_DECODE_KERNEL=0 and the others ignored)",
        "modeling_gpn/memory_kernels.py",
        '    return os.environ.get(name) == "0"\n',
        "    return False  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k generate_decodes",),
    ),
    Mutation(
        "one-call decode (the mask not read: padded rows decoded, bad values taken)",
        "modeling_gpn/fast_recurrence.py",
        "        and attention_mask.select(1, -1).tolist().count(1) == rows\n",
        "        and True  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py::test_bad_ids_and_padded_tokens",),
    ),
    Mutation(
        "one-call decode (ids outside the table read)",
        "modeling_gpn/memory_kernels.py",
        "        if (ids[b] < 0 || ids[b] >= D->vocab) return 1;",
        "        if (0) return 1;  /* MUTATION */",
        ("tests/fast_path/test_decode_call.py::test_bad_ids_and_padded_tokens",),
    ),
    Mutation(
        "one-call decode (the key the last token left reused after the state was written)",
        "modeling_gpn/fast_recurrence.py",
        "        and version is not None\n        and decoded[1] == version\n",
        "",
        ("tests/fast_path/test_decode_call.py -k written_between",),
    ),
    Mutation(
        "one-call decode (the state written in place without its version counters bumped)",
        "modeling_gpn/memory_kernels.py",
        "        increment_version(written if ids_hash is None else (*written, ids_hash[0]))\n",
        "        pass  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py::test_a_graph_that_saved_the_state_refuses_its_backward",),
    ),
    Mutation(
        "one-call decode (its output built without the ModelOutput items)",
        "modeling_gpn/modeling_gpn.py",
        "                OrderedDict.__setitem__(output, name, value)\n",
        "                pass  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py::test_the_output_is_the_forwards_usual_output",),
    ),
    Mutation(
        "int8 products on the integer dot products (each weight converted to float instead)",
        "modeling_gpn/memory_kernels.py",
        "    if (sg->kind == KIND_I8 && B <= QUANTIZED_MAX_ROWS && K <= QUANTIZED_MAX_COLS) {",
        "    if (0) {  /* MUTATION */",
        (
            "tests/fast_path/test_step_kernels.py -k exact_sums_of_the_input",
            "tests/fast_path/test_step_kernels.py::test_int8_weights_streamed_a_row_at_a_time_give_the_same_bits",
        ),
    ),
    Mutation(
        "int8 products (an input holding a NaN or an infinity rounded to 16 bits all the same)",
        "modeling_gpn/memory_kernels.py",
        "        if (bad) { q->finite = 0; break; }\n",
        "",
        ("tests/fast_path/test_step_kernels.py::test_an_int8_input_that_is_not_finite_takes_the_float_products",),
        occurrences=2,  # (VNNI's and AVX2's)
    ),
    Mutation(
        "int8 products (no smaller shift where x 2^sh would pass 32,512)",
        "modeling_gpn/memory_kernels.py",
        "        if (ldexp((double)largest, sh) > 32512.0) sh--;\n",
        "",
        ("tests/fast_path/test_step_kernels.py -k exact_sums_of_the_input",),
    ),
    Mutation(
        "AVX2 products (an x86 CPU without AVX-512 runs the plain C loops)",
        "modeling_gpn/memory_kernels.py",
        "#define GPN_AVX2 1\n",
        "",
        ("tests/fast_path/test_step_kernels.py::test_each_build_runs_the_products_it_is_built_for[avx2]",),
    ),
    Mutation(
        "AVX2 int8 products (accumulators not emptied into 64 bits every 4,096 weights)",
        "modeling_gpn/memory_kernels.py",
        "MADD_CHUNK = 256 * 16 };",
        "MADD_CHUNK = 1024 * 16 };",
        (
            "tests/fast_path/test_step_kernels.py::test_int8_sums_stay_exact_over_rows_longer_than_an_accumulator_holds[avx2]",
        ),
    ),
    Mutation(
        "rows far beyond the L3 not prefetched ahead",
        "modeling_gpn/memory_kernels.py",
        "            segment.flags |= STREAM_ROWS | (FAR_ROWS if far else 0)\n",
        "            segment.flags |= STREAM_ROWS\n",
        ("tests/fast_path/test_step_kernels.py::test_rows_far_beyond_the_l3_are_prefetched_ahead",),
    ),
    Mutation(
        "long float rows streamed from DRAM read one at a time, not in pairs",
        "modeling_gpn/memory_kernels.py",
        "    return B == 1 && sg->kind == KIND_F32 && (sg->flags & STREAM_ROWS) && sg->cols >= PAIR_MIN_COLS;\n",
        "    return 0;\n",
        ("tests/fast_path/test_step_kernels.py -k read_in_pairs and not portable",),
    ),
    Mutation(
        "a pair of float rows (the second row given the first's sum)",
        "modeling_gpn/memory_kernels.py",
        "                store_output(sg, 0, r + 1, y[1]);\n",
        "                store_output(sg, 0, r + 1, y[0]);\n",
        ("tests/fast_path/test_step_kernels.py -k read_in_pairs and not portable",),
    ),
    Mutation(
        "short rows in the L3 read beside their input (not held in registers)",
        "modeling_gpn/memory_kernels.py",
        "    if (!HELD_INPUT || B != 1 ||",
        "    if (1 || B != 1 ||",
        ("tests/fast_path/test_step_kernels.py -k hold_their_input and native",),
    ),
    Mutation(
        "a bf16 row read with its input held (the last accumulator left out of its sum)",
        "modeling_gpn/memory_kernels.py",
        "            GPN_HELD(c4, 4); GPN_HELD(c5, 5); GPN_HELD(c6, 6); GPN_HELD(c7, 7);\n",
        "            GPN_HELD(c4, 4); GPN_HELD(c5, 5); GPN_HELD(c6, 6);\n",
        ("tests/fast_path/test_step_kernels.py -k hold_their_input and native",),
    ),
    Mutation(
        "an int8 row read with its input held (the low byte plane of every other vector left out)",
        "modeling_gpn/memory_kernels.py",
        "            DPBUSD_HELD(h1, w1, vh[a + 1]); DPBUSD_HELD(l1, w1, vl[a + 1]);\n",
        "            DPBUSD_HELD(h1, w1, vh[a + 1]);\n",
        ("tests/fast_path/test_step_kernels.py -k hold_their_input and native",),
    ),
    Mutation(
        "int8 rows in the L3 not read from their tiles",
        "modeling_gpn/memory_kernels.py",
        "    return B == 1 && sg->kind == KIND_I8 && sg->tiles && r0 % 16 == 0;\n",
        "    return 0;\n",
        ("tests/fast_path/test_step_kernels.py -k (tiles_of_16 and native) or tiles_its_weights",),
    ),
    Mutation(
        "a task beginning inside a tile read from the tile's start",
        "modeling_gpn/memory_kernels.py",
        "    return B == 1 && sg->kind == KIND_I8 && sg->tiles && r0 % 16 == 0;\n",
        "    return B == 1 && sg->kind == KIND_I8 && sg->tiles;\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and native",),
    ),
    Mutation(
        "the last of four tiles stored whole past the task's end",
        "modeling_gpn/memory_kernels.py",
        "        store_tile(sg, q, r + 48, r1 - r - 48 < 16 ? r1 - r - 48 : 16, h3, l3);\n",
        "        store_tile(sg, q, r + 48, 16, h3, l3);\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and native",),
    ),
    Mutation(
        "a tile's outputs without the segment's bias",
        "modeling_gpn/memory_kernels.py",
        "    if (sg->bias && !(sg->flags & BIAS_AFTER_ROUND)) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, sg->bias + r));\n",
        "",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and native",),
    ),
    Mutation(
        "a tile's outputs stored as floats where the segment asks for bf16",
        "modeling_gpn/memory_kernels.py",
        "    if (sg->flags & STORE_BF16) _mm256_mask_storeu_epi16(",
        "    if (0) _mm256_mask_storeu_epi16(",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and native",),
    ),
    Mutation(
        "tiles without the weights' top bits flipped",
        "modeling_gpn/memory_kernels.py",
        "_mm512_storeu_si512((void *)(tiles + 16 * (t * width + k) + 64 * j), _mm512_xor_si512(r[j], flip));",
        "_mm512_storeu_si512((void *)(tiles + 16 * (t * width + k) + 64 * j), r[j]);",
        ("tests/fast_path/test_step_kernels.py -k (tiles_of_16 and native) or tiles_its_weights",),
    ),
    Mutation(
        "tiles transposed with two quarters of the columns swapped",
        "modeling_gpn/memory_kernels.py",
        "        r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);\n        r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);\n",
        "        r[12 + j] = _mm512_shuffle_i32x4(b, d, 0x88);\n        r[4 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);\n",
        ("tests/fast_path/test_step_kernels.py -k (tiles_of_16 and native) or tiles_its_weights",),
    ),
    Mutation(
        "tiles without AVX-512 written without the weights' top bits flipped",
        "modeling_gpn/memory_kernels.py",
        "                    to[j] = (uint8_t)((r < rows && k + j < cols ? (uint8_t)w[r * cols + k + j] : 0) ^ 0x80u);\n",
        "                    to[j] = (uint8_t)((r < rows && k + j < cols ? (uint8_t)w[r * cols + k + j] : 0));\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and (avx2 or portable)",),
    ),
    Mutation(
        "int8 tiles built at a plan's first step, however few it runs",
        "modeling_gpn/memory_kernels.py",
        "        if self.tiles is None and self.steps >= TILE_AFTER_STEPS:\n",
        "        if self.tiles is None:\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_its_weights",),
    ),
    Mutation(
        "a decode call's products not tiled when its step plan's already are",
        "modeling_gpn/memory_kernels.py",
        "            self.tiles += _tile_int8(segments, weights, self.rows)\n",
        "            pass\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_its_weights",),
    ),
    Mutation(
        "tasks cut at multiples of 4 rows (inside the tiles)",
        "modeling_gpn/memory_kernels.py",
        "        block = max(16, (_TASK_BYTES // max(1, seg.cols * size)) // 16 * 16)\n",
        "        block = max(4, (_TASK_BYTES // max(1, seg.cols * size)) // 4 * 4)\n",
        ("tests/fast_path/test_step_kernels.py -k tiles_of_16 and native",),
    ),
    Mutation(
        "gpn bench's generate() timings decoding to the end (the model's end token stops them)",
        "modeling_gpn/bench/timing.py",
        "do_sample=False, eos_token_id=[], pad_token_id=0",
        "do_sample=False, eos_token_id=None, pad_token_id=0",
        ("tests/tools/test_bench.py::test_generate_timings_decode_to_the_end_without_logits_processors",),
    ),
    Mutation(
        "gpn bench's generate() timings without logits processors (min_new_tokens forces the length)",
        "modeling_gpn/bench/timing.py",
        "max_new_tokens=new_tokens, min_new_tokens=None,",
        "max_new_tokens=new_tokens, min_new_tokens=new_tokens,",
        ("tests/tools/test_bench.py::test_generate_timings_decode_to_the_end_without_logits_processors",),
    ),
    Mutation(
        "the one call's fold of its tokens into the cache's fingerprint",
        "modeling_gpn/memory_kernels.py",
        "            hash[2 * b + 1] = (hash[2 * b + 1] * base1 + ids[b]) % modulus;\n",
        "            hash[2 * b + 1] = (hash[2 * b + 1] * base1 + ids[b] + 1) % modulus;\n",
        ("tests/fast_path/test_decode_call.py -k folds_the_tokens",),
    ),
    Mutation(
        "the one call's check of an ids hash's bases and modulus (whose products must fit in int64)",
        "modeling_gpn/memory_kernels.py",
        "            if not residues.is_contiguous() or not fits:\n",
        "            if not residues.is_contiguous():\n",
        ("tests/fast_path/test_decode_call.py::test_an_ids_hash_that_does_not_fit_is_refused",),
    ),
    Mutation(
        "the one call folding the tokens itself (the cache's two torch ops instead)",
        "modeling_gpn/cache.py",
        "        if not self.known or shifted is None or shifted.shape != (rows, 2) or not shifted.is_cpu:\n",
        "        if True:\n",
        ("tests/fast_path/test_decode_call.py -k folds_the_tokens",),
    ),
    Mutation(
        "the one call for token ids that are not contiguous (a column of a prompt)",
        "modeling_gpn/fast_recurrence.py",
        "ids = input_ids.reshape(-1).contiguous()",
        "ids = input_ids.view(-1)",
        ("tests/fast_path/test_decode_call.py::test_the_one_call_folds_the_tokens_into_the_caches_fingerprint[3]",),
    ),
    Mutation(
        "a decoded token's inputs built by the GPN (transformers' generic preparation instead)",
        "modeling_gpn/modeling_gpn.py",
        "            next_sequence_length == 1\n            and not is_first_iteration\n",
        "            next_sequence_length == -1\n            and not is_first_iteration\n",
        ("tests/model/test_generate.py -k transformers_own",),
    ),
    Mutation(
        "the gates' exponential scaled by 2^n in one step (its ends of range overflow or wrap)",
        "modeling_gpn/memory_kernels.py",
        "    return ((fmaf(q, r * r, r) + 1.f) * lo.f) * hi.f;\n",
        "    lo.u = (uint32_t)(ni + 127) << 23;\n    return (fmaf(q, r * r, r) + 1.f) * lo.f;\n",
        ("tests/fast_path/test_step_kernels.py -k gates_are_torchs",),
    ),
    Mutation(
        "the gates' exponential without its clamp (huge arguments wrap the exponent)",
        "modeling_gpn/memory_kernels.py",
        "    const float xc = x < -104.f ? -104.f : x > 89.f ? 89.f : x;",
        "    const float xc = x;",
        ("tests/fast_path/test_step_kernels.py -k gates_are_torchs",),
    ),
    Mutation(
        "weights in the L3 read by whichever thread is free (no thread keeps its share)",
        "modeling_gpn/memory_kernels.py",
        "        #pragma omp for schedule(static)\n        for (i64 t = first; t < end; t++) run_task(",
        "        #pragma omp for schedule(dynamic, 1)  /* MUTATION */\n        for (i64 t = first; t < end; t++) run_task(",
        ("tests/fast_path/test_step_kernels.py -k same_thread_at_every_step",),
    ),
    Mutation(
        "weights in the L3 dealt out every other task (no contiguous run a thread)",
        "modeling_gpn/memory_kernels.py",
        "        #pragma omp for schedule(static)\n        for (i64 t = first; t < end; t++) run_task(",
        "        #pragma omp for schedule(static, 1)  /* MUTATION */\n        for (i64 t = first; t < end; t++) run_task(",
        ("tests/fast_path/test_step_kernels.py -k same_thread_at_every_step",),
    ),
    Mutation(
        "huge pages (weights streamed from DRAM left on 4 KB pages)",
        "modeling_gpn/memory_kernels.py",
        "    if madvise is None or not huge_pages_enabled():\n        return 0\n",
        "    return 0  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k huge_pages and default",),
    ),
    Mutation(
        "huge pages switched off (GPN_HUGE_PAGES=0 ignored)",
        "modeling_gpn/memory_kernels.py",
        '    return not switched_off("GPN_HUGE_PAGES")\n',
        "    return True  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py -k huge_pages and GPN_HUGE_PAGES",),
    ),
    Mutation(
        "generate() (the forward's signature inspected afresh at every token)",
        "modeling_gpn/modeling_gpn.py",
        "GPNForCausalLM.forward.__signature__ = inspect.signature(GPNForCausalLM.forward)\n",
        "pass  # MUTATION\n",
        ("tests/model/test_generate.py -k inspect_the_forward",),
    ),
    Mutation(
        "few-row products (a linear's own hooks and a forward set on its instance not looked for)",
        "modeling_gpn/fast_recurrence.py",
        "    return type(module) is torch.nn.Linear and called_as_is(module) and registered_global_hook() is None",
        "    return type(module) is torch.nn.Linear and registered_global_hook() is None  # MUTATION",
        ("tests/fast_path/test_decode_call.py -k never_skipped and (lm_head or decode_proj or fuse_proj)",),
    ),
    Mutation(
        "prepacking (packing fails and falls back to the plain matmul)",
        "modeling_gpn/recurrence_step.py",
        "        self.matrix = matrix\n        self.packed = ",
        '        raise RuntimeError("MUTATION: no prepacking")\n        self.matrix = matrix\n        self.packed = ',
        ("tests/fast_path/test_fast_path.py::test_prepacked_matrices_match_the_plain_matmul",),
    ),
    Mutation(
        "Triton path (never selected)",
        "modeling_gpn/triton_kernels.py",
        'setting = os.environ.get("GPN_TRITON", "auto")',
        'setting = "0"  # MUTATION',
        (
            "tests/fast_path/test_triton_kernels.py -k (fast_equals_plain_on_the_triton_path and gpn+m- and holes) or padded_training_batch or inference_on_the_triton",
            "tests/fast_path/test_training_graphs.py::test_what_the_sweep_does_not_take_runs_the_fast_path",
            "tests/fast_path/test_training_graphs.py -k training_sweep_equals and gpn+m-None",
        ),
    ),
    Mutation(
        "Triton backward only behind Triton's forward steps (it reads their row-major records)",
        "modeling_gpn/fast_recurrence.py",
        "triton_backward = step == TRITON and triton_usable_backward_steps(s, U)",
        "triton_backward = triton and triton_usable_backward_steps(s, U)  # MUTATION",
        (
            "tests/fast_path/test_triton_kernels.py::test_a_window_the_triton_step_does_not_take_runs_its_backward_on_the_torch_ops",
        ),
    ),
    Mutation(
        "Triton ground reads a strided fuse gate bias made contiguous",
        "modeling_gpn/triton_kernels.py",
        "    if not bias.is_contiguous():  # (the kernel",
        "    if False:  # MUTATION (the kernel",
        ("tests/fast_path/test_triton_kernels.py::test_a_strided_fuse_gate_bias_on_the_triton_path_equals_plain",),
    ),
    Mutation(
        "chunked loss (the loss always from full logits)",
        "modeling_gpn/modeling_gpn.py",
        "if wants_loss and not return_logits:",
        "if False:  # MUTATION",
        (
            "tests/fast_path/test_fast_path.py::test_causal_lm_loss_and_gradients_with_chunked_loss",
            "tests/fast_path/test_kernel_safety.py -k chunked_loss_under_autocast",
        ),
    ),
    Mutation(
        "cache (the state is not carried from one call to the next)",
        "modeling_gpn/modeling_gpn.py",
        "state = cache.get_state() if cache is not None else None",
        "state = None  # MUTATION",
        ("tests/model/test_cache_and_padding.py -k full_equals_token_by_token and (63 or 200)",),
    ),
    Mutation(
        "derived weights re-derived when the parameters change within one cache's life (kept fold reused)",
        "modeling_gpn/derived_weights.py",
        "if key != self.key:",
        "if self.key is None:  # MUTATION",
        ("tests/fast_path/test_edited_weights.py -k changed_between_two_calls_on_one_cache",),
    ),
    Mutation(
        "the read fingerprint follows beam search's reordering (it stays in place)",
        "modeling_gpn/cache.py",
        "        self.fingerprint.select_rows(lambda rows: rows.index_select(0, beam_idx.to(rows.device)))",
        "        pass  # MUTATION",
        ("tests/model/test_generate.py::test_beam_search_reorders_what_each_cache_row_has_read",),
    ),
    Mutation(
        "a continued whole sequence whose mask pads what the cache read as tokens (pads after a row's EOS) is refused by name",
        "modeling_gpn/cache.py",
        "    if prefix_mask is not None and not bool(matches.all()):\n",
        "    if False:  # MUTATION\n",
        (
            "tests/model/test_generate.py::test_a_continued_whole_sequence_whose_mask_pads_what_the_cache_read_is_refused_by_name",
        ),
    ),
    Mutation(
        "hub refusal names the field (the loader's error dropped)",
        "modeling_gpn/hub/checks.py",
        'f"{path} does not load as a GPNConfig: {error}"',
        'f"{path} does not load as a GPNConfig"  # MUTATION',
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "LAMBADA hits scored (the paper's accuracies always 0)",
        "eval/protocols.py",
        '"acc": sum(s.target_is_top1[0] for s in scores) / n,',
        '"acc": 0.0,  # MUTATION',
        ("tests/ecosystem/test_eval.py -k lambada_paper_metrics_match_a_hand",),
    ),
    Mutation(
        "LAMBADA whole-word hits scored (always 0)",
        "eval/protocols.py",
        '"acc_whole_word": sum(all(s.target_is_top1) for s in scores) / n,',
        '"acc_whole_word": 0.0,  # MUTATION',
        ("tests/ecosystem/test_eval.py -k lambada_openai_matches_the_paper",),
    ),
    Mutation(
        "hostile pickles run nothing (the payload runs, then the refusal)",
        "conversion/reference.py",
        "    try:\n        checkpoint = RestrictedUnpickler(",
        "    try:  # MUTATION\n        __import__('pickle').loads(data)\n    except Exception:\n        pass\n"
        "    try:\n        checkpoint = RestrictedUnpickler(",
        (
            "tests/tools/test_faults_io.py -k hostile_pickles and (os-system or eval or inst-opcode)",
            "tests/model/test_config_and_conversion.py::test_foreign_object_in_pickle_is_refused",
        ),
    ),
    Mutation(
        "output layer (the base model ends before the decoder: last_hidden_state is p)",
        "modeling_gpn/modeling_gpn.py",
        "            last_hidden_state=decoded,\n",
        "            last_hidden_state=predicted_states,  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k base_model_ends_with_the_decoder",
            "tests/ecosystem/test_trl.py -k fused_head_log_probs",
        ),
    ),
    Mutation(
        "output layer (get_output_embeddings() finds no head)",
        "modeling_gpn/output_layer.py",
        "        )\n    return head\n",
        "        )\n    return None  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k peft_all_linear or base_model_ends_with_the_decoder",
            "tests/ecosystem/test_trl.py -k (fused_head_log_probs or sft_trainer_trains or dpo or grpo)"
            " and not embedding and not trainable",
            "tests/model/test_packed.py -k trl_sft",
        ),
    ),
    Mutation(
        "output layer (TRL's fused head is shown the wrapped embedding itself, and reads its missing bias)",
        "modeling_gpn/output_layer.py",
        "        return EmbeddingTableHead(\n"
        "            model.embedding_table, embedding, model.config.embedding_size, model.config.vocab_size\n"
        "        )\n",
        "        return embedding  # MUTATION\n",
        (
            "tests/ecosystem/test_trl.py -k (fused_head_log_probs or sft_trainer_trains) and (embedding or trainable)",
            "tests/ecosystem/test_trl.py -k dpo_rewards and embedding",
            "tests/ecosystem/test_trl.py -k grpo_log_probs and embedding",
            "tests/model/test_output_layer.py -k wrapped_embedding_is_followed",
        ),
    ),
    Mutation(
        "output layer (PEFT's all-linear is shown the unnamed view, and stops with StopIteration)",
        "modeling_gpn/output_layer.py",
        "    return asker if asker in (PEFT_ALL_LINEAR, FSDP2_PREPARE) else None\n",
        "    return asker if asker in (FSDP2_PREPARE,) else None  # MUTATION\n",
        ("tests/model/test_output_layer.py -k second_all_linear",),
    ),
    Mutation(
        "output layer (TRL's fused head scores a wrapped embedding with the unadapted table)",
        "modeling_gpn/output_layer.py",
        "            model.embedding_table, embedding,",
        "            lambda: head.weight,  # MUTATION\n            embedding,",
        (  # (not trainable tokens: their tied head's weight is the adapted table; only its bias is missing)
            "tests/ecosystem/test_trl.py -k fused_head_log_probs and embedding",
            "tests/ecosystem/test_trl.py -k dpo_rewards and embedding",
            "tests/ecosystem/test_trl.py -k grpo_log_probs and embedding",
            "tests/model/test_output_layer.py -k wrapped_embedding_is_followed",
        ),
    ),
    Mutation(
        "output layer (the wrapped embedding's table, read by TRL, carries no gradient to the adapter)",
        "modeling_gpn/output_layer.py",
        "            table = self.table()\n",
        "            table = self.table().detach()  # MUTATION\n",
        ("tests/ecosystem/test_trl.py -k fused_head_log_probs and (embedding or trainable)",),
    ),
    Mutation(
        "output layer (PEFT's mixed batch: every row's logits follow the active adapter's table)",
        "modeling_gpn/output_layer.py",
        '            names = keywords["adapter_names"]  # (the last one registered is the one the forward sees)\n'
        "    return names\n",
        '            names = keywords["adapter_names"]\n    return None  # MUTATION\n',
        ("tests/ecosystem/test_ecosystem.py -k peft_lora_trains_saves_reloads_and_merges",),
    ),
    Mutation(
        "output layer (PEFT's mixed batch: a tool reading the output weight gets the active adapter's table)",
        "modeling_gpn/output_layer.py",
        "        if mixed_batch_adapter_names(self.embedding) is not None:\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_ecosystem.py -k peft_lora_trains_saves_reloads_and_merges",),
    ),
    Mutation(
        "output layer (PEFT's mixed batch: the loss reads the active adapter's table for every row)",
        "modeling_gpn/modeling_gpn.py",
        "            if mixed_batch_adapter_names(self.model.embed_tokens) is not None:\n                return None",
        "            if False:  # MUTATION\n                return None",
        ("tests/ecosystem/test_ecosystem.py -k peft_lora_trains_saves_reloads_and_merges",),
    ),
    Mutation(
        "output layer (FSDP2's preparation is shown the table view: head and wrapped embedding in two groups)",
        "modeling_gpn/output_layer.py",
        "    return asker if asker in (PEFT_ALL_LINEAR, FSDP2_PREPARE) else None\n",
        "    return asker if asker in (PEFT_ALL_LINEAR,) else None  # MUTATION\n",
        ("tests/tools/test_peft_fsdp.py", "tests/tools/test_sft_fsdp.py"),
    ),
    Mutation(
        "output layer (FSDP2 shards trainable tokens unrefused: transformers' tie_weights fails on the wrapper)",
        "modeling_gpn/output_layer.py",
        "caller.f_code.co_name) != FSDP2_PREPARE:\n",
        "caller.f_code.co_name) != FSDP2_PREPARE or True:  # MUTATION\n",
        ("tests/tools/test_peft_fsdp.py",),
    ),
    Mutation(
        "output layer (FSDP2 shards trainable tokens unrefused, weights not tied first: fails in fully_shard)",
        "modeling_gpn/output_layer.py",
        "        if asker == FSDP2_PREPARE and carries_token_adapter:\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_peft_fsdp.py",),
    ),
    Mutation(
        "output layer (the table view computes the wrapped embedding's table on every read: three times a TRL call)",
        "modeling_gpn/output_layer.py",
        "        if self._kept is None or self._kept[0] != state:\n",
        "        if True:  # MUTATION\n",
        (
            "tests/ecosystem/test_trl.py -k once_per_step",
            "tests/model/test_output_layer.py -k table_view_keeps",
        ),
    ),
    Mutation(
        "output layer (the table view hands out a kept table whose graph a backward has spent)",
        "modeling_gpn/output_layer.py",
        "                table.register_hook(self._forget)\n",
        "                pass  # MUTATION\n",
        ("tests/model/test_output_layer.py -k table_view_keeps",),
    ),
    Mutation(
        "output layer (the table view keeps its table across an in-place change of the adapter's weights)",
        "modeling_gpn/output_layer.py",
        "    keys = tuple((id(p), p.data_ptr(), version_of(p)) for p in parameters)\n",
        "    keys = tuple((id(p), p.data_ptr()) + (0,) for p in parameters)  # MUTATION\n",
        ("tests/model/test_output_layer.py -k table_view_keeps",),
    ),
    Mutation(
        "output layer (the table view keeps the adapted table under disable_adapter())",
        "modeling_gpn/output_layer.py",
        '            module.__dict__.get("_disable_adapters"),\n',
        "            None,  # MUTATION\n",
        ("tests/model/test_output_layer.py -k table_view_keeps",),
    ),
    Mutation(
        "output layer (the table view keeps a table computed in another grad mode)",
        "modeling_gpn/output_layer.py",
        "    return (torch.is_grad_enabled(), embedding.training, adapters, keys), parameters\n",
        "    return (embedding.training, adapters, keys), parameters  # MUTATION\n",
        ("tests/model/test_output_layer.py -k table_view_keeps",),
    ),
    Mutation(
        "output layer (trainable tokens: TRL's fused head reads the tied head's missing bias)",
        "modeling_gpn/output_layer.py",
        '    return token_adapter is not None and getattr(head_adapter, "tied_adapter", None) is token_adapter\n',
        "    return False  # MUTATION\n",
        ("tests/ecosystem/test_trl.py -k (fused_head_log_probs or sft_trainer_trains) and trainable",),
    ),
    Mutation(
        "output layer (a head holding a table other than the embedding's is saved, and lost in silence)",
        "modeling_gpn/modeling_gpn.py",
        "        self._check_tied()\n        return super().save_pretrained(save_directory, *args, **kwargs)\n",
        "        return super().save_pretrained(save_directory, *args, **kwargs)  # MUTATION\n",
        ("tests/model/test_output_layer.py -k trained_apart_from_the_embedding",),
    ),
    Mutation(
        "output layer (the predicted state p not returned)",
        "modeling_gpn/modeling_gpn.py",
        "            predicted_states=predicted_states if output_predicted_states else None,\n",
        "            predicted_states=None,  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k predicted_state_is_one_argument_away",
            "tests/model/test_reference.py -k logits_states_and_loss_match_reference",
        ),
    ),
    Mutation(
        "output layer (hidden_states hold p, not transformers' convention)",
        "modeling_gpn/modeling_gpn.py",
        "            hidden_states=(embeddings, decoded) if output_hidden_states else None,\n",
        "            hidden_states=(predicted_states,) if output_hidden_states else None,  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k hidden_states_follow",
            "tests/ecosystem/test_transformers_common.py -k test_hidden_states_output",
        ),
    ),
    Mutation(
        "output layer (the output ignores a wrapped embedding)",
        "modeling_gpn/modeling_gpn.py",
        "        return _is_plain_linear(self.lm_head) and not _is_plain_embedding(self.model.embed_tokens)\n",
        "        return False  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k wrapped_embedding_is_followed or chunked_loss_reads_the_head",
            "tests/ecosystem/test_trl.py -k refuses_an_adapter_on_the_tied_output",
            "tests/ecosystem/test_ecosystem.py -k peft_lora_trains_saves_reloads_and_merges",
        ),
    ),
    Mutation(
        "output layer (a stale head is used)",
        "modeling_gpn/modeling_gpn.py",
        "        head, embedding = self.lm_head, self.model.embed_tokens\n        if (\n",
        "        return  # MUTATION\n        head, embedding = self.lm_head, self.model.embed_tokens\n        if (\n",
        ("tests/model/test_output_layer.py -k replaced_without_tying",),
    ),
    Mutation(
        "output layer (the head is not tied: no _tied_weights_keys)",
        "modeling_gpn/modeling_gpn.py",
        '    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}\n',
        "    _tied_weights_keys = None  # MUTATION\n",
        (
            "tests/model/test_output_layer.py -k resize_token_embeddings or base_model_ends_with_the_decoder",
            "tests/ecosystem/test_pipelines_and_loading.py -k sharded_bfloat16_checkpoint",
        ),
    ),
    Mutation(
        "output layer (the chunked loss reads a hooked head's weight)",
        "modeling_gpn/modeling_gpn.py",
        '        if _runs_more_than_its_forward(head) if not _is_fsdp_module(head) else "forward" in head.__dict__:\n',
        "        if False:  # MUTATION\n",
        ("tests/model/test_output_layer.py -k chunked_loss_reads_the_head or forward_set_on_the_heads_instance",),
    ),
    Mutation(
        "output layer (the logits read past a hooked or patched head to its weight)",
        "modeling_gpn/modeling_gpn.py",
        "            and not _runs_more_than_its_forward(head)\n",
        "            and True  # MUTATION\n",
        ("tests/model/test_output_layer.py -k forward_set_on_the_heads_instance",),
    ),
    Mutation(
        "output layer (the chunked prefill's loss reads lm_head's weight, whatever wraps it)",
        "modeling_gpn/prefill.py",
        "        output_matrix = model.output_matrix()  # None: only calling the (wrapped) head gives the logits\n",
        "        output_matrix = model.lm_head.weight  # MUTATION\n",
        ("tests/model/test_output_layer.py -k chunked_loss_reads_the_head",),
    ),
    Mutation(
        "older layout (gpn push refuses the top-level decoder keys)",
        "modeling_gpn/hub/checks.py",
        'name_in_model = f"model.{name}" if name not in expected and f"model.{name}" in expected else name',
        "name_in_model = name  # MUTATION",
        ("tests/model/test_output_layer.py -k older_layout",),
    ),
    Mutation(
        "sequence classification (scored at the first token, not each row's last real one)",
        "modeling_gpn/modeling_gpn.py",
        "        return torch.where(last < 0, seq_len - 1, last)\n",
        "        return torch.zeros_like(last)  # MUTATION\n",
        (
            "tests/ecosystem/test_trl.py -k reward_trainer or sequence_classification",
            "tests/model/test_output_layer.py -k sequence_classification_scores",
            "tests/ecosystem/test_pipelines_and_loading.py -k text_classification_pipeline",
        ),
    ),
    Mutation(
        "sequence classification (TRL's reward margin refused: RewardTrainer with a `margin` column fails)",
        "modeling_gpn/modeling_gpn.py",
        '        kwargs.pop("margin", None)\n',
        "",
        ("tests/ecosystem/test_trl.py -k reward_trainer",),
    ),
    Mutation(
        "sequence classification (the attention mask ignored: a trailing EOS = pad read as padding)",
        "modeling_gpn/modeling_gpn.py",
        "        if attention_mask is not None:\n            real = attention_mask[:, -seq_len:].bool()\n        elif",
        "        if False:  # MUTATION\n            real = attention_mask[:, -seq_len:].bool()\n        elif",
        (
            "tests/ecosystem/test_trl.py -k reward_trainer",
            "tests/model/test_output_layer.py -k sequence_classification_scores",
        ),
    ),
    Mutation(
        "packed SFT (the state not reset where a packed sequence starts)",
        "modeling_gpn/modeling_gpn.py",
        "        sequence_starts = (\n            packed_sequence_starts(\n",
        "        sequence_starts = None and (  # MUTATION\n            packed_sequence_starts(\n",
        ("tests/model/test_packed.py -k trl_sft",),
    ),
    Mutation(
        "padded training batches (the plain loop writes the memory on padded positions)",
        "modeling_gpn/modeling_gpn.py",
        "                    memory = torch.where(real[:, None, None, None], new_memory, memory)\n",
        "                    memory = new_memory  # MUTATION\n",
        ("tests/model/test_cache_and_padding.py -k padded_training_batch and plain",),
    ),
    Mutation(
        "padded training batches (the fast path's steps read no mask)",
        "modeling_gpn/fast_recurrence.py",
        "mask[:, t] if t in masked_steps else None",
        "None if 'MUTATION' else None",
        (
            "tests/model/test_cache_and_padding.py -k padded_training_batch and fast",
            "tests/ecosystem/test_trl.py -k grpo_log_probs_of_padded_rows",
        ),
    ),
    Mutation(
        "sequence classification of packed rows (scored as their last sequence, not refused)",
        "modeling_gpn/packing.py",
        "    if not packing or is_tracing():\n        return\n    starts = packed_sequence_starts(",
        "    if True:  # MUTATION\n        return\n    starts = packed_sequence_starts(",
        ("tests/model/test_packed.py -k sequence_classification_refuses",),
    ),
    Mutation(
        "FSDP checkpoint (the tied embedding stored under both names)",
        "modeling_gpn/train/checkpoints.py",
        "    drop_tied_copies(weights, accelerator.unwrap_model(model))\n",
        "    pass  # MUTATION\n",
        ("tests/tools/test_train.py -k two_process_fsdp",),
    ),
    Mutation(
        "converted folder loadable (a weight left out of the saved folder)",
        "conversion/reference.py",
        "        model.save_pretrained(out)\n",
        "        model.save_pretrained(out, state_dict={k: v for k, v in model.state_dict().items() if 'A_log' not in k})  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py::test_gpn_convert_command_writes_a_loadable_folder",),
    ),
    Mutation(
        "no positional limit (the training window exposed as max_position_embeddings, which generate() caps by)",
        "modeling_gpn/configuration_gpn.py",
        '"n_positions": "max_length_hint"}',
        '"n_positions": "max_length_hint", "max_position_embeddings": "max_length_hint"}  # MUTATION',
        (
            "tests/model/test_generate.py::test_generate_goes_past_the_training_window_at_its_default_length",
            "tests/model/test_config_and_conversion.py::test_the_training_window_is_lm_evals_context_length_and_no_positional_limit",
        ),
    ),
    Mutation(
        "cache kinds refused (offloaded, quantized, sliding-window and a kind beside a cache ignored in silence)",
        "modeling_gpn/generation.py",
        "    requested = generation_config.cache_implementation\n",
        "    requested = None  # MUTATION\n",
        (
            "tests/model/test_generate.py::test_other_cache_kinds_are_refused_not_ignored",
            "tests/model/test_generate.py::test_a_cache_kind_beside_a_cache_is_refused",
        ),
    ),
    Mutation(
        "continuous batching refused (transformers' scheduler left to fail on the config)",
        "modeling_gpn/modeling_gpn.py",
        "    def init_continuous_batching(self, *args, **kwargs) -> NoReturn:\n",
        "    def _init_continuous_batching_unused(self, *args, **kwargs) -> NoReturn:  # MUTATION\n",
        ("tests/model/test_generate.py::test_continuous_batching_is_refused_clearly",),
    ),
    Mutation(
        "DoLa and contrastive search refused by name (left to transformers' trust_remote_code call and the Hub's code)",
        "modeling_gpn/modeling_gpn.py",
        "        refuse_hub_decoding_a_state_cannot_run(generation_mode)\n",
        "        pass  # MUTATION\n",
        ("tests/model/test_generate.py::test_hub_decoding_methods_a_gpn_cannot_run_are_refused_by_name",),
    ),
    Mutation(
        "synced_gpus: a finished process's idle forwards advance the cache kept (not a throwaway copy)",
        "modeling_gpn/modeling_gpn.py",
        "            peer.finished = bool(this_peer_finished) and unfinished\n",
        "            peer.finished = False  # MUTATION\n",
        ("tests/model/test_generate.py -k synced_gpus",),
    ),
    Mutation(
        "synced_gpus: generate() returns the idle forwards' throwaway copy, not the cache kept",
        "modeling_gpn/generation.py",
        '            result["cache"] = self.kept\n',
        "            pass  # MUTATION\n",
        ("tests/model/test_generate.py -k synced_gpus",),
    ),
    Mutation(
        "an offline custom_generate said to be missing from the cache (transformers: the repo has no such method)",
        "modeling_gpn/modeling_gpn.py",
        "            if offline is None:\n",
        "            if True:  # MUTATION\n",
        ("tests/model/test_generate.py::test_hub_decoding_methods_a_gpn_cannot_run_are_refused_by_name",),
    ),
    Mutation(
        "PEFT prompt-learning generate refused (its virtual tokens re-inserted at every decoded token, in silence)",
        "modeling_gpn/modeling_gpn.py",
        "        refuse_peft_prompt_learning_generate(self)\n",
        "        pass  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::test_peft_prompt_tuning_trains_the_virtual_tokens_and_generates_from_their_embeddings",
        ),
    ),
    Mutation(
        "a cache other than a GPNCache refused (PEFT prefix tuning's keys and values read as a state)",
        "modeling_gpn/modeling_gpn.py",
        "        check_cache_type(cache)\n",
        "        pass  # MUTATION\n",
        ("tests/ecosystem/test_ecosystem.py::test_peft_prefix_tuning_is_refused_by_name",),
    ),
    Mutation(
        "attention outputs asked for refused (answered with attentions=None, in silence)",
        "modeling_gpn/arguments.py",
        "    if output_attentions if output_attentions is not None else config_default:\n",
        "    if False:  # MUTATION\n",
        (
            "tests/model/test_roundtrip_and_errors.py::test_attention_outputs_asked_for_are_refused_not_returned_as_none",
            "tests/fast_path/test_decode_call.py::test_attention_outputs_asked_for_a_decoded_token_are_refused",
        ),
    ),
    Mutation(
        "a model's copy or pickle leaves the fast path's derived weights behind (C plans' pointers fail to pickle)",
        "modeling_gpn/modeling_gpn.py",
        "            del state[name]\n",
        "            pass  # MUTATION\n",
        ("tests/fast_path/test_decode_call.py::test_a_model_copied_or_pickled_after_decoding_derives_its_own",),
    ),
    Mutation(
        "a cache pickles without its model's weak reference",
        "modeling_gpn/cache.py",
        '        state.pop("_gpn_model_ref", None)\n',
        "        pass  # MUTATION\n",
        ("tests/model/test_state.py::test_a_pickled_or_copied_cache_continues_as_the_original",),
    ),
    Mutation(
        "a cache's deep copy keeps its model (it saves as the original does)",
        "modeling_gpn/cache.py",
        "                setattr(copied, name, self.__dict__[name])\n",
        "                pass  # MUTATION\n",
        ("tests/model/test_state.py::test_a_pickled_or_copied_cache_continues_as_the_original",),
    ),
    Mutation(
        "text continuing a state is tokenized as the middle of a text (no SentencePiece word start in front)",
        "modeling_gpn/data/tokenizer.py",
        "            ids = marked[1:] if marked[:1] == [marker[1]] else None\n",
        "            ids = None  # MUTATION\n",
        ("tests/model/test_state.py -k three_turns_read_the_ids_of_one_text",),
    ),
    Mutation(
        "a cache's rows selected by a 0-dim index stay a batch of one row",
        "modeling_gpn/cache.py",
        "        indices = torch.as_tensor(indices).reshape(-1)  # (a 0-dim index: one row, kept as a batch of one)\n",
        "        pass  # MUTATION\n",
        ("tests/model/test_state.py::test_one_row_of_a_saved_batch_continues_as_its_uninterrupted_run",),
    ),
    Mutation(
        "a folder without a tokenizer named as such (transformers' message asks for sentencepiece)",
        "modeling_gpn/data/tokenizer.py",
        "    if folder.is_dir() and not any(",
        "    if False and not any(  # MUTATION\n",
        (
            "tests/tools/test_faults_io.py::test_generate_bad_arguments_are_one_clear_line[model-without-tokenizer]",
            "tests/ecosystem/test_eval.py::test_clear_errors",
        ),
    ),
    Mutation(
        "gpn bench reads every preset before measuring (a misspelt one or a bad config file: a traceback minutes later)",
        "modeling_gpn/bench/command.py",
        "            config = load_preset(preset)\n",
        '            config = load_preset("tiny")  # MUTATION\n',
        (
            "tests/tools/test_bench.py::test_an_unknown_preset_is_refused_before_anything_is_measured",
            "tests/tools/test_bench.py::test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured",
        ),
    ),
    Mutation(
        "gpn study refuses a model name it does not have (--only skipped it in silence)",
        "modeling_gpn/study/runs.py",
        "    if unknown:\n",
        "    if False:  # MUTATION\n",
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[unknown-model]",
        ),
    ),
    Mutation(
        "gpn study --dataset ignored (the study's own corpus trained on)",
        "modeling_gpn/study/cli.py",
        '        overrides["dataset"] = args.dataset\n',
        "        pass  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study --steps 0 ignored in silence (the study's own steps ran)",
        "modeling_gpn/study/cli.py",
        "if args.steps is not None else {}",
        "if args.steps else {}  # MUTATION",
        ("tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[zero-steps]",),
    ),
    Mutation(
        "gpn study checks each model's training settings only when it trains (after the models before it)",
        "modeling_gpn/study/runs.py",
        '        config = training_config(name, study["models"][name], study, output)\n'
        "        check_held_out_windows(study, config)\n"
        "        records[name] = earlier_record(name, config, output)\n",
        "        records[name] = None  # MUTATION\n",
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[negative-steps]",
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[bad-recipe]",
        ),
    ),
    Mutation(
        "gpn study's invalid training settings as a traceback",
        "modeling_gpn/study/runs.py",
        '    except ValueError as error:\n        raise StudyError(f"model {name}',
        '    except NotImplementedError as error:  # MUTATION\n        raise StudyError(f"model {name}',
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[negative-steps]",
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[bad-recipe]",
        ),
    ),
    Mutation(
        "gpn study's data errors (a missing corpus, the Hub offline) as a traceback",
        "modeling_gpn/study/cli.py",
        "    except (DataError, *RUN_ERRORS, FileExistsError) as error:\n",
        "    except (NotImplementedError, *RUN_ERRORS, FileExistsError) as error:  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_corpus_that_cannot_be_read_is_one_line_not_a_traceback",),
    ),
    Mutation(
        "gpn study's held-out corpus copy written in place (a copy cut short is reused in silence)",
        "modeling_gpn/study/runs.py",
        '            with replacing(path, "w") as handle:',
        '            with path.open("w") as handle:  # MUTATION',
        ("tests/tools/test_study.py::test_a_corpus_copy_interrupted_while_written_is_not_left_for_the_next_run",),
    ),
    Mutation(
        "gpn study scores the last windows of the whole corpus as its held-out ones (the recipe's max_tokens ignored)",
        "modeling_gpn/study/runs.py",
        '        settings.fineweb_max_tokens, settings.cache_dir = trained["max_tokens"], trained["cache_dir"]\n',
        '        settings.cache_dir = trained["cache_dir"]  # MUTATION\n',
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study scores its held-out windows from a corpus read again, not the token stream its training read",
        "modeling_gpn/study/runs.py",
        '    if token_cache is not None and "fineweb_paper" in settings.tasks:\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_study.py::test_toy_study_end_to_end",),
    ),
    Mutation(
        "gpn push's card puts a FineWeb figure of other text beside the paper's with nothing said",
        "modeling_gpn/hub/model_card.py",
        '    if "fineweb_paper" in evaluation.tasks and fineweb_data and "fineweb" not in fineweb_data.lower():\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_card_says_a_fineweb_figure_of_other_text_is_not_fineweb",),
    ),
    Mutation(
        "gpn eval --fineweb-token-cache takes a folder that is no token cache (the model loaded first)",
        "eval/runner.py",
        '        if not (Path(settings.fineweb_token_cache) / "meta.json").is_file():\n',
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "gpn eval --fineweb-token-cache reads a stream of another tokenizer",
        "eval/runner.py",
        '    if stream.meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):\n',
        "    if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "gpn eval replaces an earlier run's results in its --output-dir in silence",
        "eval/cli.py",
        "        if not args.overwrite:\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_gpn_eval_command_writes_results_and_side_by_side_report",),
    ),
    Mutation(
        "gpn eval's report writes the paper's published rows to fixed decimals (263.6 as 263.60)",
        "eval/report.py",
        "        cells = [_fmt(row.get(key), PUBLISHED_PATTERNS[key]) for key, _, _ in COLUMNS]\n",
        "        cells = [_fmt(row.get(key), pattern) for key, _, pattern in COLUMNS]  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_gpn_eval_command_writes_results_and_side_by_side_report",),
    ),
    Mutation(
        "gpn eval's report does not say which way each column of Table 1 is better",
        "eval/report.py",
        '    return "↑" if metrics[column]["higher_is_better"] else "↓"\n',
        '    return ""  # MUTATION\n',
        ("tests/ecosystem/test_eval.py::test_gpn_eval_command_writes_results_and_side_by_side_report",),
    ),
    Mutation(
        "gpn eval's lambada_paper left-truncates contexts to --max-length with nothing said",
        "eval/protocols.py",
        "    return sum(len(example.context_ids) + len(example.target_ids) - 1 > max_length for example in examples)\n",
        "    return 0  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_gpn_eval_command_writes_results_and_side_by_side_report",),
    ),
    Mutation(
        "gpn push's card puts LAMBADA figures of truncated contexts beside the paper's with nothing said",
        "modeling_gpn/hub/model_card.py",
        "    if is_number(truncated) and truncated:  # (a context longer than the model's window, left-truncated as lm-eval's)\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_card_says_lambada_contexts_were_truncated",),
    ),
    Mutation(
        "gpn eval --fineweb-token-cache ignores an option that cuts documents in silence",
        "eval/runner.py",
        "        if any(ignored.values()):\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "gpn study reuses the figures of a model evaluated on the old held-out windows",
        "modeling_gpn/study/runs.py",
        """"data_dir": data_dir, "held_out": "gpn train's split", """,
        '"data_dir": data_dir, ',  # MUTATION
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study evaluates held-out windows cut otherwise than its training cut them",
        "modeling_gpn/study/runs.py",
        "        check_held_out_windows(study, config)\n",
        "",
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[held-out-window]",
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[held-out-fraction]",
        ),
    ),
    Mutation(
        "gpn study scores the held-out windows of another column than its recipe's text_field (eval.text_field taken)",
        "modeling_gpn/study/runs.py",
        '        pairs.insert(0, ("text_field", "text_field"))',
        "        pass  # MUTATION",
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[held-out-text-field]",
        ),
    ),
    Mutation(
        "gpn study lets each model read LAMBADA through its own max length (the Gated DeltaNet's 32,768 tokens)",
        "modeling_gpn/study/runs.py",
        '        settings.max_length = trained["seq_len"]\n',
        "        pass  # MUTATION\n",
        ("tests/tools/test_study.py::test_toy_study_end_to_end",),
    ),
    Mutation(
        "gpn study reuses the LAMBADA figures of a model evaluated through its own max length",
        "modeling_gpn/study/runs.py",
        """"held_out": "gpn train's split", "max_length": "seq_len"}""",
        """"held_out": "gpn train's split"}  # MUTATION""",
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study's evaluation errors (the Hub offline, data without its column) as a traceback after training",
        "modeling_gpn/study/runs.py",
        "        except (OSError, ValueError, KeyError) as error:\n            raise EvaluationError(",
        "        except NotImplementedError as error:  # MUTATION\n            raise EvaluationError(",
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study's report says every position of a held-out window is scored (a baseline's first is not)",
        "modeling_gpn/study/report.py",
        'f"from the zero state; {first_position(results)}). LAMBADA',
        "\"from the zero state, every position scored; a GPN's first position from the empty state). LAMBADA",
        ("tests/tools/test_study.py::test_toy_study_end_to_end",),
    ),
    Mutation(
        "gpn study's report calls --data-dir's FineWeb files FineWeb-Edu from the Hub",
        "modeling_gpn/study/runs.py",
        'return "FineWeb-Edu from the Hub" if source is None else f"the documents of {source}"',
        'return "FineWeb-Edu from the Hub"  # MUTATION',
        ("tests/tools/test_study.py::test_the_report_names_the_held_out_data_the_evaluation_read",),
    ),
    Mutation(
        "gpn eval tokenizes a training corpus again for its held-out windows (gpn train's token cache not read)",
        "eval/runner.py",
        "            elif settings.fineweb_held_out_fraction is not None and (corpus := training_corpus(source, settings)):\n",
        "            elif False:  # MUTATION\n",
        (
            "tests/ecosystem/test_eval.py::test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus",
            "tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",
        ),
    ),
    Mutation(
        "gpn eval joins the held-out stream's documents otherwise than gpn train (--fineweb-separator taken)",
        "eval/runner.py",
        '    if fraction is not None and settings.fineweb_separator != "eos":\n',
        "    if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "gpn study run again trains a finished model again (refused: its folder holds a finished run)",
        "modeling_gpn/study/runs.py",
        '        if record.get("evaluation") == evaluation:',
        "        if False:  # MUTATION",
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study run again starts the stopped model afresh (refused: its folder holds checkpoints)",
        "modeling_gpn/study/runs.py",
        "            resume = latest_checkpoint(output / name) is not None",
        "            resume = False  # MUTATION",
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study run again with other settings reuses models trained with the earlier ones",
        "modeling_gpn/study/runs.py",
        "    if changed:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study stopped points to gpn train's --resume, an option it does not have",
        "modeling_gpn/study/cli.py",
        'f"is saved in {stop.checkpoint}. {CONTINUE.format(output=args.output)}",',
        'f"is saved in {stop.checkpoint}; continue with the same command plus --resume",  # MUTATION',
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study's report gives this run's wall time as the whole study's (models reused from earlier runs)",
        "modeling_gpn/study/report.py",
        "    if not reused:\n",
        "    if True:  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study's report calls gpn train's validation PPL a second 'held-out PPL' (other figures, same name)",
        "modeling_gpn/study/report.py",
        "| gpn train's validation PPL |",
        "| held-out PPL |",
        ("tests/tools/test_study.py::test_a_stopped_study_continues_where_it_stopped",),
    ),
    Mutation(
        "gpn study --only X rewrites the report with X alone (the other models finished in its folder dropped)",
        "modeling_gpn/study/runs.py",
        "    runs.update(finished)\n",
        "    pass  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder",),
    ),
    Mutation(
        "gpn study's study_results.json written in place (a write cut short leaves half a file)",
        "modeling_gpn/study/runs.py",
        '    write_file_atomically(output / "study_results.json", json.dumps(results, indent=2, default=str))\n',
        '    (output / "study_results.json").write_text(json.dumps(results, indent=2, default=str))  # MUTATION\n',
        ("tests/tools/test_study.py::test_a_report_write_cut_short_leaves_the_previous_one_whole[study_results.json]",),
    ),
    Mutation(
        "gpn study's study_report.md written in place (a write cut short leaves half a file)",
        "modeling_gpn/study/runs.py",
        '    write_file_atomically(output / "study_report.md", render_report(results))\n',
        '    (output / "study_report.md").write_text(render_report(results))  # MUTATION\n',
        ("tests/tools/test_study.py::test_a_report_write_cut_short_leaves_the_previous_one_whole[study_report.md]",),
    ),
    Mutation(
        "gpn study resumed with a changed corpus as gpn train's ValueError traceback",
        "modeling_gpn/study/cli.py",
        "    except ResumeMismatchError as error:",
        "    except ZeroDivisionError as error:  # MUTATION",
        ("tests/tools/test_study.py::test_a_stopped_model_whose_corpus_changed_is_one_line_not_a_traceback",),
    ),
    Mutation(
        "lm-eval's git lookup prints git's 'fatal: not a git repository' outside a checkout",
        "eval/runner.py",
        '        mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", quiet_git_commit_hash),\n',
        "        contextlib.nullcontext(),  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_outside_a_git_checkout_no_git_error_is_printed",),
    ),
    Mutation(
        "gpn bench --preset tiny tiny measures tiny twice (its rows and ratios printed twice)",
        "modeling_gpn/bench/command.py",
        "    if repeated:  # (it was measured twice, its rows and ratios printed twice)\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_bench.py::test_bad_arguments_are_refused_before_any_model_is_built[repeated-preset]",),
    ),
    Mutation(
        "gpn bench's refusals as a bare message with exit status 1 (not argparse's 'gpn bench: error:', 2)",
        "modeling_gpn/bench/command.py",
        '        print(f"gpn bench: error: {error}", file=sys.stderr)\n        return 2\n',
        "        raise SystemExit(str(error)) from None  # MUTATION\n",
        (
            "tests/tools/test_bench.py::test_an_unknown_preset_is_refused_before_anything_is_measured",
            "tests/tools/test_bench.py::test_bad_arguments_are_refused_before_any_model_is_built[zero-repeats]",
        ),
    ),
    Mutation(
        "int16 / uint8 token ids fail inside torch's embedding (not named with the fix, .long())",
        "modeling_gpn/arguments.py",
        "    if input_ids.dtype not in EMBEDDING_ID_DTYPES:  # (int16 / uint8 ids failed inside torch's embedding)\n",
        "    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py -k ids_of_a_dtype_the_embedding_refuses",),
    ),
    Mutation(
        "labels outside the vocabulary (not -100) fail inside torch's cross-entropy (a device-side assert on a GPU)",
        "modeling_gpn/arguments.py",
        "    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != -100)\n",
        "    bad = labels < -100  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_labels_outside_the_vocabulary_or_not_int64_are_named",),
    ),
    Mutation(
        "logits_to_keep as a tensor of positions read as a count (the last that many positions)",
        "modeling_gpn/arguments.py",
        "            )\n        return logits_to_keep\n",
        "            )\n        return slice(-len(logits_to_keep), None)  # MUTATION\n",
        ("tests/model/test_packed.py::test_a_long_packed_prompt_is_not_cut_into_prefill_chunks",),
    ),
    Mutation(
        "a negative logits_to_keep keeps all but the first positions (not refused)",
        "modeling_gpn/arguments.py",
        "    if not isinstance(logits_to_keep, int) or logits_to_keep < 0:\n",
        "    if not isinstance(logits_to_keep, int):  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_logits_to_keep_that_names_no_positions_is_refused",),
    ),
    Mutation(
        "input_ids that are not a tensor (a list, an array) fail on a missing attribute, not named",
        "modeling_gpn/arguments.py",
        "    if not isinstance(input_ids, torch.Tensor):  # (a list or an array failed on a missing attribute)\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_input_ids_that_are_not_a_tensor_are_named",),
    ),
    Mutation(
        "the one-call decode takes input_ids that are not a tensor (an array from a cache fails on .dim)",
        "modeling_gpn/modeling_gpn.py",
        "        if asks_only_logits and isinstance(input_ids, torch.Tensor) and not is_tracing():\n",
        "        if asks_only_logits and input_ids is not None and not is_tracing():  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_input_ids_that_are_not_a_tensor_are_named",),
    ),
    Mutation(
        "prefill chunking reads the length of input_ids that are not a tensor (a list fails on .dim)",
        "modeling_gpn/prefill.py",
        "    if isinstance(input_ids, torch.Tensor) and inputs_embeds is None and input_ids.dim() == 2:\n",
        "    if input_ids is not None and inputs_embeds is None and input_ids.dim() == 2:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_input_ids_that_are_not_a_tensor_are_named",),
    ),
    Mutation(
        "a negative logits_to_keep on a decoded token taken by the one-call decode (its logits returned, not refused)",
        "modeling_gpn/modeling_gpn.py",
        "            and isinstance(logits_to_keep, int)\n            and logits_to_keep >= 0\n",
        "            and isinstance(logits_to_keep, int)  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_logits_to_keep_that_names_no_positions_is_refused",),
    ),
    Mutation(
        "a 0-d logits_to_keep tensor taken (an index where a count may have been meant)",
        "modeling_gpn/arguments.py",
        "        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in EMBEDDING_ID_DTYPES:\n",
        "        if logits_to_keep.dtype not in EMBEDDING_ID_DTYPES:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_logits_to_keep_that_names_no_positions_is_refused",),
    ),
    Mutation(
        "a logits_to_keep position past the end fails inside the indexing (a device-side assert on a GPU)",
        "modeling_gpn/arguments.py",
        "        if not is_tracing() and bool(((logits_to_keep < -seq_len) | (logits_to_keep >= seq_len)).any()):\n",
        "        if False:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_logits_to_keep_that_names_no_positions_is_refused",),
    ),
    Mutation(
        "float labels fail inside torch's cross-entropy by dtype (not named)",
        "modeling_gpn/arguments.py",
        "    if labels.dtype != torch.int64:\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_labels_outside_the_vocabulary_or_not_int64_are_named",),
    ),
    Mutation(
        "a cache another model filled fails inside a matrix product (the forward does not compare its shapes)",
        "modeling_gpn/arguments.py",
        "        if tuple(tensor.shape) != expected:\n",
        "        if False:  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_a_cache_another_model_filled_is_refused_naming_the_shapes",),
    ),
    Mutation(
        "int32 token ids refused, though torch's embedding takes them",
        "modeling_gpn/arguments.py",
        "EMBEDDING_ID_DTYPES = (torch.int64, torch.int32)\n",
        "EMBEDDING_ID_DTYPES = (torch.int64,)  # MUTATION\n",
        ("tests/model/test_roundtrip_and_errors.py::test_int32_ids_are_taken_as_int64_ones",),
    ),
    Mutation(
        "gpn study finds a misspelt --data-dir only once the first model has trained (a traceback)",
        "modeling_gpn/study/runs.py",
        "            data_source(task, settings)\n",
        "            pass  # MUTATION\n",
        (
            "tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written"
            "[misspelt-data-dir]",
        ),
    ),
    Mutation(
        "gpn inspect's bad arguments as one line (a traceback)",
        "modeling_gpn/inspect/cli.py",
        "    except (OSError, ValueError) as error:",
        "    except NotImplementedError as error:  # MUTATION",
        ("tests/tools/test_inspect.py::test_gpn_inspect_rejects_bad_input",),
    ),
    Mutation(
        "gpn study's errors as one line (a traceback)",
        "modeling_gpn/study/cli.py",
        "    except StudyError as error:",
        "    except NotImplementedError as error:  # MUTATION",
        ("tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written",),
    ),
    Mutation(
        "gpn CMD --help without '(default: None)' after options that have no default",
        "modeling_gpn/cli/formatting.py",
        "        if action.default is None or action.default == [] or (action.option_strings and action.nargs == 0):",
        "        if action.default == [] or (action.option_strings and action.nargs == 0):  # MUTATION",
        (
            "tests/tools/test_docs.py::test_help_gives_each_option_its_default_once",
            "tests/tools/test_docs.py::test_the_training_programs_own_help_gives_each_default_once",
        ),
    ),
    Mutation(
        "python -m modeling_gpn.train --help with the gpn command's formatter",
        "modeling_gpn/train/cli.py",
        "formatter_class=HelpFormatter)",
        "formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # MUTATION",
        ("tests/tools/test_docs.py::test_the_training_programs_own_help_gives_each_default_once",),
    ),
    Mutation(
        "GPN listed among transformers' causal LMs (the Trainer's label smoothing shifts the labels)",
        "modeling_gpn/modeling_gpn.py",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(GPNConfig.model_type, GPNForCausalLM.__name__)",
        "pass  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_trainer_label_smoothing_targets_the_next_token",
            "tests/ecosystem/test_ecosystem.py::test_saved_folder_loads_every_auto_class_through_remote_code_without_the_package",
        ),
    ),
    Mutation(
        "the tied head left out of what is saved (a resumed Trainer re-ties it without a warning)",
        "modeling_gpn/modeling_gpn.py",
        '    _keys_to_ignore_on_save = ["lm_head.weight"]',
        "    pass  # MUTATION",
        ("tests/ecosystem/test_ecosystem.py::test_trainer_resumes_without_warning_of_the_tied_head",),
    ),
    Mutation(
        "a state's model known by its model type (the Hub's remote code has its own GPNConfig class)",
        "modeling_gpn/state_file.py",
        '        if model_type == GPNConfig.model_type and hasattr(base, "zero_state"):',
        '        if isinstance(getattr(base, "config", None), GPNConfig) and hasattr(base, "zero_state"):  # MUTATION',
        ("tests/model/test_roundtrip_and_errors.py::test_trust_remote_code_in_a_fresh_process_without_the_package",),
    ),
    Mutation(
        "the state file's weights fingerprint hashes the matrices, not only the vectors",
        "modeling_gpn/state_file.py",
        "for name, parameter in model.named_parameters() for part in stored_tensors(name, parameter.detach())]",
        "for name, parameter in model.named_parameters() if parameter.dim() == 1 for part in stored_tensors(name, parameter.detach())]  # MUTATION",
        ("tests/model/test_state.py::test_a_state_of_another_model_is_refused",),
    ),
    Mutation(
        "the weights fingerprint recomputed after an edit of a parameter (in place or through .data)",
        "modeling_gpn/state_file.py",
        "    if cached is None or cached[0] != glance.digest():",
        "    if cached is None:  # MUTATION",
        ("tests/model/test_state.py::test_a_state_of_another_model_is_refused",),
    ),
    Mutation(
        "a state is loaded for a PEFT model (a GPNModel found through the wrappers' base_model)",
        "modeling_gpn/state_file.py",
        "    for _ in range(MAX_WRAPPERS):",
        "    for _ in range(2):  # MUTATION",
        ("tests/ecosystem/test_ecosystem.py -k peft_models_state",),
    ),
    Mutation(
        "the weights fingerprint covers PEFT's adapter settings (active adapter, disabled)",
        "modeling_gpn/state_file.py",
        "    if not adapters:  # a model without adapters: the hash of its weights alone, as format version 2 has it",
        "    if True:  # MUTATION",
        ("tests/ecosystem/test_ecosystem.py -k peft_models_state",),
    ),
    Mutation(
        "a state file is read only from a regular file (a FIFO blocked, /dev/zero filled the memory)",
        "modeling_gpn/state_file.py",
        "        if not stat.S_ISREG(status.st_mode):",
        "        if False:  # MUTATION",
        ("tests/model/test_state.py -k pipe_is_refused",),
    ),
    Mutation(
        "gpn push: an unreachable Hub (huggingface_hub's HTTP client's errors) is one line, not a traceback",
        "modeling_gpn/hub/errors.py",
        '    return (HfHubHTTPError, OfflineModeIsEnabled, OSError, *(c.HTTPError for c in clients if hasattr(c, "HTTPError")))',
        "    return (HfHubHTTPError, OfflineModeIsEnabled, OSError)  # MUTATION",
        ("tests/tools/test_hub.py -k unreachable_hub",),
    ),
    Mutation(
        "gpn convert --push-to-hub: an unreachable Hub is one line, not a traceback",
        "conversion/cli.py",
        "            if not isinstance(error, (HubPushError, CardError, *unreachable_hub_errors())):",
        "            if not isinstance(error, (HubPushError, CardError)):  # MUTATION",
        ("tests/tools/test_hub.py -k unreachable_hub and convert",),
    ),
    Mutation(
        "gpn push refuses `from . import module` in the remote code (transformers' loader never ships that module)",
        "modeling_gpn/hub/checks.py",
        "    if module is None:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py -k loader_cannot_follow",),
    ),
    Mutation(
        "gpn push lets the remote code import huggingface_hub (transformers' own dependency; generate() asks it "
        "whether the Hub is offline): refused, every push failed",
        "modeling_gpn/hub/checks.py",
        '"safetensors", "huggingface_hub", "__future__"}',
        '"safetensors", "__future__"}  # MUTATION',
        ("tests/tools/test_hub.py::test_dry_run_folder_holds_exactly_what_the_hub_needs",),
    ),
    Mutation(
        "gpn push over an earlier push removes the repo's weights and tokenizer files it does not replace",
        "modeling_gpn/hub/push.py",
        "        delete_patterns=list(REPLACED_FILES),\n",
        "        delete_patterns=None,  # MUTATION\n",
        ("tests/tools/test_hub.py::test_upload_gets_the_right_arguments_and_the_dry_run_files",),
    ),
    Mutation(
        "gpn push keeps the base_model of the card a Trainer or TRL wrote beside a fine-tune",
        "modeling_gpn/hub/folder.py",
        "    base_model = check_base_model(base_model) if base_model else card_base_model(model_dir)\n",
        "    base_model = check_base_model(base_model) if base_model else None  # MUTATION\n",
        ("tests/tools/test_hub.py::test_a_fine_tunes_folder_keeps_its_base_model_and_gets_every_auto_class",),
    ),
    Mutation(
        "gpn push's auto_map names AutoModelForSequenceClassification whatever the folder's config named",
        "modeling_gpn/hub/folder.py",
        '            ("AutoModelForSequenceClassification", GPNForSequenceClassification),\n',
        "",
        ("tests/tools/test_hub.py::test_a_fine_tunes_folder_keeps_its_base_model_and_gets_every_auto_class",),
    ),
    Mutation(
        "gpn push refuses a --base-model that is no Hub repo id (a dead link on the Hub)",
        "modeling_gpn/hub/folder.py",
        "        validate_repo_id(base_model)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_hub.py::test_a_fine_tunes_folder_keeps_its_base_model_and_gets_every_auto_class",),
    ),
    Mutation(
        "gpn convert records the checkpoint it converted, and the card of its folder names it",
        "conversion/reference.py",
        '        (out / "conversion.json").write_text(',
        '        0 and (out / "conversion.json").write_text(',
        ("tests/tools/test_hub.py::test_convert_push_to_hub_publishes_the_converted_checkpoint",),
    ),
    Mutation(
        "the card of a converted model names the checkpoint (read from conversion.json)",
        "modeling_gpn/hub/card_inputs.py",
        "    if conversion is not None:  # the weights are the reference trainer's: its run left no log here\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_convert_push_to_hub_publishes_the_converted_checkpoint",),
    ),
    Mutation(
        "a failed atomic write (a state save, gpn bench --json) names the path asked for, not its temporary file",
        "modeling_gpn/atomic_files.py",
        "        raise type(error)(error.errno, error.strerror, str(path)) from error",
        "        raise  # MUTATION",
        (
            "tests/model/test_state.py -k cut_short",
            "tests/tools/test_bench.py::test_the_json_report_is_synced_and_a_failed_write_names_it",
        ),
    ),
    Mutation(
        "a state of no rows is not saved (no load would take the file)",
        "modeling_gpn/state_file.py",
        '    if tensors["predicted"].shape[0] < 1:  # (a cache whose rows were all selected away): no load would take it\n',
        "    if False:  # MUTATION\n",
        ("tests/model/test_state.py::test_a_state_of_no_rows_is_neither_saved_nor_loaded",),
    ),
    Mutation(
        "a state file of no rows is refused saying so",
        "modeling_gpn/state_file.py",
        "    if batch_size < 1:\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_state.py::test_a_state_of_no_rows_is_neither_saved_nor_loaded",),
    ),
    Mutation(
        "gpn serve's store leaves, logged, a file it cannot delete (a spill folder turned read-only failed requests)",
        "modeling_gpn/serve/state_store.py",
        "    try:\n        path.unlink(missing_ok=True)\n    except OSError as error:\n",
        "    path.unlink(missing_ok=True)  # MUTATION\n    if False:\n        error = None\n",
        ("tests/tools/test_serve_store.py::test_a_spill_folder_turned_read_only_fails_no_request",),
    ),
    Mutation(
        "a state file's read fingerprint of non-integers (1.7, true) is refused, not truncated into residues",
        "modeling_gpn/cache.py",
        "                if not all(type(value) is int for value in values):\n",
        "                if False:  # MUTATION\n",
        ("tests/model/test_state.py -k read_fingerprint_no_cache and (float or bool)",),
    ),
    Mutation(
        "the state file's checksum covers the positions read",
        "modeling_gpn/state_file.py",
        '    digest = hashlib.sha256(f"{read_fingerprint}/{positions_read}".encode())',
        "    digest = hashlib.sha256(read_fingerprint.encode())  # MUTATION",
        ("tests/model/test_state.py::test_a_changed_count_of_positions_read_is_refused",),
    ),
    Mutation(
        "the weights fingerprint glances at values (an edit through .data bumps no version)",
        "modeling_gpn/state_file.py",
        "        glance.update(_tensor_bytes(flat[:: max(1, flat.numel() // GLANCE_VALUES)]))",
        "        pass  # MUTATION",
        ("tests/model/test_state.py::test_a_state_of_another_model_is_refused",),
    ),
    Mutation(
        "beam search from a given state refused by name",
        "modeling_gpn/generation.py",
        "        if (generation_config.num_beams or 1) > 1 and user_cache.has_state:",
        "        if False:  # MUTATION",
        ("tests/model/test_state.py::test_beam_search_from_a_state_is_refused_by_name",),
    ),
    Mutation(
        "gpn --version",
        "gpn_cli/__init__.py",
        '    parser.add_argument("--version", action=VersionAction)',
        "    pass  # MUTATION",
        ("tests/tools/test_docs.py::test_gpn_version_names_the_installed_package_and_what_it_runs_on",),
    ),
    Mutation(
        "gpn --help imports torch and transformers (the subcommands' formatter and list looked up for it)",
        "gpn_cli/__init__.py",
        "    if selected is not None:\n        from modeling_gpn.cli.formatting import HelpFormatter\n",
        "    if True:  # MUTATION\n        from modeling_gpn.cli.formatting import HelpFormatter\n",
        ("tests/tools/test_cli_startup.py::test_gpn_help_imports_neither_torch_nor_transformers",),
    ),
    Mutation(
        "gpn --help imports torch (the --version line made for every command)",
        "gpn_cli/__init__.py",
        '    parser.add_argument("--version", action=VersionAction)',
        '    parser.add_argument("--version", action="version", version=version_line())  # MUTATION',
        ("tests/tools/test_cli_startup.py::test_gpn_help_imports_neither_torch_nor_transformers",),
    ),
    Mutation(
        "gpn commands print upstream noise (the filters never installed)",
        "gpn_cli/__init__.py",
        "    quiet_known_upstream_noise()  # before",
        "    pass  # MUTATION",
        ("tests/tools/test_cli_startup.py -k every_subcommands_help",),
    ),
    Mutation(
        "gpn commands print torchao's 'Failed to load .../_C*.so' on a CPU torch",
        "gpn_cli/upstream_noise.py",
        "    return not (_EXTENSION_NOT_LOADED.match(record.getMessage()) and _torch_without_gpu_build())",
        "    return True  # MUTATION",
        (
            "tests/tools/test_cli_startup.py -k every_subcommands_help",
            "tests/tools/test_cli_startup.py::test_only_the_known_lines_are_dropped",
        ),
    ),
    Mutation(
        "gpn commands print torch's notices about torchao's enums",
        "gpn_cli/upstream_noise.py",
        "    return not from_torchao\n",
        "    return True  # MUTATION\n",
        (
            "tests/tools/test_cli_startup.py -k every_subcommands_help",
            "tests/tools/test_cli_startup.py::test_only_the_known_lines_are_dropped",
        ),
    ),
    Mutation(
        "gpn hides torchao's 'Failed to load' on a CUDA torch too (where it may be a real fault)",
        "gpn_cli/upstream_noise.py",
        " and _torch_without_gpu_build())",
        ")  # MUTATION",
        ("tests/tools/test_cli_startup.py::test_only_the_known_lines_are_dropped",),
    ),
    Mutation(
        "gpn hides torch's register_constant notice about any enum, not only torchao's",
        "gpn_cli/upstream_noise.py",
        ' and cls.__module__.split(".")[0] == TORCHAO',
        "  # MUTATION",
        ("tests/tools/test_cli_startup.py::test_only_the_known_lines_are_dropped",),
    ),
    Mutation(
        "gpn serve: generate() from a kept state given only the prompt's last token (processors miss the prompt)",
        "modeling_gpn/serve/generation.py",
        "            sequences = model.generate(\n"
        "                input_ids=input_ids.repeat_interleave(answers, dim=0),\n"
        "                attention_mask=torch.ones(answers, length, dtype=torch.long, device=input_ids.device),\n"
        "                cache=cache,\n"
        "                streamer=streamer,\n"
        "                generation_config=config,\n"
        "                **kwargs,\n"
        "            )\n",
        "            sequences = torch.cat([input_ids[:, : length - 1].repeat_interleave(answers, dim=0), model.generate(\n"
        "                input_ids=input_ids[:, length - 1 :].repeat_interleave(answers, dim=0),  # MUTATION\n"
        "                attention_mask=torch.ones(answers, length, dtype=torch.long, device=input_ids.device),\n"
        "                cache=cache,\n"
        "                streamer=streamer,\n"
        "                generation_config=config,\n"
        "                **kwargs,\n"
        "            )], dim=1)\n",
        (
            "tests/tools/test_serve_store.py -k processors_that_look_back",
            "tests/tools/test_serve.py -k greedy_requests_as_transformers_serve_reads_them",
        ),
    ),
    Mutation(
        "gpn serve: temperature 0 greedy whatever top_p (a 400: sampling at temperature 0)",
        "modeling_gpn/serve/handlers.py",
        "    if temperature is not None and temperature == 0:\n        return False\n",
        "    pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k greedy_requests_as_transformers_serve_reads_them",),
    ),
    Mutation(
        "gpn serve: a generation_config without max_new_tokens resolved as generate() would (a 500)",
        "modeling_gpn/serve/handlers.py",
        "        if gen_config.max_new_tokens is None:\n            _resolve_max_new_tokens(gen_config, length)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k greedy_requests_as_transformers_serve_reads_them",),
    ),
    Mutation(
        "gpn serve: the states of an unloaded model spill by the fingerprint taken while it was loaded",
        "modeling_gpn/serve/state_store.py",
        "            entry.cache.save(path, model_fingerprint=self._model_fingerprints.get(entry.model))\n",
        "            entry.cache.save(path)  # MUTATION\n",
        ("tests/tools/test_serve_store.py -k unloaded_model_still_spill",),
    ),
    Mutation(
        "GPNCache.save names the model by a given fingerprint (its model deleted)",
        "modeling_gpn/cache.py",
        "        if model_fingerprint is None:\n",
        "        if True:  # MUTATION\n",
        (
            "tests/model/test_state.py -k saved_after_its_model_is_deleted",
            "tests/tools/test_serve_store.py -k unloaded_model_still_spill",
        ),
    ),
    Mutation(
        "a state file is written only with a model fingerprint state_fingerprint gives",
        "modeling_gpn/state_file.py",
        "    _check_model_fingerprint(model_fingerprint, path)\n",
        "",
        ("tests/model/test_state.py -k saved_after_its_model_is_deleted",),
    ),
    Mutation(
        "gpn serve: what a killed write left in --state-dir is deleted when a store opens it (kept, uncounted)",
        "modeling_gpn/serve/state_store.py",
        "        self._delete_leftovers()\n",
        "",
        ("tests/tools/test_serve_store.py -k killed_write_left",),
    ),
    Mutation(
        "gpn serve: a write in progress in --state-dir (fresh) is left to finish, not deleted as a leftover",
        "modeling_gpn/serve/state_store.py",
        "                if now - path.stat().st_mtime > LEFTOVER_AGE_SECONDS:\n",
        "                if True:  # MUTATION\n",
        ("tests/tools/test_serve_store.py -k killed_write_left",),
    ),
    Mutation(
        "gpn serve: --state-dir-bytes counts the ids file a spilled state writes",
        "modeling_gpn/serve/state_store.py",
        "            size = path.stat().st_size + ids_path.stat().st_size\n",
        "            size = path.stat().st_size  # MUTATION\n",
        ("tests/tools/test_serve_store.py -k spill_folder_limit_counts_every_file",),
    ),
    Mutation(
        "gpn serve: --state-dir-bytes counts the ids files a restarted store finds",
        "modeling_gpn/serve/state_store.py",
        "                size = stat.st_size + ids_path.stat().st_size  # both files count, as when they were written\n",
        "                size = stat.st_size  # MUTATION\n",
        ("tests/tools/test_serve_store.py -k spill_folder_limit_counts_every_file",),
    ),
    Mutation(
        "gpn serve: the kept states written to --state-dir when the server stops",
        "modeling_gpn/serve/server.py",
        "        on_shutdown = store.spill_all if store is not None else lambda: None\n",
        "        on_shutdown = lambda: None  # MUTATION\n",
        ("tests/tools/test_serve.py -k stopped_and_restarted",),
    ),
    Mutation(
        "gpn serve: n answers cut where a stop string ended their row (not at the padding after it)",
        "modeling_gpn/serve/handlers.py",
        "                if token in ends or (stops is not None and bool(stops(whole[:, : input_len + position + 1], None)[0]))\n",
        "                if token in ends  # MUTATION\n",
        ("tests/tools/test_serve.py -k end_where_each_row_finished",),
    ),
    Mutation(
        "gpn serve: an answer that stopped at its max_tokens-th token is finish_reason stop",
        "modeling_gpn/serve/handlers.py",
        '                    choices[row]["finish_reason"] = "stop"\n',
        "                    pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k end_where_each_row_finished",),
    ),
    Mutation(
        "gpn serve: a lone surrogate in a request is a 400 (a 500 from the tokenizer)",
        "modeling_gpn/serve/validation.py",
        "    for name, value in body.items():\n        _check_text(value, name)\n",
        "",
        ("tests/tools/test_serve.py::test_bad_completion_requests_and_bodies_get_a_4xx",),
    ),
    Mutation(
        "gpn serve: a --state-dir that cannot be a folder is one line, exit 2 (a traceback from the store)",
        "modeling_gpn/serve/cli.py",
        '            writable_folder(args.state_dir, "--state-dir")\n',
        "            pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k cannot_start_says_why",),
    ),
    Mutation(
        "gpn serve: a MODEL folder that is not there, or holds no config.json, is one line, exit 2 (as gpn eval's)",
        "modeling_gpn/serve/cli.py",
        '            check_model_path(args.model)  # (transformers: "Repo id must be in the form ...", or its load\'s error)\n',
        "            pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k cannot_start_says_why",),
    ),
    Mutation(
        "gpn serve: a server that cannot start says why in one line (a traceback)",
        "modeling_gpn/serve/cli.py",
        "        except (OSError, ValueError) as error:\n",
        "        except KeyboardInterrupt as error:  # MUTATION\n",
        ("tests/tools/test_serve.py -k cannot_start_says_why",),
    ),
    Mutation(
        "gpn serve: logit_bias past the vocabulary is a 400 before a stream begins (an error event in a 200)",
        "modeling_gpn/serve/handlers.py",
        "        if outside:  # (generate() refuses them as it starts: a stream would already have begun, a 200)\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_chat_requests and vocabulary",),
    ),
    Mutation(
        "gpn serve --help names the positional MODEL where transformers' help says force_model",
        "modeling_gpn/serve/cli.py",
        '.replace("force_model is set", "MODEL is given")',
        "",
        ("tests/tools/test_serve.py::test_gpn_serve_help_has_transformers_serve_options",),
    ),
    Mutation(
        "gpn serve: /v1/responses through the state store, the request checks and the limits",
        "modeling_gpn/serve/server.py",
        '            _pointing(response, "ResponseHandler", responses),\n',
        "",
        (
            "tests/tools/test_serve.py -k responses_answer_through_the_store",
            "tests/tools/test_serve.py -k queue_limit_refuses",
        ),
    ),
    Mutation(
        "gpn serve: /v1/completions applies logit_bias (transformers' handler accepts it and ignores it)",
        "modeling_gpn/serve/handlers.py",
        '                config.sequence_bias = {(int(token),): bias for token, bias in body["logit_bias"].items()}\n',
        "                pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k completions_apply_logit_bias",),
    ),
    Mutation(
        "gpn serve: a non-streamed answer ends before its stop sequence (transformers: the stop sequence sent too)",
        "modeling_gpn/serve/handlers.py",
        '        _cut_answers_at_stop(body.get("choices", []), _current.get().stops)\n',
        "",
        ("tests/tools/test_serve.py -k answers_end_before_their_stop_sequence",),
    ),
    Mutation(
        "gpn serve: a streamed answer ends before its stop sequence (transformers: the stop sequence sent too)",
        "modeling_gpn/serve/handlers.py",
        "    cutter = StreamCutter(stops) if stops else None\n",
        "    cutter = None  # MUTATION\n",
        ("tests/tools/test_serve.py -k answers_end_before_their_stop_sequence",),
    ),
    Mutation(
        "gpn serve: a stream holds back what may begin a stop sequence (one spread over pieces is sent)",
        "modeling_gpn/serve/stop_strings.py",
        '        self._held = text[len(text) - keep :] if keep else ""\n        return text[: len(text) - keep]\n',
        '        self._held = ""\n        return text  # MUTATION\n',
        ("tests/tools/test_serve.py -k holds_back_what_may_begin",),
    ),
    Mutation(
        "gpn serve: tools a chat template never renders are a 400 (transformers drops them in silence)",
        "modeling_gpn/serve/handlers.py",
        '        if body.get("tools") and not any("tools" in source for source in sources):\n',
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_chat_requests and renders",),
    ),
    Mutation(
        "gpn serve: an image part for a text-only model is a 400 (transformers drops it in silence)",
        "modeling_gpn/serve/handlers.py",
        "                check_text_only(body)\n",
        "                pass  # MUTATION\n",
        (
            "tests/tools/test_serve.py -k bad_chat_requests and image",
            "tests/tools/test_serve.py -k responses_answer_through_the_store",
        ),
    ),
    Mutation(
        "gpn serve: /v1/completions refuses a suffix (transformers appends it to the answer)",
        "modeling_gpn/serve/validation.py",
        '        "suffix": (\'""\', _is_default("")),\n',
        "",
        ("tests/tools/test_serve.py -k completions_apply_logit_bias",),
    ),
    Mutation(
        "gpn serve: the context limit's 400 names max_completion_tokens when that set the length",
        "modeling_gpn/serve/handlers.py",
        '    max_tokens_fields = ("max_completion_tokens", "max_tokens")\n',
        '    max_tokens_fields = ("max_tokens", "max_completion_tokens")  # MUTATION\n',
        ("tests/tools/test_serve.py -k bad_chat_requests and max_completion_tokens",),
    ),
    Mutation(
        "gpn serve: errors answered in the OpenAI API's shape (transformers: FastAPI's detail)",
        "modeling_gpn/serve/server.py",
        "        add_openai_error_handlers(app)\n",
        "",
        ("tests/tools/test_serve.py -k openai_apis_shape",),
    ),
    Mutation(
        "gpn serve: a stream's error event in the OpenAI API's shape (transformers: a bare string)",
        "modeling_gpn/serve/handlers.py",
        "                    error = as_openai_stream_error(event)\n",
        "                    error = None  # MUTATION\n",
        ("tests/tools/test_serve.py -k openai_apis_shape",),
    ),
    Mutation(
        "gpn serve: /v1/responses instructions inserted before an input's system message (transformers: over it)",
        "modeling_gpn/serve/handlers.py",
        "        body = _instructions_before_the_input(body)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k instructions_come_before",),
    ),
    Mutation(
        "gpn serve: /v1/responses without stream answers one JSON response, as the API (transformers streams)",
        "modeling_gpn/serve/handlers.py",
        '            body = {**body, "stream": False}\n',
        "            pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        "gpn serve: /v1/completions refuses echo, best_of, logprobs, suffix (transformers ignores them)",
        "modeling_gpn/serve/validation.py",
        '    _check_supported(body, "completion")\n',
        "",
        ("tests/tools/test_serve.py -k completions_apply_logit_bias",),
    ),
    Mutation(
        "gpn serve: /v1/chat/completions refuses logprobs, response_format (transformers ignores them)",
        "modeling_gpn/serve/validation.py",
        '    _check_supported(body, "chat")\n',
        "",
        ("tests/tools/test_serve.py -k bad_chat_requests and (logprobs or response_format)",),
    ),
    Mutation(
        "gpn serve: /v1/responses refuses previous_response_id, a non-text format, ... (transformers ignores them)",
        "modeling_gpn/serve/validation.py",
        '    _check_supported(body, "response")\n',
        "",
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        "gpn serve: /v1/audio/transcriptions without python-multipart is a 501 saying so (transformers: a bare 500)",
        "modeling_gpn/serve/server.py",
        '            _pointing(transcription, "TranscriptionHandler", CheckedTranscriptionHandler),\n',
        "",
        ("tests/tools/test_serve.py -k bad_completion_requests_and_bodies",),
    ),
    Mutation(
        "gpn serve: /v1/systemone takes a slot of --max-queued-requests (transformers let any number in)",
        "modeling_gpn/serve/server.py",
        '            _pointing(systemone, "SystemOneHandler", decisions),\n',
        "",
        ("tests/tools/test_serve.py -k queue_limit_refuses",),
    ),
    Mutation(
        "gpn serve: a pinned server's /load_model loads no other model (transformers: loaded, kept for good, unserved)",
        "modeling_gpn/serve/server.py",
        '        load_only_the_pinned_model(kwargs["model_manager"] if "model_manager" in kwargs else args[0])\n',
        "",
        ("tests/tools/test_serve.py -k n_answers_models_and_health",),
    ),
    Mutation(
        "gpn serve: /v1/chat/completions refuses a verbosity (transformers ignores it)",
        "modeling_gpn/serve/validation.py",
        '        "verbosity": (\'"medium"\', _is_default("medium")),  # (the API\'s default: how long the answer is asked to be)\n',
        "",
        ("tests/tools/test_serve.py -k bad_chat_requests and verbosity",),
    ),
    Mutation(
        "gpn serve: /v1/responses refuses a conversation (transformers ignores it: its stored items never read)",
        "modeling_gpn/serve/validation.py",
        '        "conversation": ("null (send the conversation in input)", lambda value: False),\n',
        "",
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        "gpn serve: /v1/responses refuses reasoning (transformers ignores it)",
        "modeling_gpn/serve/validation.py",
        '        "reasoning": ("null", _no_reasoning),\n',
        "",
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        "gpn serve: /v1/responses refuses context_management (transformers ignores it)",
        "modeling_gpn/serve/validation.py",
        '        "context_management": ("[]", _is_default([])),\n',
        "",
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        "gpn serve: /v1/responses refuses a text verbosity (transformers ignores it)",
        "modeling_gpn/serve/validation.py",
        '    return _text_format(value.get("format", {})) and value.get("verbosity") in (None, "medium")\n',
        '    return _text_format(value.get("format", {}))  # MUTATION\n',
        ("tests/tools/test_serve.py -k responses_answer_through_the_store",),
    ),
    Mutation(
        'gpn serve: a streamed answer that ended on EOS at its max_tokens-th token is "stop" (transformers: "length")',
        "modeling_gpn/serve/handlers.py",
        '                            last["finish_reason"] = "stop"  # it ended on EOS, at its last allowed token\n',
        "                            pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k n_answers_end_where_each_row_finished",),
    ),
    Mutation(
        "gpn serve: temperature samples the whole distribution, as the OpenAI API (generate(): the 50 likeliest)",
        "modeling_gpn/serve/handlers.py",
        "                    config.top_k = 0\n",
        "                    pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k drawn_from_the_whole_distribution",),
    ),
    Mutation(
        "gpn serve: a request's seed applied as its generate() starts (transformers: when it arrives)",
        "modeling_gpn/serve/handlers.py",
        '            body = {**body, "seed": None, "frequency_penalty": None}\n',
        '            body = {**body, "frequency_penalty": None}  # MUTATION\n',
        ("tests/tools/test_serve.py -k seed_gives_the_same_sample",),
    ),
    Mutation(
        "gpn serve: the handlers are told when a request's client goes away",
        "modeling_gpn/serve/server.py",
        "        app.add_middleware(WatchingClients)\n",
        "",
        ("tests/tools/test_serve.py -k gives_up_on_a_non_streamed_answer",),
    ),
    Mutation(
        "gpn train's ranks train on, orphaned, when their launcher is killed",
        "modeling_gpn/train/training.py",
        "    stop_when_the_launcher_dies(started_by_a_launcher())\n",
        "    stop_when_the_launcher_dies(False)  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k launcher_is_killed",),
    ),
    Mutation(
        "gpn serve: a request body over --max-request-bytes is read whole",
        "modeling_gpn/serve/server.py",
        "            app.add_middleware(LimitedBodies, max_bytes=max_request_bytes)\n",
        "            pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_completion_requests_and_bodies",),
    ),
    Mutation(
        "gpn serve: a body over --max-request-bytes is read before it is refused by its Content-Length",
        "modeling_gpn/serve/handlers.py",
        "        if declared.isdigit() and int(declared) > self.max_bytes:\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_completion_requests_and_bodies",),
    ),
    Mutation(
        "gpn serve: a refused body's client is not drained (its connection reset before it reads the 413)",
        "modeling_gpn/serve/handlers.py",
        "        if sending:\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_completion_requests_and_bodies",),
    ),
    Mutation(
        "gpn serve: a non-streamed answer's generate() stops when its client goes away",
        "modeling_gpn/serve/generation.py",
        "[] if self._client_gone is None else [ClientGone(self._client_gone)]",
        "[]",
        ("tests/tools/test_serve.py -k gives_up_on_a_non_streamed_answer",),
    ),
    Mutation(
        "gpn serve: sampled generate() calls take turns at torch's generator (one model's draws from another's seed)",
        "modeling_gpn/serve/generation.py",
        "    with _sampling_turn:\n",
        "    with contextlib.nullcontext():  # MUTATION\n",
        ("tests/tools/test_serve.py -k not_pinned_keeps_each_models_conversations",),
    ),
    Mutation(
        "gpn eval runs a repo's own code without --trust-remote-code",
        "eval/cli.py",
        "        trust_remote_code=args.trust_remote_code,\n",
        "        trust_remote_code=True,  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_a_repos_own_code_runs_only_with_trust_remote_code",),
    ),
    Mutation(
        "gpn eval's lm-eval tasks score a bfloat16 model's logits in bfloat16",
        "eval/runner.py",
        "            return super()._model_call(inps, attn_mask, labels).float()\n",
        "            return super()._model_call(inps, attn_mask, labels)  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_lm_eval_scores_a_bfloat16_model_from_float32_logits",),
    ),
    Mutation(
        "gpn eval's --task-data files not checked before the model loads (a missing one taken for a Hub name)",
        "eval/runner.py",
        "        check_task_data(task, source)\n",
        "        pass  # MUTATION\n",
        ("tests/ecosystem/test_eval.py -k task_data_naming_missing",),
    ),
    Mutation(
        "gpn eval runs with no task at all (--tasks ,), writing a report of dashes",
        "eval/runner.py",
        "    if not tasks:\n",
        "    if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_clear_errors",),
    ),
    Mutation(
        "gpn eval's report says --limit cut every task (FineWeb's windows too)",
        "eval/report.py",
        "            f\"; **limit: the first {results['limit']} examples of each LAMBADA and lm-eval task**\"\n",
        "            f\"; **limit {results['limit']} examples per task**\"  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_gpn_eval_command_writes_results_and_side_by_side_report",),
    ),
    Mutation(
        "gpn eval loses the figures of the tasks finished before one that fails",
        "eval/cli.py",
        '        if finished.get("tasks"):  # the tasks before the one that failed are kept, not lost with it\n',
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py -k finished_before_it",),
    ),
    Mutation(
        "gpn eval's --device not checked before the model loads",
        "eval/cli.py",
        "        torch_device(args.device)\n",
        "",
        ("tests/ecosystem/test_eval.py -k unusable_device",),
    ),
    Mutation(
        "gpn eval's local lm-eval data not checked for the column the task reads",
        "eval/runner.py",
        "    _check_column(task, paths, builder, settings.text_field)\n",
        "",
        ("tests/ecosystem/test_eval.py::test_local_data_without_the_tasks_column_is_one_clear_line",),
    ),
    Mutation(
        "gpn eval's gpn_rolling_ppl reads a .txt file's column as --text-field",
        "eval/runner.py",
        '        column = "text" if plain_text else settings.text_field\n',
        "        column = settings.text_field  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_rolling_ppl_reads_a_text_file_whatever_the_text_field",),
    ),
    Mutation(
        "gpn eval's numbers not checked (--limit 0, --batch-size 0 reach the run)",
        "eval/runner.py",
        "        if value is not None and value < least:\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py -k numbers_out_of_range and (limit or batch or window)",),
    ),
    Mutation(
        "gpn eval's --limit checked after a row is taken",
        "eval/runner.py",
        "        if limit is not None and len(texts) >= limit:  # before the row is taken: a limit of 0 takes none\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_a_limit_takes_that_many_texts",),
    ),
    Mutation(
        "gpn eval, inspect and generate run a model whose weights hold NaN or inf (perplexities of NaN written as results)",
        "modeling_gpn/cli/loading.py",
        "    refuse_non_finite_parameters(model, path)\n",
        "    pass  # MUTATION\n",
        (
            "tests/ecosystem/test_eval.py::test_a_damaged_weights_file_is_one_line",
            "tests/tools/test_faults_io.py -k nan-weights",
        ),
    ),
    Mutation(
        "a preset file holding a JSON list or number fails inside GPNConfig(**values) (a TypeError traceback)",
        "configuration/__init__.py",
        "    if not isinstance(values, dict):  # (a list",
        "    if False:  # MUTATION (a list",
        (
            "tests/tools/test_bench.py::test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured[not-an-object]",
        ),
    ),
    Mutation(
        "gpn eval's and gpn inspect's output folder not checked before the work",
        "modeling_gpn/cli/arguments.py",
        "    existing = folder\n    while not existing.exists():\n",
        "    return folder  # MUTATION\n    existing = folder\n    while not existing.exists():\n",
        (
            "tests/ecosystem/test_eval.py -k unusable_output_dir",
            "tests/tools/test_inspect.py -k before_the_model_loads and output",
        ),
    ),
    Mutation(
        "gpn eval's bad arguments as class names and exit 1",
        "eval/cli.py",
        '    print(f"gpn eval: error: {message}", file=sys.stderr)\n    return 2\n',
        '    print(f"gpn eval: {type(message).__name__}: {message}", file=sys.stderr)\n    return 1  # MUTATION\n',
        (
            "tests/ecosystem/test_eval.py::test_clear_errors",
            "tests/ecosystem/test_eval.py -k numbers_out_of_range",
        ),
    ),
    Mutation(
        "gpn eval --quiet leaves the libraries' progress bars on",
        "eval/runner.py",
        "    with contextlib.nullcontext() if settings.progress else progress_bars_off():\n",
        "    with contextlib.nullcontext():  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_quiet_shows_no_progress_bar_of_any_library",),
    ),
    Mutation(
        "every option's help (gpn eval --batch-size without one)",
        "eval/cli.py",
        '        help="examples or windows per forward pass (the figures do not depend on it)",\n',
        "        help=None,  # MUTATION\n",
        ("tests/tools/test_docs.py -k every_option_has_help and eval",),
    ),
    Mutation(
        "gpn inspect's memory heads off before the read's norm (the other heads' read scaled up)",
        "modeling_gpn/inspect/ablations.py",
        "    normalised = layer.read_out_norm(read_vector)\n",
        "    normalised = layer.read_out_norm(read_vector * keep)  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_removing_memory_heads_leaves_the_other_heads_reads_as_they_were",),
    ),
    Mutation(
        "gpn inspect refuses a PEFT adapter folder (no config.json) instead of loading its base with the adapter",
        "modeling_gpn/inspect/inputs.py",
        '    if not (Path(name).expanduser() / "adapter_config.json").is_file():  #',
        "    if True:  #",
        ("tests/tools/test_inspect.py::test_gpn_inspect_of_a_peft_adapter_folder",),
    ),
    Mutation(
        "gpn inspect reads a blank jsonl / csv / Hub row as a document (gpn train and gpn eval leave it out)",
        "modeling_gpn/inspect/inputs.py",
        "        if text and text.strip():  #",
        "        if text:  #",
        ("tests/tools/test_inspect.py -k exactly_the_files_gpn_train_reads",),
    ),
    Mutation(
        "gpn inspect's --device not checked before the model loads (a traceback as the model moves)",
        "modeling_gpn/inspect/cli.py",
        "        torch_device(args.device)  #",
        "        pass  #",
        ("tests/tools/test_inspect.py -k before_the_model_loads and device",),
    ),
    Mutation(
        "gpn inspect's retention from the window's first token only (not averaged over the starts, as documented)",
        "modeling_gpn/analysis/retention.py",
        "curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k]).mean(axis=(0, 1))",
        "curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k])[:, :1].mean(axis=(0, 1))",
        ("tests/tools/test_inspect.py::test_retention_averages_over_the_starts_that_have_k_steps_left",),
    ),
    Mutation(
        "gpn inspect's retention over every start, the last k-1 ones wrapping (not only those with k steps left)",
        "modeling_gpn/analysis/retention.py",
        "curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k]).mean(axis=(0, 1))",
        "curves[k] = np.exp(np.concatenate([cumulative[:, k:] - cumulative[:, :-k], "
        "cumulative[:, -1:] - cumulative[:, -k:-1] + cumulative[:, 1:k]], axis=1)).mean(axis=(0, 1))",
        ("tests/tools/test_inspect.py::test_retention_averages_over_the_starts_that_have_k_steps_left",),
    ),
    Mutation(
        "gpn inspect's causal-test baseline is the model's forward (fast path), not the ablations' own loop",
        "modeling_gpn/inspect/ablations.py",
        "        states.append(ablated_states(model, batch, reset_after=reset_after).float().cpu().numpy())\n",
        "        states.append(model(batch, output_predicted_states=True).predicted_states.float().cpu().numpy())\n",
        ("tests/tools/test_inspect.py::test_the_causal_tests_baseline_runs_the_ablations_time_loop",),
    ),
    Mutation(
        "gpn inspect's report compares s̄'s share with the paper's stated 58% alone (its own 107/132 is 81%)",
        "modeling_gpn/inspect/markdown.py",
        '        "107 (58% stated; 107/132 = 81%) |",\n',
        '        "107 (58%) |",  # MUTATION\n',
        ("tests/tools/test_inspect.py::test_report_of_a_gpn_without_memory",),
    ),
    Mutation(
        "gpn inspect's correlation panel gives the mean |r| of every pair as the sample's",
        "modeling_gpn/inspect/figures.py",
        "-dim sample); all dims: mean |r| = ",
        "-dim sample): mean |r| = ",
        ("tests/tools/test_inspect.py::test_report_of_a_gpn_without_memory",),
    ),
    Mutation(
        "gpn inspect's report of a PEFT adapter folder does not say an adapter was attached, nor to which base",
        "modeling_gpn/inspect/report.py",
        '        "adapter": adapter_summary(model),\n',
        '        "adapter": None,  # MUTATION\n',
        ("tests/tools/test_inspect.py::test_gpn_inspect_of_a_peft_adapter_folder",),
    ),
    Mutation(
        "gpn inspect's report of a GPN without memory leaves the memory section out without a word",
        "modeling_gpn/inspect/markdown.py",
        '    elif not report["model"]["use_memory"]:',
        "    elif False:  # MUTATION",
        ("tests/tools/test_inspect.py::test_report_of_a_gpn_without_memory",),
    ),
    Mutation(
        "gpn inspect's ablations figure gives the windows' tokens as the count its perplexities are over",
        "modeling_gpn/inspect/figures.py",
        "{rows[0]['tokens']:,} predicted tokens)",
        "{ablations['tokens']:,} predicted tokens)",
        ("tests/tools/test_inspect.py::test_report_of_a_gpn_without_memory",),
    ),
    Mutation(
        "gpn inspect's --max-geometry-states 1 not refused (a traceback after the run)",
        "modeling_gpn/inspect/cli.py",
        "    if args.max_geometry_states < 2:",
        "    if False:  # MUTATION",
        ("tests/tools/test_inspect.py -k before_the_model_loads and geometry",),
    ),
    Mutation(
        "gpn inspect overwrites a report already in --output (a stale ablations.png stays beside the new one)",
        "modeling_gpn/inspect/cli.py",
        "        check_no_report(output)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_end_to_end",),
    ),
    Mutation(
        "gpn inspect --quiet leaves transformers' progress bars on (Loading weights)",
        "modeling_gpn/inspect/cli.py",
        "        with progress_bars_off():\n",
        "        with torch.no_grad():  # MUTATION (a context that leaves the bars on)\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_end_to_end",),
    ),
    Mutation(
        "gpn inspect labels a byte-level BPE's newline token by its stand-in (Ċ)",
        "modeling_gpn/inspect/report.py",
        '    "Ċ": "\\n",\n',
        "",
        ("tests/tools/test_inspect.py::test_token_labels_show_a_newline_as_one_escape",),
    ),
    Mutation(
        "gpn inspect's figure escapes the token labels a second time (a newline shows two backslashes)",
        "modeling_gpn/inspect/figures.py",
        '    labels = mean["top_tokens"][::-1]',
        '    labels = [repr(t)[1:-1] for t in mean["top_tokens"]][::-1]  # MUTATION',
        ("tests/tools/test_inspect.py::test_token_labels_show_a_newline_as_one_escape",),
    ),
    Mutation(
        "gpn inspect --ablation-tokens ignored in silence under --no-ablations",
        "modeling_gpn/inspect/cli.py",
        "    if args.no_ablations and args.ablation_tokens is not None:",
        "    if False:  # MUTATION",
        ("tests/tools/test_inspect.py -k before_the_model_loads and ablation",),
    ),
    Mutation(
        "gpn inspect --data - taken for a Hub dataset id (a message about repo ids)",
        "modeling_gpn/inspect/cli.py",
        '    if args.data == "-":',
        "    if False:  # MUTATION",
        ("tests/tools/test_inspect.py -k before_the_model_loads and data",),
    ),
    Mutation(
        "gpn inspect's counts not checked before the model loads",
        "modeling_gpn/inspect/cli.py",
        "        check_numbers(args)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_inspect.py -k before_the_model_loads and (tokens or seq)",),
    ),
    Mutation(
        "gpn inspect's bad arguments end in SystemExit (exit 1)",
        "modeling_gpn/inspect/cli.py",
        '    print(f"gpn inspect: error: {message}", file=sys.stderr)\n    return 2\n',
        '    raise SystemExit(f"gpn inspect: {message}")  # MUTATION\n',
        ("tests/tools/test_inspect.py -k before_the_model_loads",),
    ),
    Mutation(
        "gpn generate --save-state of a non-GPN model not refused before generating",
        "modeling_gpn/cli/generate.py",
        "        _check_saves_a_state(args, model)\n",
        "",
        ("tests/model/test_state.py::test_cli_save_state_of_a_model_without_a_gpn_state_is_refused_before_generating",),
    ),
    Mutation(
        "gpn generate's 'only applies with --sample' (ungrammatical)",
        "modeling_gpn/cli/generate.py",
        '            verb = "applies" if len(given) == 1 else "apply"\n',
        '            verb = "apply"  # MUTATION\n',
        ("tests/tools/test_faults_io.py -k generate_bad_arguments and sample",),
    ),
    Mutation(
        "a missing --tokenizer folder taken for a Hub id",
        "modeling_gpn/data/tokenizer.py",
        "    if names_a_local_path(name) and not Path(name).expanduser().exists():\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k missing_tokenizer_folder or load_tokenizer_names_a_missing",),
    ),
    Mutation(
        "gpn convert writes into a folder with files in it",
        "conversion/reference.py",
        "    if out.is_dir() and any(out.iterdir()):\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py::test_gpn_convert_refuses_a_folder_with_files_in_it",),
    ),
    Mutation(
        "gpn convert saves a tokenizer with more ids than the model",
        "conversion/reference.py",
        "        if ids > model.config.vocab_size:\n",
        "        if False:  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py::test_gpn_convert_refuses_a_tokenizer_with_more_ids_than_the_model",
        ),
    ),
    Mutation(
        "gpn push's card ignores gpn train's run folder",
        "modeling_gpn/hub/card_inputs.py",
        "    if model_dir.name == TRAIN_RUN_MODEL and (run_dir / TRAIN_RUN_CONFIG).is_file():\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_card_of_gpn_trains_own_output_reads_its_run_folder",),
    ),
    Mutation(
        "a line break in a recipe value breaks the card's table",
        "modeling_gpn/hub/model_card.py",
        '.replace("\\n", "\\\\n")  # one table cell',
        "  # MUTATION",
        ("tests/tools/test_hub.py::test_card_of_gpn_trains_own_output_reads_its_run_folder",),
    ),
    Mutation(
        "gpn push accepts any repo id in a dry run",
        "modeling_gpn/hub/push.py",
        "        validate_repo_id(repo_id)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn train --resume PATH checked only after the data are tokenized",
        "modeling_gpn/train/training.py",
        "        check_resume_path(resume)  # a wrong --resume PATH costs no tokenizing\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k no_checkpoint_names",),
    ),
    Mutation(
        "docs/generate.md's model folder where nothing writes one",
        "docs/generate.md",
        'gpn generate runs/tiny-cpu/model "ROMEO:" "To be, or not"',
        'gpn generate outputs/tiny-shakespeare "ROMEO:" "To be, or not"',
        ("tests/tools/test_docs.py::test_documented_model_folders_are_where_gpn_train_writes_them",),
    ),
    Mutation(
        "the docs name a library version other than the installed one (Accelerate 1.15 under 1.16)",
        "docs/fine-tuning.md",
        "layers), Accelerate 1.16 fails on in `fully_shard`",
        "layers), Accelerate 1.15 fails on in `fully_shard`",
        ("tests/tools/test_docs.py -k library_versions",),
    ),
    Mutation(
        "a gpn option named in the docs' prose that the command does not have",
        "docs/publishing.md",
        "for a `gpn eval --limit N` run",
        "for a `gpn eval --max-examples N` run",
        ("tests/tools/test_docs.py -k prose_names_exist",),
    ),
    Mutation(
        "a link to a heading the page does not have",
        "docs/fine-tuning.md",
        "(transformers.md#gradient-checkpointing)",
        "(transformers.md#checkpointing-time)",
        ("tests/tools/test_docs.py -k links_and_named_files",),
    ),
    Mutation(
        "the docs name a Python name where it is not (modeling_gpn.RECURRENCE_METHODS, not in the package)",
        "docs/transformers.md",
        "`modeling_gpn.modeling_gpn.RECURRENCE_METHODS`",
        "`modeling_gpn.RECURRENCE_METHODS`",
        ("tests/tools/test_docs.py -k python_names",),
    ),
    Mutation(
        "an accelerate launch in the docs that Accelerate's launcher refuses (FSDP version 3)",
        "docs/training.md",
        "# FSDP2 (fully_shard), 2 processes on CPU\nACCELERATE_USE_CPU=1 accelerate launch --use_fsdp --fsdp_version 2",
        "# FSDP2 (fully_shard), 2 processes on CPU\nACCELERATE_USE_CPU=1 accelerate launch --use_fsdp --fsdp_version 3",
        ("tests/tools/test_docs.py -k accelerate_launch",),
    ),
    Mutation(
        "an Accelerate option named in the docs' prose that its launcher does not have",
        "docs/training.md",
        "`--fsdp_transformer_layer_cls_to_wrap GPNPredictLayer,GPNMemoryWrite` (ran here",
        "`--fsdp_layer_cls_to_wrap GPNPredictLayer,GPNMemoryWrite` (ran here",
        ("tests/tools/test_docs.py -k accelerate_launch",),
    ),
    Mutation(
        "CONTRIBUTING.md's layout leaves out a file of the model",
        "CONTRIBUTING.md",
        "`sharding.py` (FSDP2 with blocks sharded apart), ",
        "",
        ("tests/tools/test_docs.py -k contributing_names",),
    ),
    Mutation(
        'GPNConfig\'s booleans checked (a hand-edited "false" string builds the memory)',
        "modeling_gpn/configuration_gpn.py",
        "            if not isinstance(getattr(self, name), bool):\n",
        "            if False:  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py -k misread and string",
            "tests/model/test_config_and_conversion.py::test_a_hand_edited_config_json_is_refused_at_from_pretrained[use_memory]",
        ),
    ),
    Mutation(
        "GPNConfig's special token ids checked against the vocabulary",
        "modeling_gpn/configuration_gpn.py",
        "        if token_ids and isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > 0:\n",
        "        if False:  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py -k misread and outside",
            "tests/model/test_config_and_conversion.py::test_a_hand_edited_config_json_is_refused_at_from_pretrained[eos_token_id]",
        ),
    ),
    Mutation(
        "GPNConfig's numbers checked finite",
        "modeling_gpn/configuration_gpn.py",
        " or not math.isfinite(value):",
        ":  # MUTATION",
        ("tests/model/test_config_and_conversion.py -k misread and infinite",),
    ),
    Mutation(
        "GPNConfig's initializer_range checked non-negative",
        "modeling_gpn/configuration_gpn.py",
        "            elif value < 0 or (positive and value == 0):\n",
        "            elif positive and value == 0:  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py -k misread and negative",),
    ),
    Mutation(
        "the fast path takes torchao's int8 and int4 weight-only weights (quantize_ or TorchAoConfig at from_pretrained)",
        "modeling_gpn/fast_recurrence.py",
        "        and (int8_weight_parts(parameter) is not None or dequantized_by_linear(parameter))\n",
        "        and False  # MUTATION\n",
        (
            "tests/fast_path/test_step_kernels.py -k int8_weights_run_the_fast_path_within or torchao_config_runs_the_fast_path or int4_weights_run",
        ),
    ),
    Mutation(
        "save_pretrained refuses weights torchao's quantize_ quantized after loading, before anything is written",
        "modeling_gpn/modeling_gpn.py",
        '        if kind.__module__.startswith("torchao."):  # (a subclass of torch\'s own, a DTensor, saves as usual)\n',
        "        if False:  # MUTATION\n",
        ("tests/fast_path/test_step_kernels.py -k quantized_after_loading_is_refused",),
    ),
    Mutation(
        "torchao's int4 weight-only weights (IntxWeightOnlyConfig) not recognised: the plain loop runs them",
        "modeling_gpn/recurrence_step.py",
        '        held.get("activation_quantization") is None\n        and isinstance(qdata, torch.Tensor)\n',
        "        False  # MUTATION\n        and isinstance(qdata, torch.Tensor)\n",
        (
            "tests/fast_path/test_step_kernels.py -k int4_weights_run or int4_weights_train or generate_runs_an_int8",
            "tests/fast_path/test_step_kernels.py::"
            "test_a_model_quantized_by_torchao_config_runs_the_fast_path_saves_and_reloads[int4]",
            "tests/tools/test_bench.py::test_bench_measures_int4_weights_on_the_fast_path",
            "tests/fast_path/test_decode_call.py -k int4",
        ),
    ),
    Mutation(
        "int4 weights whose linear quantizes its input too (dynamic activations) taken as weight-only",
        "modeling_gpn/recurrence_step.py",
        '        held.get("activation_quantization") is None\n        and isinstance(qdata, torch.Tensor)\n',
        "        isinstance(qdata, torch.Tensor)  # MUTATION\n",
        ("tests/fast_path/test_step_kernels.py::test_low_bit_weights_with_quantized_activations_keep_the_plain_path",),
    ),
    Mutation(
        "the C kernels refuse int4 weights (not dequantized into the plan): the torch-ops steps run them",
        "modeling_gpn/memory_kernels.py",
        "    if dequantized_by_linear(weight):\n        with torch.no_grad():\n",
        "    if False:  # MUTATION\n        with torch.no_grad():\n",
        ("tests/fast_path/test_step_kernels.py -k int4_weights_run or generate_runs_an_int8",),
    ),
    Mutation(
        "a decoded token of a model whose head is int4 weight-only runs off the one C call",
        "modeling_gpn/fast_recurrence.py",
        "    if not tied and int8_weight_parts(head.weight) is None and not dequantized_by_linear(head.weight):\n",
        "    if not tied and int8_weight_parts(head.weight) is None:  # MUTATION\n",
        (
            "tests/fast_path/test_step_kernels.py::"
            "test_int4_weights_run_the_fast_path_on_the_matrices_their_linear_multiplies[decode-in-one-call]",
        ),
    ),
    Mutation(
        "the torch-ops steps multiply an int4 weight as torchao's tensor, not its dequantized matrix",
        "modeling_gpn/recurrence_step.py",
        "    if dequantized_by_linear(weight):\n        return weight.dequantize()\n",
        "    if False:  # MUTATION\n        return weight.dequantize()\n",
        ("tests/fast_path/test_step_kernels.py -k int4_weights_run or int4_weights_train",),
    ),
    Mutation(
        "gpn generate --dtype KIND quantizes a folder saved quantized to KIND again (torchao fails in its dispatch)",
        "modeling_gpn/cli/generate.py",
        "    if kinds == {dtype}:\n        return model\n",
        "    if False:  # MUTATION\n        return model\n",
        ("tests/fast_path/test_step_kernels.py -k saved_quantized_as_saved",),
    ),
    Mutation(
        "gpn generate --dtype of another quantization than the folder's is not refused (int4 ran int8 in silence)",
        "modeling_gpn/cli/generate.py",
        "    if kinds:\n        raise GenerateError(\n",
        "    if False:  # MUTATION\n        raise GenerateError(\n",
        ("tests/fast_path/test_step_kernels.py -k saved_quantized_as_saved",),
    ),
    Mutation(
        "a folder saved int4 is not told from another quantization (gpn generate --dtype int4 refuses it)",
        "modeling_gpn/bench/models.py",
        '        elif dequantized_by_linear(parameter) and getattr(parameter, "target_dtype", None) is torch.int4:\n',
        "        elif False:  # MUTATION\n",
        (
            "tests/fast_path/test_step_kernels.py::"
            "test_gpn_generate_runs_a_folder_saved_quantized_as_saved_and_refuses_another_quantization[int4-int8]",
        ),
    ),
    Mutation(
        "what a call derived outlives the cache it was kept for (an int4 model held its bf16 matrices for good)",
        "modeling_gpn/derived_weights.py",
        "(weakref.ref(cache, _forgetting(model)), derived))\n",
        "(weakref.ref(cache), derived))  # MUTATION\n",
        ("tests/fast_path/test_edited_weights.py::test_what_a_call_derived_goes_when_the_cache_it_was_kept_for_does",),
    ),
    Mutation(
        "gpn serve leaves what a request derived with the state the store keeps (an int4 model's bf16 matrices)",
        "modeling_gpn/serve/generation.py",
        "        drop_kept(model.model)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_serve_store.py::test_the_weights_a_request_derived_do_not_live_on_with_the_state_it_kept",),
    ),
    Mutation(
        "GPNConfig refuses an attention head shape by name (transformers' ExecuTorch exporter failed deep inside)",
        "modeling_gpn/configuration_gpn.py",
        "        if name in _ATTENTION_SHAPE_ATTRIBUTES:\n",
        "        if False:  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::test_transformers_executorch_exporter_and_torchscript_are_refused_by_name",
        ),
    ),
    Mutation(
        "GPNConfig checked at save (transformers' validation calls only its own validators)",
        "modeling_gpn/configuration_gpn.py",
        "        super().validate()\n        self._check_values()\n",
        "        super().validate()  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py::test_a_value_changed_after_construction_is_refused_at_save",),
    ),
    Mutation(
        "GPNConfig checked again when a model is built from it",
        "modeling_gpn/modeling_gpn.py",
        "        config._check_values(token_ids=False)\n",
        "        pass  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py::test_a_value_changed_after_construction_is_refused_when_a_model_is_built",
        ),
    ),
    Mutation(
        "the segment length gradient checkpointing set is left out of a saved config",
        "modeling_gpn/modeling_gpn.py",
        "            config.bptt_segment_length = None\n        try:\n",
        "            pass  # MUTATION\n        try:\n",
        ("tests/ecosystem/test_ecosystem.py::test_the_segment_length_checkpointing_sets_is_not_saved_with_the_model",),
    ),
    Mutation(
        "an offloaded head (meta until accelerate's hook loads it) is not taken for an untied one",
        "modeling_gpn/modeling_gpn.py",
        "            and not head.weight.is_meta\n",
        "",
        ("tests/ecosystem/test_ecosystem.py::test_a_model_offloaded_to_disk_by_device_map_runs_and_generates",),
    ),
    Mutation(
        "gpn serve lets transformers read frequency_penalty as a repetition penalty too",
        "modeling_gpn/serve/handlers.py",
        'body = {**body, "seed": None, "frequency_penalty": None}',
        'body = {**body, "seed": None}',
        ("tests/tools/test_serve.py::test_penalties_are_the_apis",),
    ),
    Mutation(
        "gpn serve never gives generate() the API's penalties",
        "modeling_gpn/serve/handlers.py",
        "            penalties=_penalties(body),\n",
        "",
        ("tests/tools/test_serve.py::test_penalties_are_the_apis",),
    ),
    Mutation(
        "gpn serve hands the API's penalties to continuous batching, which has no generate() to apply them",
        "modeling_gpn/serve/handlers.py",
        "        elif _penalties(body) is not None:  # (no generate() call to give them to)",
        "        elif False:  # MUTATION",
        ("tests/tools/test_serve.py::test_penalties_are_refused_under_continuous_batching",),
    ),
    Mutation(
        "the API's penalties count the prompt's tokens too",
        "modeling_gpn/serve/generation.py",
        "        made = input_ids[:, self.prompt_length :]\n",
        "        made = input_ids\n",
        (
            "tests/tools/test_serve.py::test_penalties_are_the_apis",
            "tests/tools/test_serve.py::test_sampled_penalties_come_before_the_temperature_and_the_cuts",
        ),
    ),
    Mutation(
        "presence_penalty is not applied",
        "modeling_gpn/serve/generation.py",
        " - self.presence * (counts > 0).to(scores.dtype)",
        "",
        (
            "tests/tools/test_serve.py::test_penalties_are_the_apis",
            "tests/tools/test_serve.py::test_sampled_penalties_come_before_the_temperature_and_the_cuts",
        ),
    ),
    Mutation(
        "a sampled request's temperature and cuts stay in generate()'s config, before the penalties",
        "modeling_gpn/serve/generation.py",
        "            config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0\n",
        "",
        ("tests/tools/test_serve.py::test_sampled_penalties_come_before_the_temperature_and_the_cuts",),
    ),
    Mutation(
        "a Responses API answer cut at max_output_tokens says completed (not streamed)",
        "modeling_gpn/serve/handlers.py",
        '            if not stopped and len(ids) >= (gen_config.max_new_tokens or float("inf")):\n                _mark_incomplete(body)\n',
        "",
        ("tests/tools/test_serve.py::test_a_response_cut_at_max_output_tokens_is_incomplete",),
    ),
    Mutation(
        "a Responses API answer that ended on EOS at max_output_tokens is called incomplete (not streamed)",
        "modeling_gpn/serve/handlers.py",
        "            if not stopped and len(ids) >=",
        "            if len(ids) >=",
        ("tests/tools/test_serve.py::test_a_response_cut_at_max_output_tokens_is_incomplete",),
    ),
    Mutation(
        "a streamed Responses API answer cut at max_output_tokens ends in response.completed",
        "modeling_gpn/serve/handlers.py",
        '                                data["type"] = "response.incomplete"\n                                _mark_incomplete(whole)\n',
        "                                pass  # MUTATION\n",
        ("tests/tools/test_serve.py::test_a_response_cut_at_max_output_tokens_is_incomplete",),
    ),
    Mutation(
        "a streamed Responses API answer that ended on EOS at max_output_tokens is called incomplete",
        "modeling_gpn/serve/handlers.py",
        "if made >= max_new_tokens and not _ended_on(model, total, ends):",
        "if made >= max_new_tokens:",
        ("tests/tools/test_serve.py::test_a_response_cut_at_max_output_tokens_is_incomplete",),
    ),
    Mutation(
        "gpn serve refuses stop: [] (vLLM's default) instead of reading it as no stop sequence",
        "modeling_gpn/serve/validation.py",
        "    if stop is not None and stop != []:",
        "    if stop is not None:  # MUTATION",
        ("tests/tools/test_serve.py::test_an_empty_stop_list_is_no_stop_sequence",),
    ),
    Mutation(
        "gpn serve hands an empty stop list on to transformers",
        "modeling_gpn/serve/handlers.py",
        '            del body["stop"]  #',
        "            pass  # MUTATION",
        ("tests/tools/test_serve.py::test_an_empty_stop_list_is_no_stop_sequence",),
    ),
    Mutation(
        "a GPN that device_map splits over several places, or offloads, is loaded without a word",
        "modeling_gpn/sharding.py",
        '    if len(places) < 2 and "disk" not in places:\n',
        "    if True:  # MUTATION\n",
        ("tests/ecosystem/test_ecosystem.py::test_a_model_offloaded_to_disk_by_device_map_runs_and_generates",),
    ),
    Mutation(
        "from_pretrained never says where device_map placed a GPN",
        "modeling_gpn/modeling_gpn.py",
        "        if warning is not None:\n            logger.warning(warning)\n",
        "",
        ("tests/ecosystem/test_ecosystem.py::test_a_model_offloaded_to_disk_by_device_map_runs_and_generates",),
    ),
    Mutation(
        "a compiled decode step continues the count of positions an eager prefill read (restarted at 0)",
        "modeling_gpn/cache.py",
        "            seen = torch.tensor(seen, dtype=torch.int64)\n",
        "            seen = torch.zeros((), dtype=torch.int64)  # MUTATION\n",
        ("tests/model/test_generate.py::test_a_compiled_decode_step_counts_the_positions_an_eager_prefill_read",),
    ),
    Mutation(
        "generate() refuses non-finite prompt logits (NaN weights or embeddings decoded in silence)",
        "modeling_gpn/modeling_gpn.py",
        "        refuse_non_finite_prompt_logits(\n            self,\n",
        "        (lambda *args, **kwargs: None)(  # MUTATION\n            self,\n",
        ("tests/model/test_generate.py -k non_finite_logits_are_refused",),
    ),
    Mutation(
        "generate() checks the prompt's and the mask's shapes (IndexError from transformers; all-ones mask ignored)",
        "modeling_gpn/modeling_gpn.py",
        "        check_generate_input_shapes(args[0] if args",
        "        (lambda *args: None)(args[0] if args",
        ("tests/model/test_generate.py::test_prompts_and_masks_of_the_wrong_shape_are_refused_by_name",),
    ),
    Mutation(
        "a given state repeated for num_return_sequences (its rows left one a prompt)",
        "modeling_gpn/generation.py",
        "    repeat = copies if copies > 1 and cache.state_layer.batch_size * copies == prompt_rows else 1\n",
        "    repeat = 1  # MUTATION\n",
        ("tests/model/test_generate.py -k sampling_several_sequences_from_a_given_state",),
    ),
    Mutation(
        "an exported program stores the state out of place (it wrote the given cache's buffers, not its count)",
        "modeling_gpn/cache.py",
        "        out_of_place = is_exporting()\n",
        "        out_of_place = False  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::"
            "test_torch_export_save_load_round_trips_dynamic_programs_that_take_and_return_the_cache",
        ),
    ),
    Mutation(
        "torch.jit.script of a GPN is refused by name (it failed on \"Unknown type annotation: 'str | None'\")",
        "modeling_gpn/modeling_gpn.py",
        "    def __prepare_scriptable__(self):\n",
        "    def _no_prepare_scriptable(self):  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::test_transformers_executorch_exporter_and_torchscript_are_refused_by_name",
        ),
    ),
    Mutation(
        "an exported program adds the norms' epsilons as tensors (ONNX's optimizer dropped a scalar 1e-12: NaN)",
        "modeling_gpn/modeling_gpn.py",
        "    if is_exporting():\n        return total + total.new_full((1,), eps)\n",
        "",
        ("tests/ecosystem/test_ecosystem.py::test_torch_export_and_its_onnx_export_match_eager_and_return_the_cache",),
    ),
    Mutation(
        "the few-row kernels' row limit is not compared under tracing (an exported program guarded on its batch)",
        "modeling_gpn/fast_recurrence.py",
        "    return (\n        x.dtype == torch.float32\n",
        "    return (\n        1 <= x.numel() // max(1, x.shape[-1]) <= MAX_STEP_ROWS  # MUTATION\n        and x.dtype == torch.float32\n",
        (
            "tests/ecosystem/test_ecosystem.py::"
            "test_torch_export_save_load_round_trips_dynamic_programs_that_take_and_return_the_cache",
        ),
    ),
    Mutation(
        "the one-call decode counts its positions out of place (a traced program's count may be an inference tensor)",
        "modeling_gpn/cache.py",
        "        layer.seen_tokens = layer.seen_tokens + token_ids.shape[1]\n",
        "        layer.seen_tokens += token_ids.shape[1]  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::"
            "test_torch_export_save_load_round_trips_dynamic_programs_that_take_and_return_the_cache",
        ),
    ),
    Mutation(
        "generate() compiles a GPN's decoding forward only when asked (transformers compiles it on CUDA)",
        "modeling_gpn/modeling_gpn.py",
        "        if generation_config.compile_config is None:\n            return False\n",
        "",
        ("tests/model/test_generate.py::test_generate_compiles_the_decoding_forward_only_when_asked",),
    ),
    Mutation(
        "a GPN as the draft model of assisted decoding refused (left to fail in transformers' crop)",
        "modeling_gpn/generation.py",
        '    if getattr(generation_config, "is_assistant", False):\n',
        "    if False:  # MUTATION\n",
        ("tests/model/test_generate.py::test_a_gpn_as_the_draft_model_of_assisted_decoding_is_refused_clearly",),
    ),
    Mutation(
        "generate() refuses generation values wrong in silence (0 sequences, eos/pad outside the vocabulary, beams' giant allocation)",
        "modeling_gpn/generation.py",
        "    check_generation_values(config, generation_config, batch_size, device)\n",
        "",
        ("tests/model/test_generate.py::test_generation_values_that_would_be_wrong_in_silence_are_refused_by_name",),
    ),
    Mutation(
        "integer or boolean inputs_embeds refused (cast and run in silence)",
        "modeling_gpn/modeling_gpn.py",
        "            if not inputs_embeds.dtype.is_floating_point:",
        "            if False:  # MUTATION",
        ("tests/model/test_roundtrip_and_errors.py::test_inputs_embeds_that_are_not_floating_point_are_refused",),
    ),
    Mutation(
        "a mask over the new positions widened to the whole sequence for transformers' chunked prefill",
        "modeling_gpn/generation.py",
        "    if mask is not None and not start and mask.shape[1] == given:\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_generate.py::test_continuing_with_a_mask_over_the_new_positions_in_prefill_chunks",),
    ),
    Mutation(
        "gpn train overwrites a finished run's model and log without --resume",
        "modeling_gpn/train/training.py",
        '    elif (run_dir / "model").exists():\n',
        "    elif False:  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k finished_run_without_checkpoints",),
    ),
    Mutation(
        "gpn train takes a negative clip norm or weight decay, bad betas, eps, keep_checkpoints, threads, seed",
        "modeling_gpn/train/settings.py",
        "    for key, low, high in NUMERIC_RANGES:\n",
        "    for key, low, high in ():  # MUTATION\n",
        ("tests/tools/test_train.py -k torch_would_train_wrongly",),
    ),
    Mutation(
        "gpn train's config file with a value of another JSON type (a quoted number, null): a TypeError traceback",
        "modeling_gpn/train/settings.py",
        "        if (expected := _wrong_type(option, config[option.key]))\n",
        "        if False and _wrong_type(option, config[option.key])  # MUTATION\n",
        ("tests/tools/test_train.py -k configuration_precedence",),
    ),
    Mutation(
        "gpn train takes eps or clip norm inf (eps inf: every update 0, nothing trained, in silence)",
        "modeling_gpn/train/settings.py",
        "        if not low <= value < (high if high is not None else math.inf):\n",
        "        if not low <= value or (high is not None and not value < high):  # MUTATION\n",
        ("tests/tools/test_train.py -k torch_would_train_wrongly",),
    ),
    Mutation(
        "gpn train takes --lr inf (stopped only after the first step, unnamed)",
        "modeling_gpn/train/settings.py",
        '    if not 0 < config["lr"] < math.inf:\n',
        '    if not 0 < config["lr"]:  # MUTATION\n',
        ("tests/tools/test_train.py -k torch_would_train_wrongly",),
    ),
    Mutation(
        "gpn train takes a negative --max-tokens (trained on the corpus's first piece cut short, in silence)",
        "modeling_gpn/train/settings.py",
        'if config["max_tokens"] is not None and config["max_tokens"] < 1:',
        "if False:  # MUTATION: never checked",
        ("tests/tools/test_train.py -k torch_would_train_wrongly",),
    ),
    Mutation(
        "gpn train takes --log-interval 0 (logged every step) and --bpe-max-documents 0 (a BPE trained on no text)",
        "modeling_gpn/train/settings.py",
        '"steps", "log_interval", "bpe_max_documents"):',
        '"steps"):  # MUTATION',
        ("tests/tools/test_train.py -k torch_would_train_wrongly",),
    ),
    Mutation(
        "gpn train --resume from a damaged checkpoint file: a reader's traceback instead of the file and what to resume",
        "modeling_gpn/train/checkpoints.py",
        "    except Exception as error:  # every reader fails its own way",
        "    except () as error:  # MUTATION",
        ("tests/tools/test_train_faults.py -k damaged_checkpoint_file",),
    ),
    Mutation(
        "gpn train --mixed-precision fp16 on a CPU trains in float32 while the run says fp16",
        "modeling_gpn/train/distributed.py",
        '    if asked != "no" and not accelerator.native_amp and accelerator.distributed_type != DistributedType.DEEPSPEED:\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py -k would_not_be_applied",),
    ),
    Mutation(
        "gpn train overrides accelerate launch --mixed_precision with its own setting in silence",
        "modeling_gpn/train/distributed.py",
        '    if launched_with not in ("no", asked):\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py -k would_not_be_applied",),
    ),
    Mutation(
        "gpn train blames the disk for a process that died inside a checkpoint (Cannot write ... MiB free there)",
        "modeling_gpn/train/checkpoints.py",
        '        failure = collective_error(error, run.stage.name, run.config["ddp_timeout"]) if run.world > 1 else None\n',
        "        failure = None  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k dies_inside_a_checkpoint",),
    ),
    Mutation(
        "gpn train under FSDP2 keeps a wrap policy whose unit holds the embedding (GPNModel named: a crash in fully_shard)",
        "modeling_gpn/train/distributed.py",
        "    elif holders:\n        plugin.auto_wrap_policy = None\n",
        "    elif holders:\n        pass  # MUTATION\n",
        (
            "tests/tools/test_train.py -k naming_gpnmodel_is_dropped",
            "tests/tools/test_train.py -k fsdp2_options_accelerate and whole",
        ),
    ),
    Mutation(
        "gpn train under FSDP2 takes activation checkpointing by a policy that wraps nothing (it recomputes nothing)",
        "modeling_gpn/train/distributed.py",
        "    if plugin.activation_checkpointing and (plugin.auto_wrap_policy is None or not wrapped):\n",
        "    if plugin.activation_checkpointing and plugin.auto_wrap_policy is None:  # MUTATION\n",
        ("tests/tools/test_train.py -k fsdp2_options_accelerate and default",),
    ),
    Mutation(
        "a GPN's _no_split_modules names GPNModel (FSDP2's default policy wraps the unit that holds the embedding)",
        "modeling_gpn/modeling_gpn.py",
        "    _no_split_modules = []\n",
        '    _no_split_modules = ["GPNModel"]  # MUTATION\n',
        (
            "tests/ecosystem/test_ecosystem.py -k default_fsdp2_wrap_policy",
            "tests/tools/test_train.py -k fsdp2_with_accelerate_configs_default",
            "tests/tools/test_sft_fsdp.py",
        ),
    ),
    Mutation(
        "gpn train under FSDP2 drops SIZE_BASED_WRAP to one unit (it wraps GPNModel and the ModuleList: unshardable)",
        "modeling_gpn/train/distributed.py",
        "    if size_based and any(_why_not_a_unit(unit, model) for unit in wrapped):\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py -k fsdp2_size_based_wrap",),
    ),
    Mutation(
        "gpn train under FSDP2 on CPU trains --mixed-precision bf16 in float32 (its plugin without a precision policy)",
        "modeling_gpn/train/distributed.py",
        "            plugin.set_mixed_precision(asked)\n",
        "            pass  # MUTATION\n",
        ("tests/tools/test_train.py -k fsdp2_on_cpu_computes_in_the_runs_mixed_precision",),
    ),
    Mutation(
        "gpn train under FSDP2 in bf16 casts the float32 state entering a GPN block sharded apart (the write fails)",
        "modeling_gpn/train/distributed.py",
        "        plugin.mixed_precision_policy = dataclasses.replace(mixed, cast_forward_inputs=False)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_train.py -k fsdp2_on_cpu_computes_in_the_runs_mixed_precision",),
    ),
    Mutation(
        "a GPN block takes the state FSDP2's mixed precision cast to bf16 at its entry (rounded, or a deep failure)",
        "modeling_gpn/modeling_gpn.py",
        "        if tensor is not None and tensor.dtype != torch.float32:\n",
        "        if False:  # MUTATION\n",
        ("tests/ecosystem/test_ecosystem.py -k fsdp2_mixed_precision_casts_into_a_block",),
    ),
    Mutation(
        "the loss ignores num_items_in_batch (a mean per process and per micro-batch, not over the global batch)",
        "modeling_gpn/chunked_loss.py",
        "    if num_items_in_batch is None:\n",
        "    if True:  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py -k num_items_in_batch_makes_gradient_accumulation_exact",
            "tests/tools/test_sft_fsdp.py",
        ),
    ),
    Mutation(
        "a cache noting a GPN's weights reads only a tensor subclass's __dict__ (an FSDP2 shard's DTensor: KeyError)",
        "modeling_gpn/derived_weights.py",
        "    return held if held is not None else object.__getattribute__(tensor, name)\n",
        "    return tensor.__dict__[name]  # MUTATION\n",
        ("tests/tools/test_sft_fsdp.py",),
    ),
    Mutation(
        "FSDP2 with blocks of a GPN sharded apart takes inputs of different lengths per process (collectives mismatch)",
        "modeling_gpn/sharding.py",
        "    if longest != shortest:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_sft_fsdp.py",),
    ),
    Mutation(
        "gpn train under FSDP2 on CPU takes --fsdp_offload_params (Accelerate's traceback pinning memory)",
        "modeling_gpn/train/distributed.py",
        "    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and on_cpu:",
        "    if False:  # MUTATION",
        ("tests/tools/test_train.py -k fsdp2_options_accelerate and offload",),
    ),
    Mutation(
        "gpn train under FSDP2 takes activation checkpointing without a wrap policy (Accelerate's TypeError)",
        "modeling_gpn/train/distributed.py",
        "    if plugin.activation_checkpointing and (plugin.auto_wrap_policy is None or not wrapped):\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py -k fsdp2_options_accelerate and checkpointing",),
    ),
    Mutation(
        "gpn train --help does not say how to start several processes (on CPU: ACCELERATE_USE_CPU=1 --multi_gpu)",
        "modeling_gpn/train/cli.py",
        "(the paper's run).\" + MULTI_PROCESS_HELP\n",
        "(the paper's run).\"  # MUTATION\n",
        ("tests/tools/test_train.py -k configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train --resume takes a corpus that changed under the same name",
        "modeling_gpn/train/checkpoints.py",
        "    if saved_data is not None and saved_data != data:  # (checkpoints of older versions hold none)\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k corpus_that_changed",),
    ),
    Mutation(
        "gpn train --no-progress still shows transformers' bar while the model is saved",
        "modeling_gpn/train/training.py",
        "    if not run.show_progress:\n        transformers_logging.disable_progress_bar()\n",
        "    if False:  # MUTATION\n        transformers_logging.disable_progress_bar()\n",
        ("tests/tools/test_train_faults.py -k quiet_run_prints_no_bar",),
    ),
    Mutation(
        "gpn train leaves the tied copy to Accelerate's save, which warns at every checkpoint",
        "modeling_gpn/train/checkpoints.py",
        "    drop_tied_copies(weights, accelerator.unwrap_model(model))\n",
        "    pass  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k quiet_run_prints_no_bar",),
    ),
    Mutation(
        "gpn train into an output folder it cannot write: a traceback from the lock file",
        "modeling_gpn/train/run_folder.py",
        "        except OSError as error:  # the first write of a run",
        "        except () as error:  # MUTATION",
        ("tests/tools/test_train_faults.py -k output_folder_that_cannot_be_written",),
    ),
    Mutation(
        "gpn train --resume in one process starts the optimizer afresh (its moments not loaded)",
        "modeling_gpn/train/checkpoints.py",
        "        optimizer.load_state_dict(optimizer_state)\n",
        "        pass  # MUTATION\n",
        (
            "tests/tools/test_train.py -k resume_after_sigkill",
            "tests/tools/test_train_faults.py -k sigterm_and_sigint",
        ),
    ),
    Mutation(
        "gpn train takes over the lock of a run that was killed without a word",
        "modeling_gpn/train/run_folder.py",
        "        if previous.strip() and warn:\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k killed_runs_lock_is_taken_over",),
    ),
    Mutation(
        "gpn train writes a bare NaN (no JSON) into log.jsonl",
        "modeling_gpn/train/run_folder.py",
        "        key: str(value) if isinstance(value, float) and not math.isfinite(value) else value\n",
        "        key: value  # MUTATION\n",
        ("tests/tools/test_train_faults.py -k log_is_strict_json",),
    ),
    Mutation(
        "gpu_check's summary: a stage that crashed after some [ok] lines is not reported ok",
        "benchmarks/gpu_check.py",
        '        finished = "all checks passed" in text or "check(s) failed" in text\n',
        "        finished = True  # MUTATION\n",
        (
            "tests/tools/test_gpu_check_report.py::test_a_stage_that_crashed_after_some_checks_passed_is_not_reported_ok",
        ),
    ),
    Mutation(
        "gpu_check's summary notes a stage's non-zero exit (not only timeouts and skips)",
        "benchmarks/gpu_check.py",
        '            elif stage["exit"] != 0:  # a failed check exits 1;',
        "            elif False:  # MUTATION;",
        (
            "tests/tools/test_gpu_check_report.py::test_a_stage_that_crashed_after_some_checks_passed_is_not_reported_ok",
        ),
    ),
    Mutation(
        "decoded tokens through the decode graph (only windows of 2+ tokens take the graphs)",
        "modeling_gpn/fast_recurrence.py",
        "        if not needs_grad and matmul_dtype is None:\n",
        "        if not needs_grad and matmul_dtype is None and U.shape[1] > 1:  # MUTATION\n",
        ("tests/fast_path/test_triton_kernels.py::test_generate_through_the_decode_graph_equals_plain",),
    ),
    Mutation(
        "gpu_check's dry run takes the CUDA route on CPU (the C kernels off)",
        "benchmarks/gpu_check.py",
        '    os.environ["GPN_MEMORY_KERNELS"] = "0"\n',
        "    pass  # MUTATION\n",
        ("tests/tools/test_gpu_check_report.py::test_the_dry_run_times_the_decode_step_on_the_route_a_gpu_takes",),
    ),
    Mutation(
        "gpn serve: chat to a model without a chat template is a 400 (transformers: a 500)",
        "modeling_gpn/serve/handlers.py",
        '        if self.renders_chat and getattr(processor, "chat_template", None) is None:\n',
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k without_a_chat_template",),
    ),
    Mutation(
        "gpn serve's missing-extra hint installs from the repository, not PyPI's unrelated gpn",
        "modeling_gpn/serve/cli.py",
        "pip install -e '.[serving]' in the gpn repository",
        "pip install 'gpn[serving]'  # MUTATION",
        ("tests/tools/test_docs.py -k unrelated_gpn",),
    ),
    Mutation(
        "gpn train --help leaves out '[built-in: None]' (the option's help says what unset means)",
        "modeling_gpn/train/cli.py",
        '        built_in = "" if option.default is None else f" [built-in: {option.default}]"\n',
        '        built_in = f" [built-in: {option.default}]"  # MUTATION\n',
        ("tests/tools/test_docs.py -k training_programs_own_help",),
    ),
    Mutation(
        "the model card's kernel note names the step kernels (not only the memory update)",
        "modeling_gpn/hub/model_card.py",
        '"half of a step and its gradient, and the whole no-grad step of 1 to 16 rows: a prompt\'s prefill and every "\n    "decoded token) with',
        '"half of a step and its gradient) with',
        ("tests/fast_path/test_kernel_safety.py -k model_card_says",),
    ),
    Mutation(
        "the token cache keyed by a local file's mtime alone (a rewrite given its old mtime reuses stale tokens)",
        "modeling_gpn/data/corpus.py",
        "stat.st_mtime_ns), int(stat.st_ctime_ns)])",
        "stat.st_mtime_ns)])  # MUTATION",
        ("tests/tools/test_faults_io.py -k rewritten_with_its_old_mtime",),
    ),
    Mutation(
        "gpn eval --fineweb-held-out-fraction reads only the first 2000 documents (scores training windows)",
        "eval/cli.py",
        "    if args.fineweb_held_out_fraction is not None:\n",
        "    if False:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py -k held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "fineweb_paper's stream keeps blank documents that gpn train's leaves out (held-out windows shifted)",
        "eval/protocols.py",
        "        if not text.strip():  # as gpn train",
        "        if False:  # MUTATION",
        ("tests/ecosystem/test_eval.py -k leaves_out_blank_documents",),
    ),
    Mutation(
        "an unwritable token / tokenizer cache folder is a traceback",
        "modeling_gpn/data/cache.py",
        "        raise cache_write_error(folder, error) from error\n",
        "        raise  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k cache_folder_that_cannot_be_written",),
        occurrences=2,
    ),
    Mutation(
        "a corpus folder's .ipynb_checkpoints/ and __MACOSX/ copies read as training files",
        "modeling_gpn/data/corpus.py",
        "and not hidden(p.relative_to(root))",
        "and True  # MUTATION",
        ("tests/tools/test_faults_io.py -k hidden_and_special_folders",),
    ),
    Mutation(
        "gpn inspect --data FOLDER searches the folder on its own (Jupyter's copies read, csv left out)",
        "modeling_gpn/inspect/inputs.py",
        '    return spec.local_files() if spec.kind == "local" else None\n',
        '    return sorted(p for p in Path(data).rglob("*") if p.is_file() and p.suffix in LOCAL_EXTENSIONS) or None  # MUTATION\n',
        ("tests/tools/test_inspect.py -k exactly_the_files_gpn_train_reads",),
    ),
    Mutation(
        "gpn train leaves out the .text files gpn inspect reads",
        "modeling_gpn/data/corpus.py",
        '    ".text": "text",\n',
        "",
        ("tests/tools/test_inspect.py -k exactly_the_files_gpn_train_reads",),
    ),
    Mutation(
        "a Hub dataset's token cache not keyed by the commit its revision names (an updated dataset reuses it)",
        "modeling_gpn/data/corpus.py",
        '            "commit": self.hub_commit(),\n',
        "",
        ("tests/tools/test_faults_io.py -k cached_per_commit",),
    ),
    Mutation(
        "a Hub dataset's token cache not keyed by the revision asked for (where no commit can be told)",
        "modeling_gpn/data/corpus.py",
        '            "revision": self.revision,\n',
        "",
        ("tests/tools/test_faults_io.py -k cached_per_commit",),
    ),
    Mutation(
        "a Hub dataset read at the branch's newest commit, not the one its cache is keyed by",
        "modeling_gpn/data/corpus.py",
        "    revision = spec.hub_commit() or spec.revision",
        "    revision = spec.revision  # MUTATION",
        ("tests/tools/test_faults_io.py -k cached_per_commit",),
    ),
    Mutation(
        "gpn train --dataset-revision ignored",
        "modeling_gpn/train/training.py",
        '        revision=config["dataset_revision"],\n',
        "",
        ("tests/tools/test_faults_io.py -k cached_per_commit",),
    ),
    Mutation(
        "gpn train --dataset 'data/*.jsonl' taken for a Hub id",
        "modeling_gpn/data/corpus.py",
        'self.source.startswith((".", "/", "~")) or self.is_glob:',
        'self.source.startswith((".", "/", "~")):  # MUTATION',
        ("tests/tools/test_faults_io.py -k dataset_glob_reads",),
    ),
    Mutation(
        "a token cache shard overwritten with valid ids (zeros) read as the corpus",
        "modeling_gpn/data/stream.py",
        "            if shard_sample_digest(shard) != expected:\n",
        "            if False:  # MUTATION\n",
        ("tests/tools/test_faults_io.py::test_a_damaged_token_cache_names_the_file_and_how_to_rebuild[zeroed]",),
    ),
    Mutation(
        "gpn inspect's error for a non-UTF-8 or non-text corpus names no file",
        "modeling_gpn/data/corpus.py",
        '    except UnicodeDecodeError as error:\n        raise DataError(f"Cannot read training file {path}: it is not UTF-8',
        '    except LookupError as error:\n        raise DataError(f"Cannot read training file {path}: it is not UTF-8',
        ("tests/tools/test_inspect.py -k rejects_bad_input",),
    ),
    Mutation(
        "gpn inspect tokenizes a long text file's pieces each on its own (not as the whole file, as gpn train does)",
        "modeling_gpn/inspect/inputs.py",
        "            new = encoder.encode([(text, continues)])[0]\n",
        '            new = tokenizer(text, add_special_tokens=False)["input_ids"]  # MUTATION\n',
        ("tests/tools/test_inspect.py -k long_text_file",),
    ),
    Mutation(
        "gpn train says nothing when a trained BPE is smaller than --bpe-vocab-size",
        "modeling_gpn/train/training.py",
        '        if config["tokenizer"] == "bpe" and len(tokenizer) < config["bpe_vocab_size"]:\n',
        "        if False:  # MUTATION\n",
        ("tests/tools/test_train.py -k bpe_smaller",),
    ),
    Mutation(
        "an attention implementation asked of a GPN left to transformers' 'request support' message",
        "modeling_gpn/modeling_gpn.py",
        '        if attn_implementation not in (None, "eager"):\n',
        "        if False:  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py -k attention_implementation_is_refused",),
    ),
    Mutation(
        "packed sequences shorter than the input not explained (PEFT's prompt tuning in front of a packed batch)",
        "modeling_gpn/packing.py",
        "                if first == 0 and 0 < last < total\n",
        "                if False  # MUTATION\n",
        ("tests/model/test_packed.py -k inconsistent_packing_arguments and arguments0",),
    ),
    Mutation(
        "cu_seq_lens cut to one entry not explained (Accelerate's batch dispatcher, Trainer's for an IterableDataset)",
        "modeling_gpn/packing.py",
        '            + ("; " + DISPATCHER_CUT.format(name=name) if cu_seq_lens.dim() == 1 else "")\n',
        "",
        ("tests/model/test_packed.py -k inconsistent_packing_arguments and arguments13",),
    ),
    Mutation(
        "packed sequences shorter than the input: Accelerate's batch dispatcher not named beside prompt tuning",
        "modeling_gpn/packing.py",
        '"tokens so): pack without prompt tuning, or train it on padded batches; "\n'
        "                + DISPATCHER_CUT.format(name=name)\n",
        '"tokens so): pack without prompt tuning, or train it on padded batches; "  # MUTATION\n',
        ("tests/model/test_packed.py -k inconsistent_packing_arguments and arguments0",),
    ),
    Mutation(
        "position ids longer than the input are refused unless continuing a cache (their last columns taken)",
        "modeling_gpn/packing.py",
        "            or (columns > seq_len and not continuing)\n",
        "",
        ("tests/model/test_packed.py -k inconsistent_packing_arguments and arguments11",),
    ),
    Mutation(
        "continuing a cache, longer position ids are taken (their last columns)",
        "modeling_gpn/modeling_gpn.py",
        "device=embeddings.device, continuing=state is not None\n",
        "device=embeddings.device, continuing=False  # MUTATION\n",
        ("tests/model/test_packed.py -k cache_continues_the_last_packed",),
    ),
    Mutation(
        "the causal LM's forward takes position_ids and seq_idx as keywords (Trainer drops a pre-packed dataset's columns)",
        "modeling_gpn/modeling_gpn.py",
        "        *,\n        position_ids: torch.LongTensor | None = None,\n        seq_idx: torch.Tensor | None = None,\n"
        "        **kwargs,\n    ) -> GPNCausalLMOutput | tuple:\n",
        "        **kwargs,\n    ) -> GPNCausalLMOutput | tuple:\n"
        '        position_ids, seq_idx = kwargs.pop("position_ids", None), kwargs.pop("seq_idx", None)  # MUTATION\n',
        ("tests/model/test_packed.py -k pre_packed_datasets_packing_column",),
    ),
    Mutation(
        "generate() builds position ids for a GPN from the attention mask (as for any forward naming them)",
        "modeling_gpn/modeling_gpn.py",
        'are passed on as given."""\n        return None\n',
        'are passed on as given."""\n'
        "        return super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)  # MUTATION\n",
        (
            "tests/fast_path/test_decode_call.py -k generate_decodes_in_one_call",
            "tests/model/test_generate.py -k a_decoded_tokens_inputs_are_transformers_own",
        ),
    ),
    Mutation(
        "generate() drops the position ids its caller passes (a packed prompt runs as one sequence)",
        "modeling_gpn/modeling_gpn.py",
        "            is_first_iteration=is_first_iteration,\n            position_ids=position_ids,\n",
        "            is_first_iteration=is_first_iteration,\n",
        ("tests/model/test_packed.py -k generate_from_a_packed_prompt",),
    ),
    Mutation(
        "gpn train reads no csv corpus",
        "modeling_gpn/data/corpus.py",
        '    ".csv": "csv",\n',
        "",
        ("tests/tools/test_train.py -k every_row_format",),
    ),
    Mutation(
        "gpn generate --sample ignores the model's own sampling settings (generation_config.json)",
        "modeling_gpn/cli/generate.py",
        "    own = model.generation_config.to_diff_dict().get(name)\n",
        "    own = None  # MUTATION\n",
        ("tests/tools/test_generate_cli.py -k models_own",),
    ),
    Mutation(
        "a state file names quantized weights by their float dtype alone (int8 refused as 'bfloat16')",
        "modeling_gpn/state_file.py",
        "    return f\"{dtype}, quantized ({', '.join(quantized)})\" if quantized else dtype\n",
        "    return dtype  # MUTATION\n",
        ("tests/model/test_state.py -k quantized_weights",),
    ),
    Mutation(
        "gpn serve exits 0 after a Ctrl-C in a process started with SIGINT ignored (uvicorn re-raises into SIG_IGN)",
        "modeling_gpn/serve/cli.py",
        "    previous = signal.signal(signal.SIGINT, note)\n",
        "    previous = signal.getsignal(signal.SIGINT)  # MUTATION\n",
        ("tests/tools/test_serve.py -k ctrl_c_exits_130_in_a_process",),
    ),
    Mutation(
        "gpn inspect's jsonl row of a number reaches the tokenizer",
        "modeling_gpn/inspect/inputs.py",
        "        if text is not None and not isinstance(text, str):",
        "        if False:  # MUTATION",
        ("tests/tools/test_inspect.py -k rejects_bad_input",),
    ),
    Mutation(
        "fineweb_paper's held-out windows read with eval's own reader, not gpn train's (no folders)",
        "eval/runner.py",
        "            elif settings.fineweb_held_out_fraction is not None and (corpus := training_corpus(source, settings)):",
        "            elif False:  # MUTATION",
        ("tests/ecosystem/test_eval.py -k held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "gpn eval --fineweb-held-out-fraction on a Hub corpus without --fineweb-max-tokens streams all of it",
        "eval/runner.py",
        "        and settings.fineweb_max_tokens is None\n",
        "        and False  # MUTATION\n",
        ("tests/ecosystem/test_eval.py -k held_out_windows_of_a_real_corpus",),
    ),
    Mutation(
        "a killed tokenization's temporary folder left in the cache for good",
        "modeling_gpn/data/cache.py",
        "        remove_abandoned_writes(folder, tmp)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k killed_write_of_the_token_cache",),
    ),
    Mutation(
        "a live writer's temporary cache folder deleted by another run",
        "modeling_gpn/data/cache.py",
        "                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "                pass  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k killed_write_of_the_token_cache",),
    ),
    Mutation(
        "gpn bench's counts, device and --json checked only once models are built (tracebacks, or after the run)",
        "modeling_gpn/bench/command.py",
        "    check_arguments(args)\n",
        "    pass  # MUTATION\n",
        ("tests/tools/test_bench.py -k refused_before_any_model",),
    ),
    Mutation(
        "gpn bench --json written straight into the file (an interrupted write leaves half a document, unsynced)",
        "modeling_gpn/bench/command.py",
        '    with replacing(path, "w") as handle:\n',
        '    with open(path, "w") as handle:  # MUTATION\n',
        (
            "tests/tools/test_bench.py::test_an_interrupted_json_write_leaves_no_half_file",
            "tests/tools/test_bench.py::test_the_json_report_is_synced_and_a_failed_write_names_it",
        ),
    ),
    Mutation(
        "an atomic write renames its file into place unsynced (gpn bench --json, the state file, gpn train's files)",
        "modeling_gpn/atomic_files.py",
        "            os.fsync(handle.fileno())\n",
        "            pass  # MUTATION\n",
        ("tests/tools/test_bench.py::test_the_json_report_is_synced_and_a_failed_write_names_it",),
    ),
    Mutation(
        "an atomic write leaves its rename unsynced (the folder is not fsynced)",
        "modeling_gpn/atomic_files.py",
        "        fsync(path.parent)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_bench.py::test_the_json_report_is_synced_and_a_failed_write_names_it",),
    ),
    Mutation(
        "an atomic write removes a temporary file it never made (on a read-only file system that fails, naming it)",
        "modeling_gpn/atomic_files.py",
        "        if created:\n",
        "        if True:  # MUTATION\n",
        ("tests/model/test_state.py -k read_only_or_full",),
    ),
    Mutation(
        "gpn generate --save-state refuses a path that is a folder, device or pipe before generating",
        "modeling_gpn/cli/generate.py",
        "        if Path(args.save_state).expanduser().exists() and not Path(args.save_state).expanduser().is_file():\n",
        "        if False:  # MUTATION\n",
        ("tests/model/test_state.py -k bad_state_is_one_clear_line and save-to-folder",),
    ),
    Mutation(
        "gpn generate --save-state refuses a folder it cannot write in before generating",
        "modeling_gpn/cli/generate.py",
        '            writable_folder(folder, "--save-state")\n',
        "            pass  # MUTATION\n",
        ("tests/model/test_state.py -k read_only_or_full",),
    ),
    Mutation(
        "gpn generate prints its text before saving the state (a failed save loses the state, not the text)",
        "modeling_gpn/cli/generate.py",
        "    for prompt, row, mask in zip(args.prompts, output, prompt_mask):\n",
        "    if args.save_state is not None:  # MUTATION: the state saved first, as before\n"
        "        try:\n"
        "            text_mask = _text_mask(prompt_mask, output[:, prompt_width:], model.generation_config.eos_token_id)\n"
        "            _save_state(args, model, start, output, text_mask)\n"
        "        except GenerateError as error:\n"
        '            print(f"gpn generate: error: {error}", file=sys.stderr)\n'
        "            return 2\n"
        "    for prompt, row, mask in zip(args.prompts, output, prompt_mask):\n",
        ("tests/model/test_state.py -k read_only_or_full",),
    ),
    Mutation(
        "an atomic write refuses to put a file in place of a device, pipe or socket (root replaced /dev/full)",
        "modeling_gpn/atomic_files.py",
        "    if existing is not None and not (stat.S_ISREG(existing) or stat.S_ISDIR(existing)):\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_state.py::test_a_pipe_is_refused_by_name_without_being_read",),
    ),
    Mutation(
        "an atomic write that fails leaves its temporary file behind",
        "modeling_gpn/atomic_files.py",
        "            temporary.unlink(missing_ok=True)\n",
        "            pass  # MUTATION\n",
        (
            "tests/tools/test_bench.py::test_an_interrupted_json_write_leaves_no_half_file",
            "tests/model/test_state.py -k cut_short",
            "tests/tools/test_train_faults.py::test_log_rewrite_on_resume_is_write_then_rename",
        ),
    ),
    Mutation(
        "gpn generate decodes the new tokens alone (a SentencePiece continuation loses its leading space)",
        "modeling_gpn/cli/generate.py",
        '        print(f"{prompt}{continuation(tokenizer, prompt_ids, row[prompt_width:])}")\n',
        '        print(f"{prompt}{tokenizer.decode(row[prompt_width:], skip_special_tokens=True)}")  # MUTATION\n',
        ("tests/tools/test_generate_cli.py::test_a_sentencepiece_continuation_keeps_its_space",),
    ),
    Mutation(
        "gpn generate --seed of 2**64 or more: generate()'s 'Overflow when unpacking long long'",
        "modeling_gpn/cli/generate.py",
        "    if not 0 <= args.seed < 2**64:",
        "    if not 0 <= args.seed:  # MUTATION",
        ("tests/tools/test_faults_io.py -k generate_bad_arguments and huge-seed",),
    ),
    Mutation(
        "gpn generate --temperature inf taken (every token equally likely)",
        "modeling_gpn/cli/generate.py",
        "not 0 < args.temperature < math.inf:",
        "not 0 < args.temperature:  # MUTATION",
        ("tests/tools/test_faults_io.py -k generate_bad_arguments and infinite-temperature",),
    ),
    Mutation(
        "gpn bench with --decode-batches none: generate()'s limit ratios printed, their bytes null in the JSON",
        "modeling_gpn/bench/measure.py",
        '                rows[kind].limit_bytes, rows[kind].limit_probe = probes["limit"].nbytes, probes["limit"].kind\n',
        "                pass  # MUTATION\n",
        ("tests/tools/test_bench.py::test_bench_measures_int4_weights_on_the_fast_path",),
    ),
    Mutation(
        "gpn bench states only the steps' limit after the table (none without steps, not generate()'s reads)",
        "modeling_gpn/bench/report.py",
        "        for n, ms in r.limit_ms_at.items():\n",
        "        for n, ms in {}.items():  # MUTATION\n",
        ("tests/tools/test_bench.py::test_bench_measures_int4_weights_on_the_fast_path",),
    ),
    Mutation(
        "byte_limit_table.py takes one fast row a report (a report of two presets stopped it)",
        "benchmarks/byte_limit_table.py",
        "        for row in fast:  # (one per preset",
        "        for row in fast[-1:]:  # MUTATION (one per preset",
        ("tests/tools/test_bench.py::test_bench_reports_every_implementation",),
    ),
    Mutation(
        "byte_limit_table.py prints 0 tok/s for a batch not measured",
        "benchmarks/byte_limit_table.py",
        'if str(b) in row["batch_tok_s"] else "-" for b in (4, 16)]',
        'if str(b) in row["batch_tok_s"] else "0" for b in (4, 16)]  # MUTATION',
        ("tests/tools/test_bench.py::test_bench_reports_every_implementation",),
    ),
    Mutation(
        "gpn bench --help explains only the byte limit's columns",
        "modeling_gpn/bench/command.py",
        ' + LIMIT_HELP + "\\n\\n" + COLUMNS_HELP\n',
        " + LIMIT_HELP  # MUTATION\n",
        ("tests/tools/test_bench.py::test_help_explains_every_column",),
    ),
    Mutation(
        "gpn bench's GFLOP/s count a GPN's tied head twice (as the linear and again as the embedding)",
        "modeling_gpn/bench/models.py",
        "        return 2.0 * linear + (6 + 2 * config.num_predict_layers) * config.memory_cells\n",
        "        return 2.0 * (linear + model.get_input_embeddings().weight.numel()) + (6 + 2 * config.num_predict_layers) * config.memory_cells  # MUTATION\n",
        ("tests/tools/test_bench.py::test_gflops_count_each_weight_once",),
    ),
    Mutation(
        "gpn bench's GFLOP/s count half of a Llama's attention (q.K or the weighted sum of V, not both)",
        "modeling_gpn/bench/models.py",
        "    return 2.0 * linear + 2.0 * 2 * config.num_hidden_layers * context * config.hidden_size\n",
        "    return 2.0 * linear + 2.0 * config.num_hidden_layers * context * config.hidden_size  # MUTATION\n",
        ("tests/tools/test_bench.py::test_gflops_count_each_weight_once",),
    ),
    Mutation(
        "gpn bench's cache @N: the cache generate() ended with (N + --decode-tokens - 1 positions)",
        "modeling_gpn/bench/timing.py",
        "        output = model(input_ids=prompt, use_cache=True, logits_to_keep=1)\n",
        "        output = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)  # MUTATION\n",
        ("tests/tools/test_bench.py::test_bench_reports_every_implementation",),
    ),
    Mutation(
        "gpn bench --batch / --seq-len / --segment-length with --skip-training ignored in silence",
        "modeling_gpn/bench/command.py",
        "    if args.skip_training and given:",
        "    if False:  # MUTATION",
        (
            "tests/tools/test_bench.py::test_bad_arguments_are_refused_before_any_model_is_built[batch-without-training]",
            "tests/tools/test_bench.py::test_bad_arguments_are_refused_before_any_model_is_built"
            "[training-options-without-training]",
        ),
    ),
    Mutation(
        "gpn bench --decode-prompt-lengths 4 4 measures 4 twice (its columns and ratios printed twice)",
        "modeling_gpn/bench/command.py",
        "    if repeated:  # (measured twice, its columns",
        "    if False:  # MUTATION (measured twice, its columns",
        ("tests/tools/test_bench.py::test_bad_arguments_are_refused_before_any_model_is_built[repeated-length]",),
    ),
    Mutation(
        "gpn bench's report of a --skip-training run names the batch and length it did not train",
        "modeling_gpn/bench/command.py",
        "        if not args.skip_training\n",
        "        if True  # MUTATION\n",
        ("tests/tools/test_bench.py::test_bench_states_every_batch_one_figure_against_its_byte_limit",),
    ),
    Mutation(
        "gpn bench --memory-seq-lens with --skip-training ignored in silence",
        "modeling_gpn/bench/command.py",
        "    if args.skip_training and args.memory_seq_lens:",
        "    if False:  # MUTATION",
        ("tests/tools/test_bench.py -k refused_before_any_model and memory-without-training",),
    ),
    Mutation(
        "gpn bench finds a --json folder that cannot hold a file only after the whole run (a traceback)",
        "modeling_gpn/bench/command.py",
        "            tempfile.TemporaryFile(dir=folder).close()",
        "            pass  # MUTATION",
        ("tests/tools/test_bench.py -k refused_before_any_model and json-in-no-file-folder",),
    ),
    Mutation(
        "gpn bench's unreadable preset config as a traceback",
        "modeling_gpn/bench/command.py",
        "        except (OSError, ValueError) as error:  # (a file that is not JSON",
        "        except NotImplementedError as error:  # MUTATION (a file that is not JSON",
        ("tests/tools/test_bench.py::test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured",),
    ),
    Mutation(
        "gpn bench's table rounds figures below 1 to two decimals (a small model's limit ms: 0.00)",
        "modeling_gpn/bench/report.py",
        "    if 0 < abs(value) < 1:",
        "    if False:  # MUTATION",
        ("tests/tools/test_bench.py::test_figures_below_one_keep_their_digits_in_the_table",),
    ),
    Mutation(
        "gpn bench's Ctrl-C loses the presets measured before it",
        "modeling_gpn/bench/command.py",
        "        report(rows, args, interrupted=True)\n",
        "        raise  # MUTATION\n",
        ("tests/tools/test_bench.py::test_ctrl_c_reports_the_presets_measured_before_it",),
    ),
    Mutation(
        "a preset file of another model (a Llama's config.json) loads as a GPN of the default sizes",
        "configuration/__init__.py",
        "    if declared != GPNConfig.model_type:",
        "    if False:  # MUTATION",
        (
            "tests/tools/test_bench.py::test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured"
            "[llama-config]",
        ),
    ),
    Mutation(
        "gpn bench with nothing to measure runs (an empty table)",
        "modeling_gpn/bench/command.py",
        "    if args.skip_training and not args.decode_prompt_lengths and not args.decode_batches:",
        "    if False:  # MUTATION",
        ("tests/tools/test_bench.py -k refused_before_any_model and nothing-to-measure",),
    ),
    Mutation(
        "gpn generate - taken as the prompt '-' (not read from standard input)",
        "modeling_gpn/cli/generate.py",
        "        args.prompts = read_stdin_prompt(args.prompts)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_generate_cli.py::test_a_prompt_from_standard_input",),
    ),
    Mutation(
        "Ctrl-C in a gpn subcommand a traceback (exit status 1)",
        "gpn_cli/__init__.py",
        "    except KeyboardInterrupt:  # Ctrl-C where the subcommand has nothing of its own to say: no traceback\n",
        "    except ZeroDivisionError:  # MUTATION\n",
        (
            "tests/tools/test_faults_io.py::test_generate_ctrl_c_is_one_line_and_the_shells_status",
            "tests/tools/test_cli_startup.py::test_ctrl_c_while_a_subcommand_loads_is_one_line_and_the_shells_status",
        ),
    ),
    Mutation(
        "Ctrl-C while a gpn subcommand loads (its parser built) a traceback",
        "gpn_cli/__init__.py",
        "    try:\n        return _parse_and_run(argv, selected)\n",
        "    build_parser(selected)  # MUTATION\n    try:\n        return _parse_and_run(argv, selected)\n",
        ("tests/tools/test_cli_startup.py::test_ctrl_c_while_a_subcommand_loads_is_one_line_and_the_shells_status",),
    ),
    Mutation(
        "gpn bench refuses --num-threads (the spelling of gpn train and gpn eval)",
        "modeling_gpn/bench/command.py",
        '        "--threads",\n        "--num-threads",\n',
        '        "--threads",  # MUTATION\n',
        ("tests/tools/test_bench.py::test_threads_take_the_name_gpn_train_and_eval_give_them",),
    ),
    Mutation(
        "an unknown option of a gpn subcommand refused by the top-level parser (gpn: error: ...)",
        "gpn_cli/__init__.py",
        "    if unknown:  # refused by the subcommand's parser",
        "    if unknown:  # MUTATION\n        parser.error(f\"unrecognized arguments: {' '.join(unknown)}\")\n    if False:",
        ("tests/tools/test_cli_startup.py::test_an_unknown_option_is_refused_by_its_subcommand",),
    ),
    Mutation(
        "gpn CMD --help ends with no example",
        "gpn_cli/__init__.py",
        '        epilog = f"example: {EXAMPLES[name]}" if name in EXAMPLES else None\n',
        "        epilog = None  # MUTATION\n",
        ("tests/tools/test_docs.py -k every_option_has_help_and_the_help_an_example and not train",),
    ),
    Mutation(
        "gpn generate into a closed pipe a BrokenPipeError traceback",
        "gpn_cli/__init__.py",
        "    except BrokenPipeError:  # the reader went away",
        "    except ZeroDivisionError:  # MUTATION",
        ("tests/tools/test_faults_io.py::test_generate_into_a_closed_pipe_stops_quietly",),
    ),
    Mutation(
        "gpn generate prints one prompt's text at the end (not streamed)",
        "modeling_gpn/cli/generate.py",
        "        if args.stream and len(args.prompts) == 1 and args.num_beams == 1:",
        "        if False:  # MUTATION",
        ("tests/tools/test_generate_cli.py -k as_it_is_generated",),
    ),
    Mutation(
        "gpn generate's streamed pieces decoded without the prompt's last tokens (a SentencePiece space lost)",
        "modeling_gpn/cli/generate.py",
        "self.tokenizer, self.context = tokenizer, prompt_ids[-self.CONTEXT :]",
        "self.tokenizer, self.context = tokenizer, prompt_ids[:0]  # MUTATION",
        ("tests/tools/test_generate_cli.py -k as_it_is_generated and SentencePiece",),
    ),
    Mutation(
        "gpn CMD --help shows a flag's default ('--no-stream ... (default: True)')",
        "modeling_gpn/cli/formatting.py",
        "        if action.default is None or action.default == [] or (action.option_strings and action.nargs == 0):",
        "        if action.default is None or action.default == []:  # MUTATION",
        ("tests/tools/test_docs.py -k gives_each_option_its_default_once",),
    ),
    Mutation(
        "gpn CMD --help shows a repeatable option's empty default ('--tag ... (default: [])')",
        "modeling_gpn/cli/formatting.py",
        "        if action.default is None or action.default == [] or (action.option_strings and action.nargs == 0):",
        "        if action.default is None or (action.option_strings and action.nargs == 0):  # MUTATION",
        ("tests/tools/test_docs.py -k gives_each_option_its_default_once and (push or bench or eval)",),
    ),
    Mutation(
        "gpn inspect ignores --split / --data-config beside local data (in silence)",
        "modeling_gpn/inspect/inputs.py",
        "        if given:  # (they choose a Hub dataset's rows",
        "        if False:  # MUTATION (they choose a Hub dataset's rows",
        ("tests/tools/test_inspect.py::test_gpn_inspect_rejects_bad_input",),
    ),
    Mutation(
        "a state saved after its model changed names the edited model (the save's snapshot check removed)",
        "modeling_gpn/cache.py",
        "            if snapshot is not None and weights_snapshot(model) != snapshot:",
        "            if False:  # MUTATION",
        (
            "tests/model/test_state.py::test_a_state_is_not_saved_after_its_model_changed",
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a state file names no PEFT adapter settings (the quick scan for adapter layers finds none)",
        "modeling_gpn/state_file.py",
        '"merged_adapters" in vars(module) or hasattr(type(module), "merged_adapters")',
        "False",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a state saved after PEFT's hotswap_adapter names the swapped model (no glance at the adapters' matrices)",
        "modeling_gpn/state_file.py",
        "    return parameters_key(model), json.dumps(adapter_settings(model), sort_keys=True), adapter_glance(model)",
        "    return parameters_key(model), json.dumps(adapter_settings(model), sort_keys=True)  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a PEFT mixed-batch state is saved naming the active adapter (the cache keeps no mark of the call)",
        "modeling_gpn/cache.py",
        "            names = mixed_batch_adapters(model)\n            if names is not None:",
        "            names = mixed_batch_adapters(model)\n            if False:  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a PEFT mixed batch is looked for on the embedding only (adapters on linear layers unseen)",
        "modeling_gpn/state_file.py",
        "            for module in modules_below(model)\n",
        "            for module in [model.embed_tokens]  # MUTATION\n",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a PEFT mixed batch's hooks are looked for once a model (never after a hook is registered)",
        "modeling_gpn/state_file.py",
        "    if look is None or look[0] != registered:",
        "    if look is None:  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a PEFT mixed batch is remembered after its hooks are gone (the modules found hooked not read again)",
        "modeling_gpn/state_file.py",
        "        names = mixed_batch_adapter_names(module) if module is not None else None",
        "        names = ['stale'] if module is not None else None  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a fork of a PEFT mixed-batch state is saved naming the active adapter (fork drops the mark)",
        "modeling_gpn/cache.py",
        "        forked.state_layer.mixed_adapters = layer.mixed_adapters",
        "        pass  # MUTATION",
        (
            "tests/ecosystem/test_ecosystem.py::test_a_peft_models_state_loads_into_it_and_not_with_other_adapter_settings",
        ),
    ),
    Mutation(
        "a cache's weights snapshot taken again at every forward (an edit between tokens not seen)",
        "modeling_gpn/cache.py",
        "        if ref is None or ref() is not model:",
        "        if True:  # MUTATION",
        ("tests/model/test_state.py::test_a_state_is_not_saved_after_its_model_changed",),
    ),
    Mutation(
        "gpn push publishes a --limit evaluation as the whole test split",
        "modeling_gpn/hub/card_inputs.py",
        '        limit=int(limit) if is_number(limit := data.get("limit")) and limit >= 1 else None,\n',
        "        limit=None,  # MUTATION\n",
        ("tests/tools/test_hub.py::test_a_limited_evaluation_is_not_published_as_the_whole_test_split",),
    ),
    Mutation(
        "gpn push puts fineweb_paper's first_window index in the model-index",
        "modeling_gpn/hub/card_metadata.py",
        '        "first_window",  # where',
        "        # MUTATION",
        ("tests/tools/test_hub.py::test_a_limited_evaluation_is_not_published_as_the_whole_test_split",),
    ),
    Mutation(
        "gpn convert takes a GPN+M config.json beside memory-less parameters for a GPN",
        "conversion/reference.py",
        "        if memory_sizes and not use_memory:\n",
        "        if False:  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py::test_a_memory_config_with_memoryless_parameters_is_refused",),
    ),
    Mutation(
        "gpn eval and gpn inspect on a damaged weights file a SafetensorError traceback",
        "modeling_gpn/cli/loading.py",
        "    except Exception as error:  # a damaged weights file",
        "    except ZeroDivisionError as error:  # MUTATION",
        (
            "tests/ecosystem/test_eval.py::test_a_damaged_weights_file_is_one_line",
            "tests/tools/test_inspect.py::test_a_damaged_weights_file_is_one_line",
        ),
    ),
    Mutation(
        "gpn convert names a size, not the misshaped parameter, beside a config.json",
        "conversion/reference.py",
        "                + _misfits(params, {**kwargs, **stated})\n",
        '                + ""  # MUTATION\n',
        (
            "tests/model/test_config_and_conversion.py::test_a_misshaped_or_stray_parameter_beside_a_config_json_is_named",
        ),
    ),
    Mutation(
        "gpn convert calls a stray layer parameter the missing ones of a whole layer",
        "conversion/reference.py",
        '                stated["num_predict_layers"] = min(layers, kwargs["num_predict_layers"])\n',
        '                stated["num_predict_layers"] = kwargs["num_predict_layers"]  # MUTATION\n',
        (
            "tests/model/test_config_and_conversion.py::test_a_misshaped_or_stray_parameter_beside_a_config_json_is_named",
        ),
    ),
    Mutation(
        "gpn push publishes another model's eval_results.json as this model's",
        "modeling_gpn/hub/folder.py",
        "    if evaluation.n_params is not None and evaluation.n_params != n_params:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_eval_results_from_gpn_evals_own_folder_and_another_models_refused",),
    ),
    Mutation(
        "gpn push calls a PEFT adapter folder one without a config.json",
        "modeling_gpn/hub/folder.py",
        '    if (model_dir / "adapter_config.json").is_file():\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn push publishes a stale weights index or a stale model.safetensors beside the new weights",
        "modeling_gpn/hub/checks.py",
        "    if absent or stray:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn push into a closed pipe says the Hub refused",
        "modeling_gpn/hub/cli.py",
        "    except BrokenPipeError:  # stdout's reader",
        "    except ZeroDivisionError:  # MUTATION",
        ("tests/tools/test_hub.py::test_a_dry_run_into_a_closed_pipe_is_no_hub_error",),
    ),
    Mutation(
        "gpn push --dry-run leaves a refused folder's files in an OUT that was empty",
        "modeling_gpn/hub/push.py",
        "            elif was_empty:\n",
        "            elif False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn convert leaves a partial folder when a write fails part-way",
        "conversion/reference.py",
        "        _remove_written(out, created)\n",
        "        pass  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py::test_gpn_convert_refuses_a_folder_with_files_in_it",),
    ),
    Mutation(
        "gpn push's refusal of a tokenizer it cannot load runs over two lines",
        "modeling_gpn/hub/folder.py",
        '            reason = " ".join(str(error).split())  # one line',
        "            reason = str(error)  # MUTATION",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn convert's refusal of a tokenizer it cannot load runs over two lines",
        "modeling_gpn/data/tokenizer.py",
        """    return f"{type(error).__name__}: {' '.join(str(error).split())}"\n""",
        """    return f"{type(error).__name__}: {error}"  # MUTATION\n""",
        (
            "tests/model/test_config_and_conversion.py::test_gpn_convert_refuses_a_tokenizer_with_more_ids_than_the_model",
        ),
    ),
    Mutation(
        "gpn convert --tokenizer keeps LLaMA-2's special ids in the config, not the tokenizer's",
        "conversion/reference.py",
        '        model.config.update({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})\n',
        "        pass  # MUTATION\n",
        ("tests/tools/test_hub.py::test_convert_push_to_hub_publishes_the_converted_checkpoint",),
    ),
    Mutation(
        "gpn convert --tokenizer keeps LLaMA-2's end of text in the generation config, not the tokenizer's",
        "conversion/reference.py",
        "        model.generation_config.update(bos_token_id=bos, eos_token_id=eos,",
        "        model.generation_config.update(",
        ("tests/tools/test_hub.py::test_convert_push_to_hub_publishes_the_converted_checkpoint",),
    ),
    Mutation(
        "gpn push publishes a generation config that does not stop at the tokenizer's end of text",
        "modeling_gpn/hub/folder.py",
        "    if eos is not None and ends and eos not in ends:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn convert --push-to-hub without --tokenizer converts, then cannot publish",
        "conversion/cli.py",
        "    if args.push_to_hub and not args.tokenizer:",
        "    if False:",
        ("tests/tools/test_hub.py::test_convert_push_to_hub_publishes_the_converted_checkpoint",),
    ),
    Mutation(
        "gpn push refuses a quantized folder as weights that do not match config.json",
        "modeling_gpn/hub/folder.py",
        "    if quantization:  # its tensors",
        "    if False:  # MUTATION",
        ("tests/tools/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "gpn push's card says a shorter, cast or partial evaluation was the paper's",
        "modeling_gpn/hub/model_card.py",
        '    differences = "; ".join(run_differences(evaluation))\n',
        '    differences = ""  # MUTATION\n',
        ("tests/tools/test_hub.py::test_card_text_states_architecture_training_and_results_beside_the_paper",),
    ),
    Mutation(
        "gpn push --eval-results ignored",
        "modeling_gpn/hub/folder.py",
        "    path = Path(eval_results) if eval_results is not None else model_dir / EVAL_RESULTS_FILE\n",
        "    path = model_dir / EVAL_RESULTS_FILE  # MUTATION\n",
        ("tests/tools/test_hub.py::test_eval_results_from_gpn_evals_own_folder_and_another_models_refused",),
    ),
    Mutation(
        "gpn convert on a transformers folder does not say it needs no conversion",
        "conversion/reference.py",
        '        if (src / "config.json").is_file() and any(src.glob("*.safetensors")):\n',
        "        if False:  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py::test_a_transformers_folder_or_its_weights_given_to_convert_says_what_it_is",
        ),
    ),
    Mutation(
        "gpn convert reads a safetensors file as a pickle",
        "conversion/reference.py",
        '    if src.suffix == ".safetensors":\n',
        "    if False:  # MUTATION\n",
        (
            "tests/model/test_config_and_conversion.py::test_a_transformers_folder_or_its_weights_given_to_convert_says_what_it_is",
        ),
    ),
    Mutation(
        "inference tensors: their version read as any tensor's (a model built under inference_mode)",
        "modeling_gpn/derived_weights.py",
        '    try:\n        return tensor._version\n    except RuntimeError:  # "Inference tensors do not track version counter"\n        return None\n',
        "    return tensor._version  # MUTATION\n",
        ("tests/fast_path/test_inference_mode.py -k built",),
    ),
    Mutation(
        "inference tensors: the one-call decode reads the state's version as any tensor's",
        "modeling_gpn/fast_recurrence.py",
        'derived["decoded key"] = (g0, version_of(g0), plan.key)',
        'derived["decoded key"] = (g0, g0._version, plan.key)  # MUTATION',
        ("tests/fast_path/test_inference_mode.py::test_generate_under_inference_mode_gives_no_grads_logits[fast]",),
    ),
    Mutation(
        "inference tensors: a cache filled under inference_mode is written in place outside it",
        "modeling_gpn/cache.py",
        "        self._leave_inference_mode()\n",
        "",
        ("tests/fast_path/test_inference_mode.py -k cache_filled and plain",),
    ),
    Mutation(
        "inference tensors: the weights' hash reads their versions as any tensor's",
        "modeling_gpn/state_file.py",
        "{tensor.dtype}{version_of(tensor)}",
        "{tensor.dtype}{tensor._version}",
        ("tests/fast_path/test_inference_mode.py -k built",),
    ),
    Mutation(
        "a step weight of another shape than the config's: the fast path runs it",
        "modeling_gpn/fast_recurrence.py",
        '    if derived["misshapen weight"] is not None:\n        raise ValueError(derived["misshapen weight"])\n',
        "",
        ("tests/fast_path/test_kernel_safety.py -k replaced_by",),
    ),
    Mutation(
        "a step weight of another shape than the config's: the C step plan takes its rows",
        "modeling_gpn/memory_kernels.py",
        "            if op.weight.shape[0] != rows:\n",
        "            if False:  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k replaced_by and ffn_in",),
    ),
    Mutation(
        "a step weight of another shape than the config's: the C step plan takes a norm of d or vw anywhere",
        "modeling_gpn/memory_kernels.py",
        "            if n.shape != (width,):\n",
        "            if n.shape != (width,) and n.numel() not in (d, vw):  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k replaced_by and read_out_norm",),
    ),
    Mutation(
        "a step weight of another shape than the config's: the C step plan takes any A_log",
        "modeling_gpn/memory_kernels.py",
        "        if self.neg_decay.shape != (max(H, 1),):\n",
        "        if False:  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k replaced_by and A_log",),
    ),
    Mutation(
        "kernel cache: a library is loaded without checking its content hash",
        "modeling_gpn/memory_kernels.py",
        "    if hashlib.sha256(_read_own_file(library)).hexdigest() != expected:\n",
        "    if False:  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k truncated_build or other_source",),
    ),
    Mutation(
        "kernel cache: a library built from other source is loaded",
        "modeling_gpn/memory_kernels.py",
        "    if lib.gpn_kernel_source_digest() != _source_digest().encode():\n",
        "    if False:  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k other_source",),
    ),
    Mutation(
        "kernel cache: a library without the kernels' symbols is used",
        "modeling_gpn/memory_kernels.py",
        "    missing = [name for name in _SYMBOLS if not hasattr(lib, name)]\n",
        "    missing = []  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k expected_symbols",),
    ),
    Mutation(
        "kernel cache: a symbolic link at the library's name is followed",
        "modeling_gpn/memory_kernels.py",
        '    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)\n    try:\n        if path.is_symlink():\n',
        '    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # MUTATION\n    try:\n        if False:\n',
        ("tests/fast_path/test_kernel_safety.py -k symlink",),
    ),
    Mutation(
        "kernel cache: files and folders of another user or writable by others are trusted",
        "modeling_gpn/memory_kernels.py",
        '    """Why a file or folder with this status is not this user\'s alone (None: it is)."""\n',
        '    """Why a file or folder with this status is not this user\'s alone (None: it is)."""\n    return None  # MUTATION\n',
        ("tests/fast_path/test_kernel_safety.py -k group_writable or another_user",),
    ),
    Mutation(
        "kernel cache: a hanging compiler is killed alone, what it started is left running",
        "modeling_gpn/memory_kernels.py",
        "            os.killpg(process.pid, signal.SIGKILL)\n",
        "            process.kill()  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k hanging_compiler",),
    ),
    Mutation(
        "kernel cache: a good build is never reused (rebuilt by every process)",
        "modeling_gpn/memory_kernels.py",
        "        if os.path.lexists(record):\n",
        "        if False:  # MUTATION\n",
        ("tests/fast_path/test_kernel_safety.py -k reused_without",),
    ),
    Mutation(
        "gpn serve: a message's name the chat template leaves out is a 400 (transformers drops it in silence)",
        "modeling_gpn/serve/handlers.py",
        "        if named and not self._renders_names(body, processor, modality):\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_serve.py -k bad_chat_requests and leaves",),
    ),
    Mutation(
        "gpn serve: a message's name reaches the chat template (transformers leaves it out)",
        "modeling_gpn/serve/handlers.py",
        '                parsed["name"] = message["name"]\n',
        "                pass  # MUTATION\n",
        ("tests/tools/test_serve.py -k name_reaches",),
    ),
    Mutation(
        "gpn serve: stream_options include_usage false leaves a stream's usage out",
        "modeling_gpn/serve/handlers.py",
        '                        if not usage:\n                            data.pop("usage", None)\n',
        "",
        ("tests/tools/test_serve.py -k include_usage",),
    ),
    Mutation(
        "a dataset glob leaves out the .* and __* files and folders its wildcards match, as a folder does",
        "modeling_gpn/data/corpus.py",
        "                if Path(p).is_file() and not hidden_match(Path(p), root)\n",
        "                if Path(p).is_file()  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k leaves_out_what_a_folder",),
    ),
    Mutation(
        "a dataset glob keeps the __* folders its pattern names itself",
        "modeling_gpn/data/corpus.py",
        '        part.startswith((".", "__")) and not any(fnmatch.fnmatchcase(part, name) for name in named)\n',
        '        part.startswith((".", "__"))  # MUTATION\n',
        ("tests/tools/test_faults_io.py -k leaves_out_what_a_folder",),
    ),
    Mutation(
        "a Hub dataset's stream that breaks while read is named as its failure, not blamed on the cache folder",
        "modeling_gpn/data/corpus.py",
        "        except Exception as error:  # noqa: BLE001 - any reader failure becomes one clear message\n"
        '            raise DataError(\n                f"Reading Hub dataset',
        '        except DataError as error:  # MUTATION\n            raise DataError(\n                f"Reading Hub dataset',
        ("tests/tools/test_faults_io.py -k hub_dataset_is_cached",),
    ),
    Mutation(
        "gpn convert says so when it converts a float16 or float64 checkpoint to float32",
        "conversion/reference.py",
        "    if other_dtypes:\n",
        "    if False:  # MUTATION\n",
        ("tests/model/test_config_and_conversion.py -k converts_the_checkpoints_dtype",),
    ),
    Mutation(
        "gpn inspect: a model trained with --reset-at-document-start is found by its run's train_config.json",
        "modeling_gpn/inspect/inputs.py",
        '        return isinstance(config, dict) and config.get("reset_at_document_start") is True\n',
        "        return False  # MUTATION\n",
        (
            "tests/tools/test_inspect.py::test_gpn_inspect_says_when_the_model_was_trained_with_document_resets",
            "tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",
        ),
    ),
    Mutation(
        "gpn inspect: the report's header does not say the model was trained with document resets",
        "modeling_gpn/inspect/markdown.py",
        '    trained = data.get("trained_with_document_resets")\n    source = data.get("document_resets_from")\n',
        "    trained, source = False, None  # MUTATION\n",
        (
            "tests/tools/test_inspect.py::test_gpn_inspect_says_when_the_model_was_trained_with_document_resets",
            "tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",
        ),
    ),
    Mutation(
        "gpn inspect's collection of p_t and gamma carries the state across documents (no resets for the forward)",
        "modeling_gpn/inspect/states.py",
        '        resets = {} if reset_after is None else {"position_ids": document_position_ids(batch, reset_after)}\n',
        "        resets = {}  # MUTATION\n",
        (
            "tests/tools/test_inspect.py -k two_documents_collects_each_document_as_if_alone",
            "tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",
        ),
    ),
    Mutation(
        "gpn inspect's own time loop (baseline and ablations) carries the state across documents",
        "modeling_gpn/inspect/ablations.py",
        "    starts = None if reset_after is None else document_starts(input_ids, reset_after)\n",
        "    starts = None  # MUTATION\n",
        (
            "tests/tools/test_inspect.py -k ablation_runs_each_document_as_if_alone",
            "tests/tools/test_inspect.py::test_with_resets_the_causal_tests_baseline_is_the_documents_one_by_one",
        ),
    ),
    Mutation(
        "gpn inspect's causal-test baseline runs without the document resets the ablations run with",
        "modeling_gpn/inspect/ablations.py",
        "    states = baseline_states(model, subset, batch_size, progress, reset_after)\n",
        "    states = baseline_states(model, subset, batch_size, progress)  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_with_resets_the_causal_tests_baseline_is_the_documents_one_by_one",),
    ),
    Mutation(
        "gpn inspect's report runs the causal tests without the document resets",
        "modeling_gpn/inspect/report.py",
        "progress, reset_after\n        )",
        "progress  # MUTATION\n        )",
        ("tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",),
    ),
    Mutation(
        "gpn inspect's report pairs positions across document resets (horizons and retention without documents)",
        "modeling_gpn/inspect/report.py",
        "    documents = None if reset_after is None else document_ids(windows, reset_after)\n",
        "    documents = None  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",),
    ),
    Mutation(
        "analysis.state_horizons pairs positions of different documents",
        "modeling_gpn/analysis/horizons.py",
        "    return lambda k: ids[:, :-k] == ids[:, k:]\n",
        "    return lambda k: ids[:, :-k] == ids[:, :-k]  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_horizons_and_retention_pair_no_positions_across_a_reset",),
    ),
    Mutation(
        "analysis.retention_curves multiplies decays across a document reset",
        "modeling_gpn/analysis/retention.py",
        "            inside = ids[:, : ids.shape[1] - k + 1] == ids[:, k - 1 :]\n",
        "            inside = ids[:, : ids.shape[1] - k + 1] == ids[:, : ids.shape[1] - k + 1]  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_horizons_and_retention_pair_no_positions_across_a_reset",),
    ),
    Mutation(
        "gpn inspect's default regime ignores the model's train_config.json (no resets for a model trained with them)",
        "modeling_gpn/inspect/cli.py",
        "    if trained_with_resets:\n        return True, RECORDED\n",
        "    if False:  # MUTATION\n        return True, RECORDED\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",),
    ),
    Mutation(
        "gpn inspect's --[no-]reset-at-document-start ignored",
        "modeling_gpn/inspect/cli.py",
        "    if option is not None:\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_runs_a_model_in_its_own_document_regime",),
    ),
    Mutation(
        "gpn inspect's document resets asked of a tokenizer without EOS (silently resetting nowhere)",
        "modeling_gpn/inspect/cli.py",
        "    if resets and tokenizer.eos_token_id is None:  # (documents are found by their EOS)\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_document_resets_without_an_eos_token_are_one_line",),
    ),
    Mutation(
        "documents joined with EOS start at the EOS itself, not the token after it (gpn train's and gpn inspect's resets)",
        "modeling_gpn/packing.py",
        "    starts[:, 1:] = windows[:, :-1] == eos_token_id\n",
        "    starts[:, 1:] = windows[:, 1:] == eos_token_id  # MUTATION\n",
        (
            "tests/model/test_packed.py::test_document_position_ids_restart_after_every_eos",
            "tests/tools/test_inspect.py -k two_documents_collects_each_document_as_if_alone",
        ),
    ),
    Mutation(
        "gpn bench's one-token step without its cache",
        "modeling_gpn/bench/timing.py",
        'state["cache"] = cache_of(model(input_ids=token, cache=state["cache"], use_cache=True))',
        'state["cache"] = cache_of(model(input_ids=token, cache=None, use_cache=True))',
        ("tests/tools/test_bench.py -k continues_each",),
    ),
    Mutation(
        "the table view keeps a table computed from inference tensors (which track no version)",
        "modeling_gpn/output_layer.py",
        "    if any(key[2] is None for key in keys):\n",
        "    if False:\n",
        ("tests/model/test_output_layer.py -k table_view_keeps",),
    ),
    Mutation(
        "gpn train's flags cannot be turned off on the command line once a recipe or config file sets them",
        "modeling_gpn/train/cli.py",
        '            kwargs["action"] = argparse.BooleanOptionalAction\n',
        '            kwargs["action"] = "store_true"  # MUTATION\n',
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train reads a config file that is no UTF-8 without naming it",
        "modeling_gpn/train/settings.py",
        "    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:",
        "    except (OSError, json.JSONDecodeError) as error:  # MUTATION",
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train takes an extends that is no string",
        "modeling_gpn/train/settings.py",
        "    if parent is not None and not isinstance(parent, str):\n",
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train takes model_overrides that are no JSON object",
        "modeling_gpn/train/settings.py",
        '    if not isinstance(config.get("model_overrides") or {}, dict):\n',
        "    if False:  # MUTATION\n",
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train takes integer settings beyond int64",
        "modeling_gpn/train/settings.py",
        "value > MAX_INTEGER and option.key not in bounded:",
        "value > MAX_INTEGER and False:  # MUTATION",
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train takes a --ddp-timeout beyond what a timedelta holds",
        "modeling_gpn/train/settings.py",
        '    if not 1 <= config["ddp_timeout"] <= MAX_DDP_TIMEOUT:\n',
        '    if not 1 <= config["ddp_timeout"]:  # MUTATION\n',
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "gpn train takes --num-threads in the tens of thousands",
        "modeling_gpn/train/settings.py",
        '    ("num_threads", 1, MAX_THREADS + 1),\n',
        '    ("num_threads", 1, None),  # MUTATION\n',
        ("tests/tools/test_train.py::test_configuration_precedence_and_help",),
    ),
    Mutation(
        "a corpus glob reads a file once per path a symbolic link loop gives it",
        "modeling_gpn/data/corpus.py",
        "        chosen.setdefault(path.resolve(), path)\n",
        "        chosen.setdefault(path, path)  # MUTATION\n",
        ("tests/tools/test_faults_io.py::test_a_dataset_glob_leaves_out_what_a_folder_leaves_out_unless_it_names_it",),
    ),
    Mutation(
        "a token cache holding another tokenizer's files is read as this run's tokens",
        "modeling_gpn/data/stream.py",
        "        if differ:\n",
        "        if False:  # MUTATION\n",
        ("tests/tools/test_faults_io.py -k damaged_token_cache and another-tokenizer",),
    ),
    Mutation(
        "gpn inspect --overwrite leaves an earlier run's figure beside the new report",
        "modeling_gpn/inspect/cli.py",
        "        (output / stale).unlink(missing_ok=True)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_inspect.py::test_gpn_inspect_end_to_end",),
    ),
    Mutation(
        "gpn eval / generate / inspect run a model whose weights files lack weights its config.json has (drawn at "
        "random) or hold ones it has no place for",
        "modeling_gpn/cli/loading.py",
        "    if not missing and not unexpected:\n",
        "    if True:  # MUTATION\n",
        (
            "tests/ecosystem/test_eval.py::test_a_damaged_weights_file_is_one_line",
            "tests/tools/test_faults_io.py::test_generate_bad_arguments_are_one_clear_line[weights-short-of-config]",
        ),
    ),
    Mutation(
        "Ctrl-C in gpn eval loses the figures of the tasks finished before it",
        "eval/cli.py",
        "    except KeyboardInterrupt:  # Ctrl-C: the tasks finished before it are kept too\n",
        "    except ZeroDivisionError:  # MUTATION\n",
        ("tests/ecosystem/test_eval.py::test_a_task_that_fails_keeps_the_tasks_finished_before_it",),
    ),
    Mutation(
        "gpn study trains every model before it finds its eval names no task (or an unknown one)",
        "modeling_gpn/study/runs.py",
        "        check_tasks(settings.tasks)\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_study.py::test_a_study_that_cannot_run_is_one_line_before_anything_is_written[no-tasks]",),
    ),
    Mutation(
        "gpn bench asks the allocator for a preset's weights beyond the machine's memory (a traceback)",
        "modeling_gpn/bench/command.py",
        "    if needed > memory:\n",
        "    if False:  # MUTATION\n",
        (
            "tests/tools/test_bench.py::test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured"
            "[beyond-memory]",
        ),
    ),
    Mutation(
        "a damaged cached BPE tokenizer ends gpn train with a JSON error naming no file",
        "modeling_gpn/data/tokenizer.py",
        "            except Exception as error:  # noqa: BLE001  (a file of it damaged: a JSON error naming no file)\n",
        "            except ZeroDivisionError as error:  # MUTATION\n",
        ("tests/tools/test_faults_io.py::test_a_damaged_cached_bpe_tokenizer_names_its_folder",),
    ),
    Mutation(
        "gpn train keeps a misspelt model_overrides key and trains the default size in silence",
        "modeling_gpn/train/training.py",
        "        check_model_overrides(config)  # nor a misspelt model setting\n",
        "        pass  # MUTATION\n",
        ("tests/tools/test_train.py::test_settings_torch_would_train_wrongly_with_are_refused_before_the_data",),
    ),
    Mutation(
        "gpn serve: a 429 for a full queue says when to retry (Retry-After)",
        "modeling_gpn/serve/handlers.py",
        '                    headers={"Retry-After": str(RETRY_AFTER_S)},\n',
        "",
        ("tests/tools/test_serve.py -k queue_limit_refuses",),
    ),
    Mutation(
        "a state saved with one tokenizer is continued with another's ids (of the same vocabulary size) in silence",
        "modeling_gpn/cache.py",
        "        if tokenizer is not None and state.tokenizer_fingerprint not in (None, tokenizer_fingerprint(tokenizer)):",
        "        if False:  # MUTATION",
        ("tests/model/test_state.py -k other-tokenizer",),
    ),
    Mutation(
        "the NaN check of a loaded model reads a quantized weight by its inner tensors (torchao's have no isfinite)",
        "modeling_gpn/cli/loading.py",
        "        for part_name, part in stored_tensors(name, param.detach())",
        "        for part_name, part in [(name, param.detach())]  # MUTATION",
        ("tests/fast_path/test_step_kernels.py -k folder_saved_quantized",),
    ),
    Mutation(
        "gpn convert says a file does not begin as a pickle (the unpickler said only 'IndexError: pop from empty list')",
        "conversion/reference.py",
        "            if data.startswith(pickle.PROTO)",
        "            if True  # MUTATION",
        ("tests/tools/test_faults_io.py -k text-file",),
    ),
    Mutation(
        "gpn eval's --device defaults to cuda where available (it ran on a GPU machine's CPU unless told)",
        "eval/cli.py",
        '        default="cuda" if torch.cuda.is_available() else "cpu",',
        '        default="cpu",  # MUTATION',
        ("tests/ecosystem/test_eval.py -k device_is_a_gpu",),
    ),
    Mutation(
        "gpn serve checks a GPN's weights at load as gpn eval does (NaN ones failed each request instead)",
        "modeling_gpn/serve/models.py",
        'GPN_CLASSES = {"GPNForCausalLM": CheckedGPNForCausalLM, "GPNModel": GPNModel}',
        'GPN_CLASSES = {"GPNForCausalLM": GPNForCausalLM, "GPNModel": GPNModel}  # MUTATION',
        ("tests/tools/test_serve.py -k weights_hold_nan_is_not_served",),
    ),
    Mutation(
        "gpn train's tokens/s leaves out the validations and checkpoints between steps (they made a step look slow)",
        "modeling_gpn/train/loop.py",
        "            window.paused += time.perf_counter() - paused\n",
        "",
        ("tests/tools/test_train.py -k tiny_preset",),
    ),
    Mutation(
        "gpn train's summary says which positions the held-out perplexity scores (the first of a window is not)",
        "modeling_gpn/train/training.py",
        "tokens, each scored on its {config['seq_len'] - 1} next-token predictions: its \"\n",
        'tokens"  # MUTATION\n',
        ("tests/tools/test_train.py -k tiny_preset",),
    ),
]


def pytest_arguments(spec: str) -> list[str]:
    """`path -k expression` or a node id, as pytest arguments."""
    if " -k " in spec:
        path, expression = spec.split(" -k ", 1)
        return [path, "-k", expression]
    return [spec]


def copy_of_repository(target: Path) -> None:
    """The tracked and untracked (not ignored) files of the repository: the tree as it is, without .venv."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO_ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    # the sub-packages live at the top of the tree (pyproject's package-dir); linked where Python looks for
    # them, so the copy imports its own (the editable install would otherwise supply the unmutated ones)
    for package, folder in SUBPACKAGES.items():
        (target / "modeling_gpn" / package).symlink_to(Path("..") / folder)


def run_tests(root: Path, specs: tuple[str, ...], report: Path) -> tuple[int, int, list[str]]:
    """Run the tests in the copy at `root`: (tests run, tests failed or errored, ids of those that passed)."""
    env = dict(os.environ, PYTHONPATH=str(root))  # the copy's modeling_gpn, not the installed one
    env.setdefault("GPN_SHARED_DIR", str(REPO_ROOT.parent / "shared"))
    ran = failed = 0
    passed: list[str] = []
    for index, spec in enumerate(specs):
        xml = report.with_name(f"{report.stem}-{index}.xml")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            *pytest_arguments(spec),
        ]
        subprocess.run(command, cwd=root, env=env, capture_output=True)
        if not xml.exists():
            failed += 1  # pytest itself failed (e.g. a collection error): the run failed
            continue
        outcomes: dict[str, set] = {}  # (a test failing in its call and its teardown is listed twice)
        for case in ElementTree.parse(xml).iter("testcase"):
            outcomes.setdefault(f"{case.get('classname')}::{case.get('name')}", set()).update(
                child.tag for child in case
            )
        for test, outcome in outcomes.items():
            if "skipped" in outcome:
                continue
            ran += 1
            if outcome & {"failure", "error"}:
                failed += 1
            else:
                passed.append(test)
    return ran, failed, passed


def check_imports_the_copy(root: Path) -> None:
    """The copy's tests must import the copy's package, or the mutation would not be tested at all."""
    env = dict(os.environ, PYTHONPATH=str(root))
    modules = ["modeling_gpn", "gpn_cli", *(f"modeling_gpn.{package}" for package in SUBPACKAGES)]
    code = f"import importlib\nfor name in {modules!r}: print(importlib.import_module(name).__file__)"
    found = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    for module, where in zip(modules, found.stdout.split()):
        if not Path(where).absolute().is_relative_to(root.absolute()):
            raise SystemExit(f"the copy imports {module} from {where}, not from {root}")


def unapplied(mutations: list[Mutation]) -> list[str]:
    """What keeps each of `mutations` from applying to the repository as it is: its file or its source text
    missing, the text not unique, a test file it names missing. Empty when every one applies."""
    problems = []
    for mutation in mutations:
        path = REPO_ROOT / mutation.file
        count = path.read_text().count(mutation.old) if path.is_file() else -1
        if count != mutation.occurrences:
            found = (
                "the file does not exist"
                if count < 0
                else f"its source text occurs {count} times, not {mutation.occurrences}"
            )
            problems.append(f"{mutation.name!r}: {mutation.file}: {found}")
        for spec in mutation.tests:
            test_file = pytest_arguments(spec)[0].split("::")[0]
            if not (REPO_ROOT / test_file).is_file():
                problems.append(f"{mutation.name!r}: its test file {test_file} does not exist")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument(
        "--check-sources", action="store_true", help="only check that every mutation applies to the tree (no tests run)"
    )
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only.lower() in m.name.lower()]
    if not chosen:  # (a typo in --only ran nothing and ended in a traceback from the empty table)
        print(f"mutation_check: no mutation's name contains {args.only!r} (--list shows them)", file=sys.stderr)
        return 2
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name}: {mutation.file}\n  " + "\n  ".join(mutation.tests))
        return 0
    problems = unapplied(chosen)
    if problems:
        print("mutation_check: these mutations no longer apply; update them to the code as it is now:", file=sys.stderr)
        print("\n".join(f"  {problem}" for problem in problems), file=sys.stderr)
        return 2
    if args.check_sources:
        print(f"mutation_check: all {len(chosen)} mutations apply")
        return 0
    rows, all_failed = [], True
    with tempfile.TemporaryDirectory(prefix="gpn-mutation-") as scratch:
        for number, mutation in enumerate(chosen):
            root = Path(scratch) / f"m{number}"
            copy_of_repository(root)
            if number == 0:
                check_imports_the_copy(root)
            path = root / mutation.file
            path.write_text(path.read_text().replace(mutation.old, mutation.new))
            ran, failed, passed = run_tests(root, mutation.tests, Path(scratch) / f"report-{number}.xml")
            all_failed &= ran > 0 and failed == ran and not passed
            rows.append((mutation.name, ran, failed, passed))
            print(f"{mutation.name}: {failed} of {ran} failed", file=sys.stderr, flush=True)
            shutil.rmtree(root)
    width = max(len(row[0]) for row in rows)
    print(f"\n| {'feature removed':<{width}} | tests run | tests failed | passed anyway |")
    print(f"|{'-' * (width + 2)}|-----------|--------------|---------------|")
    for name, ran, failed, passed in rows:
        print(f"| {name:<{width}} | {ran:>9} | {failed:>12} | {', '.join(passed) or '-'} |")
    print(
        "\nevery claiming test failed with its feature removed"
        if all_failed
        else "\nSOME TESTS PASSED WITHOUT THEIR FEATURE"
    )
    return 0 if all_failed else 1


if __name__ == "__main__":
    sys.exit(main())
