"""Silencing library chatter that says nothing to the user (megatron-core's optional-extension warnings,
transformers' weight-loading bars), in the CLI process and in the worker processes it starts."""

from __future__ import annotations

import os
import sys
import warnings


def quiet_libraries() -> None:
    """Hide import-time warnings about optional CUDA extensions and per-load progress bars."""
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # importing it only to silence it would cost a second at start-up
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
