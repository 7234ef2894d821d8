"""The server's memory after long prompts: onnxruntime's CPU memory arena keeps every chunk it ever
took, so a server's RSS grew from 0.84 to 2.5-2.8 GiB after a few 2,000-token prompts (SmolLM2 fp32)
and never came back. The onnxruntime backend now shrinks the arena at the end of every run
(`memory.enable_memory_arena_shrinkage`), returning what the run freed. See serve_fixtures.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.register_assert_rewrite("serve_fixtures")  # its helpers assert

import runtime  # noqa: E402
from runtime.serve.app import create_app  # noqa: E402
from runtime.serve.run import ServerThread  # noqa: E402
from serve_fixtures import FIXED, PATHS, post  # noqa: E402

pytest_plugins = ["serve_fixtures"]  # its fixtures: chat_art, ref, served, client

SHRINK = "memory.enable_memory_arena_shrinkage"


def test_every_ort_run_shrinks_the_cpu_arena(chat_art, monkeypatch):
    """Each graph call (prefill, draft, verify) passes run options that shrink the CPU arena."""
    import onnxruntime as ort

    seen = []
    real = ort.InferenceSession.run_with_iobinding

    def spy(self, binding, run_options=None):
        seen.append(None if run_options is None else run_options.get_run_config_entry(SHRINK))
        return real(self, binding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", spy)
    with runtime.load(chat_art) as sess:
        res = sess.generate("t5 t6 t7", max_new_tokens=6, stop_token_ids=[], **FIXED)
    assert len(res.output_ids) == 6
    assert len(seen) >= 4 and set(seen) == {"cpu:0"}, seen


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the RSS from /proc")
def test_long_prompts_do_not_keep_the_servers_memory(smollm2_artifact):
    """Four different 230-token prompts (max_seq_len 256) through the server: the RSS grows by at most
    30 MiB (measured: 11 MiB; 49 MiB with the arena never shrunk. 2,000-token prompts of the same model
    in a 2,048-token artifact: +0.12 GiB, and +1.7 GiB unshrunk)."""
    rng = np.random.default_rng(0)
    with runtime.load(smollm2_artifact) as sess, ServerThread(create_app(sess)) as srv:
        status, _, out = post(srv, PATHS["comp"], {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert status == 200, out  # warm-up: code paths, allocator pools, the decode steps' chunks
        gc.collect()
        before = _rss_bytes()
        for _ in range(4):
            ids = rng.integers(100, 40000, size=230).tolist()
            status, _, out = post(srv, PATHS["comp"], {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                       "reuse_prefix": False})
            assert status == 200 and out["usage"]["prompt_tokens"] == 230, out
        gc.collect()
        grown = _rss_bytes() - before
    assert grown < 30 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
