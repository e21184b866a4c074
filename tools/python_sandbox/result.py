"""The outcome of one sandboxed call and its rendering into the text the model reads."""

from __future__ import annotations

import signal
from dataclasses import dataclass


def truncate_text(text: str, max_chars: int, *, keep: str = "head") -> tuple[str, bool]:
    """Cut ``text`` to at most ``max_chars`` characters of content plus a visible marker.

    ``keep="head"`` keeps the beginning (program output reads top-down); ``keep="tail"`` keeps the end
    (a traceback's last line names the error).
    """
    if len(text) <= max_chars:
        return text, False
    dropped = len(text) - max_chars
    marker = f"[... output truncated: {dropped} more characters ...]"
    if keep == "tail":
        return f"{marker}\n{text[-max_chars:]}", True
    return f"{text[:max_chars]}\n{marker}", True


def _signal_name(exit_code: int | None) -> str | None:
    # bwrap, unshare and shells report a child killed by signal N as exit status 128 + N.
    if exit_code is None:
        return None
    number = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 160 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class SandboxResult:
    """What a sandboxed program did. ``to_model_text()`` gives the ARPO tool-result text."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # None: the program never ran (see ``error``)
    timed_out: bool = False  # the wall-clock limit stopped it
    truncated: bool = False  # captured output was cut (capture cap, or longer than max_output_chars)
    output_limit_exceeded: bool = False  # the program was stopped for writing more than max_capture_bytes
    error: str | None = None  # the sandbox itself failed (never the program's own error)
    isolation: str = ""  # bwrap | unshare | none
    duration_s: float = 0.0
    timeout_s: float = 0.0
    cpu_time_s: float = 0.0
    max_output_chars: int = 4096
    call_memory_mb: int = 0  # the whole call's memory limit
    memory_peak_mb: float | None = None  # highest memory use of the whole call (None: no cgroup to ask)
    oom_kills: int = 0  # processes the kernel killed for exceeding the call's memory limit

    @property
    def ok(self) -> bool:
        return (self.error is None and self.exit_code == 0 and not self.timed_out
                and not self.output_limit_exceeded)

    @property
    def killed_by(self) -> str | None:
        """Name of the signal that ended the program (``SIGXCPU`` = CPU limit, ``SIGKILL`` = hard limit)."""
        return _signal_name(self.exit_code)

    def to_model_text(self, max_chars: int | None = None) -> str:
        """ARPO semantics: stdout on success, stderr on failure, with a plain note for limit hits.

        Cut to ``max_chars`` (default: the call's ``max_output_chars``) with a visible marker.
        """
        limit = max_chars or self.max_output_chars
        if self.error is not None:
            return truncate_text(f"Error: the Python sandbox could not run this code: {self.error}",
                                 limit, keep="head")[0]
        if self.ok:
            text = truncate_text(self.stdout.strip(), limit, keep="head")[0]
            # Children killed for memory while the main process carried on: say why they died.
            return f"{text}\n{self._memory_note()}".strip() if self.oom_kills else text
        if self.output_limit_exceeded:
            text, _ = truncate_text(self.stdout.strip(), limit, keep="head")
            return (f"{text}\n[execution stopped: the program wrote more than the output limit]").strip()
        if self.timed_out:
            # What the program printed before it hung can show where it hung.
            body = (self.stderr.strip() or self.stdout.strip())
            body = truncate_text(body, limit, keep="tail")[0] if body else ""
            note = f"TimeoutError: execution exceeded the time limit of {self.timeout_s:g} seconds"
            return f"{body}\n{note}".strip()
        body = truncate_text(self.stderr.strip(), limit, keep="tail")[0]
        note = self._death_note()
        if note and note not in body:
            body = f"{body}\n{note}".strip()
        return body or f"Error: the program exited with status {self.exit_code} and printed no error."

    def _memory_note(self) -> str:
        return (f"Killed: {self.oom_kills} process(es) of this program exceeded the memory limit of "
                f"{self.call_memory_mb} MiB that all its processes share.")

    def _death_note(self) -> str:
        name = self.killed_by
        if self.oom_kills:
            return self._memory_note()
        if name == "SIGXCPU":
            return f"Killed: the program used more than its CPU time limit of {self.cpu_time_s:g} seconds."
        if name == "SIGKILL":
            return "Killed: the program was stopped (CPU, memory or process limit)."
        if name is not None:
            return f"Killed by {name}."
        return ""
