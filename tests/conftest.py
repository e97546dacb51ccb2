"""Shared fixtures. Models are provisioned once into $GRAPHCHUNK_HOME (default ~/.cache/graphchunk)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from graphchunk import models  # noqa: E402
from graphchunk.oracle import Oracle  # noqa: E402


# --- models -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_path():
    return models.smollm2_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """The SmolLM2 tokenizer (the tiny checkpoints share it)."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


# --- reference ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def oracle(smollm2_path):
    """Isolated-mode reference on SmolLM2-135M in fp32."""
    return Oracle(smollm2_path, dtype=torch.float32)
