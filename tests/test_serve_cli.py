"""`python -m runtime`: usage and user errors, `serve` end to end, and the terminal chat (`chat`)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.register_assert_rewrite("serve_fixtures")  # its helpers assert

import runtime  # noqa: E402
from runtime.cli.chat import run_chat  # noqa: E402
from serve_fixtures import FIXED, MODEL, MSGS, ROOT, ActAfter  # noqa: E402

pytest_plugins = ["serve_fixtures"]  # its fixtures: chat_art, ref, served, client


def run_cli(*args, stdin: str = "", timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "runtime", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_cli_usage_and_bad_directories(tmp_path):
    for args in ([], ["frobnicate"]):
        r = run_cli(*args)
        assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr
    for cmd in ("serve", "chat"):
        r = run_cli(cmd, str(tmp_path / "missing"), *(["--port", "0"] if cmd == "serve" else []))
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    r = run_cli("serve", str(tmp_path), "--port", "70000")
    assert r.returncode == 2 and r.stderr.startswith("error: --port")


def test_api_key_is_stripped_and_must_be_printable_ascii(tmp_path):
    from runtime.__main__ import check_api_key

    assert check_api_key("s3cret\n") == check_api_key("  s3cret ") == "s3cret"  # e.g. $(cat keyfile)
    for bad, phrase in (("   ", "empty"), ("a b", "printable ASCII"), ("clé", "printable ASCII")):
        r = run_cli("serve", str(tmp_path), "--port", "0", "--api-key", bad)
        assert r.returncode == 2 and phrase in r.stderr and r.stderr.count("\n") == 1, r.stderr


def cli_without(modules: tuple[str, ...], *args: str) -> list[str]:
    """The argv of `python -m runtime ARGS` in an interpreter where `modules` cannot be imported."""
    blocker = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {modules!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runtime.__main__ as m\n"
        "sys.exit(m.main(sys.argv[1:]))\n"
    )
    return [sys.executable, "-c", blocker, *args]


def test_serve_without_the_extra_names_the_pip_command(tmp_path):
    r = subprocess.run(cli_without(("starlette", "uvicorn"), "serve", str(tmp_path)), capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "pip install '.[serve]'" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_serve_command_end_to_end(chat_art, ref):
    """`python -m runtime serve DIR --port 0` without torch, transformers or the exporter: prints its
    address, answers, shuts down on Ctrl-C."""
    argv = cli_without(("torch", "transformers", "dflash_export"), "serve", str(chat_art), "--port", "0",
                       "--model-name", MODEL, "--queue-size", "4")
    # Ctrl-C must reach it even when the tests run as a background job (which starts with SIGINT ignored)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = [proc.stderr.readline()]
        while not lines[-1].startswith("serving") and lines[-1] and len(lines) < 50:  # past any library warning
            lines.append(proc.stderr.readline())
        line = lines[-1]
        assert line.startswith("serving 'tiny' on http://127.0.0.1:"), lines
        url = line.split(" on ")[1].split(" ")[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, extra_body=FIXED)
        assert r.choices[0].message.content == ref.chat(MSGS, max_new_tokens=8, **FIXED).text
        proc.send_signal(signal.SIGINT)
        # uvicorn shuts down, then raises the signal again: the status Ctrl-C gives (130 via KeyboardInterrupt)
        assert proc.wait(30) == 130
        rest = proc.stderr.read()
        assert "Application shutdown complete" in rest and "Traceback" not in rest
    finally:
        proc.kill()
        proc.wait()


def test_chat_command_multi_turn(chat_art, ref):
    r = run_cli("chat", str(chat_art), "--max-tokens", "6", "--verify-len", "all", stdin="t11 t12\nt13\n\n/reset\nt11 t12\n/bogus\n/exit\nt40\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    turn1 = [{"role": "user", "content": "t11 t12"}]
    a = ref.chat(turn1, max_new_tokens=6, **FIXED).text
    turn2 = turn1 + [{"role": "assistant", "content": a}, {"role": "user", "content": "t13"}]
    b = ref.chat(turn2, max_new_tokens=6, **FIXED).text
    assert replies == [a, b, a]  # after /reset the conversation starts again; nothing after /exit
    assert "(conversation cleared)" in r.stderr and "unknown command /bogus" in r.stderr


def test_chat_ctrl_c_stops_the_reply_and_the_chat_goes_on(chat_art, ref):
    """SIGINT during a reply stops it at the next step; the shown part stays in the conversation."""
    with runtime.load(chat_art) as sess:
        real = sess.stream
        interrupted = []

        def stream(*a, **kw):
            st = real(*a, **kw)
            if not interrupted:
                interrupted.append(True)
                return ActAfter(st, 2, lambda: os.kill(os.getpid(), signal.SIGINT))  # as Ctrl-C does
            return st

        sess.stream = stream
        out, notes = io.StringIO(), io.StringIO()
        assert run_chat(sess, io.StringIO("t11 t12\nt13\n"), out, notes, max_tokens=30, stop_token_ids=[]) == 0
    first, second = out.getvalue().splitlines()
    full = ref.chat([{"role": "user", "content": "t11 t12"}], max_new_tokens=30, stop_token_ids=[]).text
    assert "(stopped)" in notes.getvalue() and first and full.startswith(first) and len(first) < len(full)
    msgs = [{"role": "user", "content": "t11 t12"}, {"role": "assistant", "content": first}, {"role": "user", "content": "t13"}]
    assert second == ref.chat(msgs, max_new_tokens=30, stop_token_ids=[]).text


def test_chat_reply_k_samples_with_seed_plus_k(chat_art, ref):
    """Sampled replies are reproducible per turn and not the same draw twice: reply k uses seed + k."""
    with runtime.load(chat_art) as sess:
        out, notes = io.StringIO(), io.StringIO()
        assert run_chat(sess, io.StringIO("t11 t12\nt13\n"), out, notes, max_tokens=6, temperature=1.0, seed=5) == 0
    first, second = out.getvalue().splitlines()
    turn1 = [{"role": "user", "content": "t11 t12"}]
    assert first == ref.chat(turn1, max_new_tokens=6, temperature=1.0, seed=5).text
    turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "t13"}]
    assert second == ref.chat(turn2, max_new_tokens=6, temperature=1.0, seed=6).text
    assert second != ref.chat(turn2, max_new_tokens=6, temperature=1.0, seed=5).text  # the seed made the difference


def test_chat_drops_the_oldest_turns_to_fit(chat_art):
    with runtime.load(chat_art) as sess:
        out, notes = io.StringIO(), io.StringIO()
        lines = "".join(f"t{10 + i} t{20 + i} t{30 + i} t{40 + i}\n" for i in range(8)) + ("t5 " * 80) + "\nt9\n"
        assert run_chat(sess, io.StringIO(lines), out, notes, max_tokens=8) == 0
        assert len(out.getvalue().splitlines()) == 9  # every turn but the one too long alone
        assert "dropped the oldest turn" in notes.getvalue() and "max_seq_len 64" in notes.getvalue()


def test_chat_flags_the_artifact_refuses_fail_once_at_startup(chat_art):
    with runtime.load(chat_art) as sess:
        vocab = int(sess.manifest["target"]["vocab_size"])
        for settings, phrase in (({"top_k": vocab + 1}, "--top-k"), ({"verify_len": -1}, "--verify-len"),
                                 ({"max_tokens": sess.max_seq_len}, "pass a smaller --max-tokens")):
            out, notes = io.StringIO(), io.StringIO()
            with pytest.raises(runtime.DFlashError, match=phrase):
                run_chat(sess, io.StringIO("t11\nt12\n"), out, notes, **settings)
            assert out.getvalue() == notes.getvalue() == ""  # before the banner and any turn
    r = run_cli("chat", str(chat_art), "--top-k", str(vocab + 1), stdin="t11\nt12\n")
    assert r.returncode == 2 and r.stderr.startswith("error: --top-k") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


def test_chat_input_that_is_not_utf8_is_refused_by_line(chat_art, ref):
    with runtime.load(chat_art) as sess:
        stdin = io.TextIOWrapper(io.BytesIO(b"t11 \xff\xfe t12\nt11 t12\n"), encoding="utf-8")
        out, notes = io.StringIO(), io.StringIO()
        assert run_chat(sess, stdin, out, notes, max_tokens=6, **FIXED) == 0
    assert "not valid UTF-8" in notes.getvalue() and "surrogate" not in notes.getvalue(), notes.getvalue()
    assert out.getvalue().splitlines() == [ref.chat([{"role": "user", "content": "t11 t12"}], max_new_tokens=6,
                                                    **FIXED).text]
