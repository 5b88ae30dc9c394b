"""Modules the ranks' forkserver imports once per test process beside torch and the library
([Note: Ranks from a forkserver] in ``_harness.py``): the Hugging Face model code that many
distributed tests build on every rank (2-4 s of imports per rank on two cores, paid by dozens
of ranks per suite run). Importing them starts no thread and runs no tensor operation. Where an
extra is not installed (or ``numpy`` is blocked, as ``test_no_numpy.py`` blocks it), nothing is
preloaded and the tests import what they need themselves."""

from __future__ import annotations

import contextlib

with contextlib.suppress(Exception):  # an extra missing or broken here must not take the forkserver down
    import transformers  # noqa: F401
    from transformers.models.bert import modeling_bert  # noqa: F401
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
