"""transformers' own common model tests (`ModelTesterMixin`) over `GPNModel` and `GPNForCausalLM`.

Written as transformers' tests for its recurrent models (Mamba, RWKV) are: a model tester that builds a
tiny config and inputs, and a `unittest.TestCase` mixing in `ModelTesterMixin`, with the tests that
cannot apply to a recurrent model skipped, each with its reason.

`tests/test_modeling_common.py` is not copied into this repository: it is taken at test time from the
sdist of the installed transformers version (`pip download --no-binary :all: --no-deps transformers==X`),
cached in `~/.cache/gpn/transformers-tests/X` (or `$GPN_TRANSFORMERS_TESTS_CACHE/X`), so the tests are
always the ones of the transformers that runs them. The sdist ships `tests/test_modeling_common.py` but
not the two modules it imports for its other mixins, `tests/generation/test_utils.py`
(`GenerationTesterMixin`) and `tests/exporters/test_export.py` (`ExportTesterMixin`, a base class of
`ModelTesterMixin`): each is replaced by an empty stand-in module defining an empty class of that name,
so the file imports; the generation and export tests are then not run from here (this repository tests
generation and torch.export itself, tests/model/test_generate.py and tests/ecosystem/test_ecosystem.py).

A failed download skips this module with a message; `.ci/run` sets GPN_REQUIRE_TRANSFORMERS_TESTS=1,
which turns that skip into a failure.

transformers' common tests learn a model's role (base model, causal LM) from its auto mappings
(`MODEL_MAPPING_NAMES`, `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`): a model shipped in transformers is listed
there, so while this module runs GPN is listed too (restored afterwards).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import unittest
from pathlib import Path

import pytest
import transformers

STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
}
PACKAGE = "transformers_common_tests"  # the sdist's tests/ folder, importable (its imports are relative)


def stand_in(text: str) -> str:
    """The file written for a module the sdist lacks, `text` its body."""
    return f'"""Empty stand-in (see gpn tests/ecosystem/test_transformers_common.py)."""\n\n\n{text}'


def common_tests_folder() -> Path:
    """The cache folder holding `PACKAGE` for the installed transformers, downloaded on first use."""
    version = transformers.__version__
    root = Path(os.environ.get("GPN_TRANSFORMERS_TESTS_CACHE", Path.home() / ".cache" / "gpn" / "transformers-tests"))
    folder = root / version
    package = folder / PACKAGE
    if (package / "test_modeling_common.py").exists() and all(
        (package / relative).is_file() and (package / relative).read_text(encoding="utf-8") == stand_in(text)
        for relative, text in STAND_INS.items()
    ):
        return folder  # (a folder an older checkout made with other stand-ins is made again)
    folder.mkdir(parents=True, exist_ok=True)
    sdists = list(folder.glob(f"transformers-{version}.tar.gz"))  # (kept: remade without the network)
    if not sdists:
        download = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"transformers=={version}",
                "-d",
                str(folder),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            # (the sdist is kept here: pip's own cache in the user's home is left alone, by the pip that builds the
            # sdist's metadata too, which --no-cache-dir does not reach)
            env=dict(os.environ, PIP_NO_CACHE_DIR="1"),
        )
        sdists = list(folder.glob(f"transformers-{version}.tar.gz"))
        if download.returncode != 0 or not sdists:
            said = [
                line
                for line in download.stderr.splitlines()
                if line.strip() and not line.startswith("WARNING: Location")
            ]
            raise RuntimeError(
                f"pip download of the transformers {version} sdist failed: {' / '.join(said[-3:])[-600:]}"
            )
    staging = folder / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdists[0]) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("/tests/test_modeling_common.py"))
        archive.extract(member, staging, filter="data")
        extracted = staging / member.name
    staged_package = staging / PACKAGE
    staged_package.mkdir()
    (staged_package / "__init__.py").write_text("")
    shutil.move(extracted, staged_package / "test_modeling_common.py")
    for relative, text in STAND_INS.items():  # the modules the sdist lacks
        path = staged_package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        path.write_text(stand_in(text), encoding="utf-8")
    shutil.rmtree(package, ignore_errors=True)
    shutil.move(staged_package, package)  # complete or absent: a later run never sees half a folder
    shutil.rmtree(staging, ignore_errors=True)
    return folder


try:
    sys.path.insert(0, str(common_tests_folder()))
    common = importlib.import_module(f"{PACKAGE}.test_modeling_common")
except Exception as error:  # no network, no sdist, or a file that does not import
    message = f"transformers' common model tests are unavailable: {type(error).__name__}: {error}"
    if os.environ.get("GPN_REQUIRE_TRANSFORMERS_TESTS") == "1":
        raise RuntimeError(message) from error
    pytest.skip(message, allow_module_level=True)

from transformers.models.auto import modeling_auto  # noqa: E402

from modeling_gpn import GPNConfig, GPNForCausalLM, GPNForSequenceClassification, GPNModel  # noqa: E402

ModelTesterMixin, ids_tensor, random_attention_mask = (
    common.ModelTesterMixin,
    common.ids_tensor,
    common.random_attention_mask,
)


@pytest.fixture(scope="module", autouse=True)
def gpn_in_the_auto_mappings():
    from unittest import mock

    with (
        mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {"gpn": "GPNModel"}),
        mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {"gpn": "GPNForCausalLM"}),
        mock.patch.dict(
            modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, {"gpn": "GPNForSequenceClassification"}
        ),
    ):
        yield


class GPNModelTester:
    """Tiny GPN+M configs and inputs, as transformers' model testers make them."""

    def __init__(self, parent, batch_size: int = 3, seq_length: int = 7, vocab_size: int = 99):
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.is_training = True
        self.state_size = 32  # the config's hidden_size: the width d of the state p
        # The width transformers' tests expect of `hidden_states` (and of `last_hidden_state`): the decoded vector's,
        # the embedding width e, which the tied output matrix multiplies.
        self.hidden_size = 16
        self.num_hidden_layers = 1  # one layer revisited at every token
        self.expected_num_hidden_layers = 2  # `hidden_states`: (the embedding output, `last_hidden_state`)

    def get_config(self) -> GPNConfig:
        return GPNConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.state_size,
            embedding_size=self.hidden_size,
            intermediate_size=48,
            num_predict_layers=2,
            num_memory_heads=2,
            memory_key_dim=8,
            memory_value_dim=8,
            bos_token_id=None,
            eos_token_id=self.vocab_size - 1,
            pad_token_id=self.vocab_size - 1,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class GPNModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (GPNModel, GPNForCausalLM, GPNForSequenceClassification)
    has_attentions = False  # a recurrence, as Mamba and RWKV
    # transformers' own route for a model whose generate tests are not run from the tester: the sdist lacks
    # tests/generation/test_utils.py (GenerationTesterMixin is an empty stand-in here). GPN's generate() is
    # tested in tests/model/test_generate.py, tests/ecosystem/test_ecosystem.py and tests/model/test_cache_and_padding.py.
    all_generative_model_classes = ()

    def setUp(self):
        self.model_tester = GPNModelTester(self)
