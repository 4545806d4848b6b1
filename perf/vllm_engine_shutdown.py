"""Stop a vLLM engine and its worker processes before the next one starts."""

from __future__ import annotations

import contextlib
import gc


def shutdown(llm) -> None:
    with contextlib.suppress(Exception):  # best effort; process exit cleans up too
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
