"""`python -m runtime chat DIR`: a multi-turn chat in the terminal, replies streamed as they decode.

Reads one user turn per line from stdin and keeps the conversation, so every request reuses the KV
rows of the turns before it. Replies go to stdout and nothing else does (the banner, notes and errors
go to stderr), so the chat can be driven through pipes. Commands: `/reset` forgets the conversation,
`/exit` (or end of input) quits. Ctrl-C stops the reply being written at the next decoding step (what
was shown stays in the conversation); at the prompt it only says how to quit. A conversation that
outgrows the KV buffers loses its oldest turns (with a note).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import TextIO

from runtime.errors import DFlashError
from runtime.options import DEFAULT_MAX_TOKENS, GenerationOptions

HELP = "/reset forgets the conversation, /exit quits; Ctrl-C stops a reply"


class ChatSession:
    """The conversation and how each turn is generated.

    Args:
        session: a loaded :class:`runtime.Session` with a chat template.
        out: where replies are written (deltas, flushed as they arrive).
        notes: where notes and errors are written.
        system: an optional system prompt, kept across `/reset`.
        max_tokens: reply length limit (None: what fits, capped at 512).
        options: other GenerationOptions (temperature, top_p, ...).
    """

    def __init__(self, session, out: TextIO, notes: TextIO, system: str | None = None,
                 max_tokens: int | None = None, **options):
        self.session, self.out, self.notes = session, out, notes
        self.base = [{"role": "system", "content": system}] if system else []
        self.history = list(self.base)
        self.max_tokens, self.options = max_tokens, options
        self.turns = 0  # replies so far: turn k samples with seed + k (the same seed would repeat a reply)
        self.interrupted = threading.Event()

    def handle(self, line: str) -> bool:
        """Act on one input line; False once the chat should end."""
        text = line.strip()
        if not text:
            return True
        if text == "/exit":
            return False
        if text == "/reset":
            self.history = list(self.base)
            self._note("(conversation cleared)")
        elif text.startswith("/"):
            self._note(f"unknown command {text.split()[0]}; {HELP}")
        else:
            self.turn(text)
        return True

    def turn(self, text: str) -> None:
        """Add a user turn and stream the reply (the turn is dropped again if it cannot be answered)."""
        bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)  # stdin's surrogateescape
        if bad is not None:
            self._note(f"error: this line is not valid UTF-8 text (the byte 0x{ord(bad) - 0xdc00:02x} at character "
                       f"{text.index(bad)}); it was skipped")
            return
        self.history.append({"role": "user", "content": text})
        try:
            reply = self._reply()
        except DFlashError as exc:
            self.history.pop()
            self._note(f"error: {exc}")
            return
        self.history.append({"role": "assistant", "content": reply})

    def _reply(self) -> str:
        max_new = self._fit()
        parts = []
        self.interrupted.clear()
        options = {**self.options, "seed": self.options.get("seed", 0) + self.turns}
        self.turns += 1
        with _ctrl_c_sets(self.interrupted), self.session.stream(messages=self.history, max_new_tokens=max_new,
                                                                 **options) as stream:
            for chunk in stream:
                self.out.write(chunk.text)
                self.out.flush()
                parts.append(chunk.text)
                if self.interrupted.is_set():
                    break  # leaving the `with` closes the stream: decoding stops at this step
        self.out.write("\n")
        self.out.flush()
        if self.interrupted.is_set():
            self._note("(stopped)")
        return "".join(parts)

    def _fit(self) -> int:
        """max_new_tokens for the next reply, dropping the oldest turns until the conversation leaves
        room for it in the KV buffers.

        Raises:
            DFlashError: the last user turn alone does not fit.
        """
        limit, keep = self.session.max_seq_len, len(self.base)
        need = self.max_tokens or max(1, min(128, limit // 4))
        alone = len(self.session.encode_messages(self.base + self.history[-1:]))
        if alone + need > limit:
            raise DFlashError(f"this message is {alone} tokens with the chat template; with a {need}-token reply "
                              f"it exceeds the model's max_seq_len {limit}; shorten it")
        while True:
            n = len(self.session.encode_messages(self.history))
            if n + need <= limit:
                return self.max_tokens or min(DEFAULT_MAX_TOKENS, limit - n)
            del self.history[keep:keep + 2]  # the oldest user turn and its reply
            self._note(f"(dropped the oldest turn to fit max_seq_len {limit})")

    def _note(self, text: str) -> None:
        print(text, file=self.notes, flush=True)


@contextmanager
def _ctrl_c_sets(event: threading.Event):
    """While a reply streams, Ctrl-C sets `event` (checked at each step) instead of raising inside the
    decoding loop; a second Ctrl-C before the step ends raises KeyboardInterrupt as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def on_sigint(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _read_line(stdin: TextIO, prompt: str | None) -> str | None:
    """The next input line (None at end of input); `input()` with a prompt on a terminal (line editing)."""
    if prompt is not None:
        try:
            return input(prompt)
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None


def check_settings(session, max_tokens: int | None = None, **options) -> None:
    """Check the chat's settings against the artifact (vocabulary, block size, KV buffers) once, before
    the first turn, instead of failing every turn.

    Raises:
        DFlashError: naming the command-line flag at fault.
    """

    limit = session.max_seq_len
    if max_tokens is not None and max_tokens >= limit:
        raise DFlashError(f"--max-tokens {max_tokens} leaves no room for a message in the model's max_seq_len {limit} "
                          f"(prompt and reply together); pass a smaller --max-tokens (at most {limit - 1}, "
                          "less the length of the conversation)")
    try:
        session.check_request([0], GenerationOptions(max_new_tokens=max_tokens or 1, **options))
    except DFlashError as exc:
        message = str(exc)
        for option in ("top_k", "verify_len"):
            if message.startswith(option):
                flag = "--" + option.replace("_", "-")
                message = flag + message[len(option):]
        raise DFlashError(message) from None


def run_chat(session, stdin: TextIO = None, out: TextIO = None, notes: TextIO = None, **settings) -> int:
    """The read-reply loop until `/exit` or end of input; returns the exit status (0).

    Args:
        session: a loaded :class:`runtime.Session`.
        stdin, out, notes: input lines, replies, and notes/errors (default: the process's streams).
        **settings: see :class:`ChatSession` (system, max_tokens, temperature, ...).

    Raises:
        DFlashError: the model has no tokenizer or chat template, or a setting does not suit the
            artifact (see :func:`check_settings`).
    """
    stdin, out, notes = stdin or sys.stdin, out or sys.stdout, notes or sys.stderr
    if session.tokenizer is None or not session.tokenizer.chat_template:
        raise DFlashError("this model has no chat template; `python -m runtime chat` needs one")
    check_settings(session, settings.get("max_tokens"),
                   **{k: v for k, v in settings.items() if k not in ("system", "max_tokens")})
    if hasattr(stdin, "reconfigure"):  # bytes that are not UTF-8 reach `turn` (and are refused there), not a traceback
        stdin.reconfigure(errors="surrogateescape")
    chat = ChatSession(session, out, notes, **settings)
    prompt = "> " if stdin.isatty() else None
    print(f"chat with {session.artifact_dir} ({HELP})", file=notes, flush=True)
    while True:
        try:
            line = _read_line(stdin, prompt)
        except KeyboardInterrupt:
            print(f"\n({HELP})", file=notes, flush=True)
            continue
        if line is None or not chat.handle(line):
            return 0
