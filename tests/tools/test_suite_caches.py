"""The suite writes no cache of the user's (tests/environment.py): every cache a library or gpn keeps under the home
folder by default is, for the tests and the processes they launch, a folder under the temporary one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def test_the_caches_the_suite_writes_are_under_the_temporary_folder_not_the_users_home():
    import datasets.config
    import huggingface_hub.constants
    from transformers.utils import HF_MODULES_CACHE

    from modeling_gpn.data import default_cache_dir

    # (the datasets library's lock files under ~/.cache/huggingface/datasets were seen after a run, as were
    # trust_remote_code's module copies, gpn's token shards, the C kernels and Triton's sm_90 builds)
    caches = {
        "datasets": datasets.config.HF_DATASETS_CACHE,
        "hub": huggingface_hub.constants.HF_HUB_CACHE,
        "modules": HF_MODULES_CACHE,
        "gpn": default_cache_dir(),
        "kernels": os.environ.get("GPN_KERNEL_CACHE"),
        "triton": os.environ.get("TRITON_CACHE_DIR"),
        "matplotlib": os.environ.get("MPLCONFIGDIR"),
    }
    temporary = Path(tempfile.gettempdir()).resolve()
    for name, folder in caches.items():
        assert folder is not None, name
        assert temporary in Path(folder).resolve().parents, (name, folder)
