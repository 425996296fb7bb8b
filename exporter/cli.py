"""The ``policy-export`` command line: parse (:mod:`exporter.cli_args`), dispatch to the command
(:mod:`exporter.commands`), and turn every error into its exit code and one message on stderr.
What a command prints fits the width (:mod:`exporter.screen`: the terminal's, else 80 columns unless
``COLUMNS`` says otherwise) and names every path as it was typed.

Exit codes: 0 success; 1 a check failed (parity, hashes); 2 bad input or usage (one message on
stderr, no traceback); 3 an unexpected internal error, a bug in the package (``--debug`` shows the
traceback); 130 interrupted (SIGINT, SIGTERM, SIGHUP).

A reader that goes away early (``policy-export verify OUT | head -1``) changes none of them: a
write to a closed stdout or stderr is dropped (the stream then writes to the null device), the
command runs to its end, and its exit code is the one it would have had with the pipe open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator, Sequence

from policy_export.exporter import commands
from policy_export.exporter.cli_args import (  # noqa: F401 (build_parser and the exit codes: re-exported)
    EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, PROG, build_parser, one_line,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code.

    SIGINT, SIGTERM and SIGHUP are handled until it returns: before an export is in place they
    stop it (nothing left behind, exit 130); once it is in place the export is complete, so the
    command finishes, says on stderr that it was interrupted after the export was complete, and
    exits 0. A closed stdout or stderr (a pipe whose reader has gone) changes no exit code
    (:func:`closed_pipes_tolerated` holds until it returns).
    """
    with closed_pipes_tolerated():
        return _main(argv)


def error_line(text: str) -> None:
    """One message on stderr, wrapped at its width (:func:`exporter.screen.error_line`)."""
    from policy_export.exporter.screen import error_line as say

    say(text)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if not [a for a in given if a != "--debug"]:  # bare: the help, which lists the commands
        parser.print_help()
        return EXIT_OK
    args = parser.parse_args(given)
    from policy_export.exporter.staging import Interrupted, signals_as_interrupts

    with signals_as_interrupts() as signals:  # SIGTERM and SIGHUP clean up like Ctrl-C
        try:
            code = _run(args)
            signals.record_only()
        except KeyboardInterrupt as e:  # raised where _run could not report it (progress set-up)
            signals.record_only()
            code = _interrupted(e.signum if isinstance(e, Interrupted) else None)
        late = signals.take()
        if late is not None and code != EXIT_INTERRUPTED:
            import signal

            if signals.complete:
                error_line(f"{PROG}: interrupted by {signal.Signals(late).name} after the export was complete")
            else:  # the signal was swallowed where Python ignores exceptions; the command did not stop
                code = _interrupted(late)
        return code


def console_main() -> int:
    """The console script and ``python -m policy_export``: :func:`main`, then signals ignored while
    the interpreter shuts down. The outcome is decided once :func:`main` returns (an export in
    place is complete, exit 0); a signal during the shutdown (TensorFlow's destructors can take a
    while) must not turn that into a death by signal."""
    code = main()
    import signal

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    return code


def _closed_pipe(error: OSError) -> bool:
    """Whether ``error`` says the reader of the stream has gone (EPIPE)."""
    return isinstance(error, BrokenPipeError) or error.errno == errno.EPIPE


class ClosedPipeSafe:
    """A text stream (sys.stdout, sys.stderr) whose reader may go away: the first write or flush
    that finds the pipe closed points the stream's file descriptor at the null device (so that
    no later flush, the interpreter's last one included, fails), and every write after it is
    dropped. Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream, self.reader_gone = stream, False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                if not _closed_pipe(e):
                    raise
                self._drop()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except OSError as e:
                if not _closed_pipe(e):
                    raise
                self._drop()

    def isatty(self) -> bool:
        return not self.reader_gone and self._stream.isatty()

    def _drop(self) -> None:
        self.reader_gone = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor: nothing to point
            fd = self._stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what the closed pipe did not take goes to the null device

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def closed_pipes_tolerated() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`ClosedPipeSafe` streams (rich's consoles
    write to them too) until the block ends; both are flushed before they are put back.

    SIGPIPE stays ignored (Python's default), so a closed pipe is an EPIPE error here rather
    than a death by signal."""
    saved = sys.stdout, sys.stderr
    safe = [None if s is None or isinstance(s, ClosedPipeSafe) else ClosedPipeSafe(s) for s in saved]
    sys.stdout, sys.stderr = (w or s for w, s in zip(safe, saved))
    try:
        yield
    finally:
        for stream in safe:
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
        sys.stdout, sys.stderr = saved


def _interrupted(signum: int | None) -> int:
    import signal

    how = signal.Signals(signum).name if signum is not None else "SIGINT"
    error_line(f"{PROG}: interrupted by {how}; no partial export was left behind")
    return EXIT_INTERRUPTED


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt an error was raised while handling, if any: TensorFlow's scope managers
    raise their own error ("Exiting device scope without proper scope nesting") when an interrupt
    unwinds them, and the interrupt is then only the error's context."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, KeyboardInterrupt):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _run(args) -> int:
    """Run the command of ``args``; every error becomes its exit code and one message on stderr."""
    from policy_export.exporter import screen
    from policy_export.exporter.progress import for_terminal
    from policy_export.exporter.staging import Interrupted, signals_as_interrupts

    screen.paths_as_typed(screen.typed_arguments(args))  # every path printed as the user typed it
    out, err = screen.console_for(sys.stdout), screen.console_for(sys.stderr, stderr=True)
    # progress goes to stderr; stdout (tables, JSON) is unchanged by it. The long commands report
    # every stage; the others show on a terminal only what their seconds go to (TensorFlow loading)
    quiet = bool(getattr(args, "quiet", False))
    args.progress = (for_terminal(quiet) if args.command in ("export", "verify", "convert")
                     else for_terminal(quiet, plain=False, transient=True))
    with signals_as_interrupts() as signals:  # the session main() holds
        try:
            return getattr(commands, f"cmd_{args.command.replace('-', '_')}")(args, out)
        except KeyboardInterrupt as e:
            signals.record_only()  # a second signal while reporting is only recorded
            args.progress.close(failed=True)
            return _interrupted(e.signum if isinstance(e, Interrupted) else None)
        except Exception as e:  # the one place every error is turned into an exit code
            signals.record_only()
            interrupt = _interrupt_behind(e)
            if interrupt is not None:  # a context manager that failed while the interrupt unwound it
                args.progress.close(failed=True)
                return _interrupted(interrupt.signum if isinstance(interrupt, Interrupted) else None)
            if signals.pending is not None and not signals.complete:
                # a signal arrived and its interrupt was swallowed inside a library, which then failed in
                # the state it left (TensorFlow, say): the command stopped because of the signal
                args.progress.close(failed=True)
                return _interrupted(signals.take())
            from policy_export.errors import PolicyExportError

            args.progress.close(failed=True)  # a live display is cleared: the error line stands alone
            if args.debug:
                err.print_exception()
            if isinstance(e, PolicyExportError):
                report = getattr(e, "report", None)
                if report is not None:  # the verdict per format (the full table with --verbose)
                    from policy_export.exporter.reports import print_verdict

                    verbose = bool(getattr(args, "verbose", False))
                    print_verdict(out, report, "parity", verbose)
                    if not verbose:
                        where = getattr(args, "report_json", None) or "--report-json FILE"
                        screen.say(out, f"full table: --verbose, or {where}")
                error_line(f"{PROG}: error: {one_line(e)}")
                return e.exit_code
            hint = "" if args.debug else "; run with --debug for the traceback"
            error_line(f"{PROG}: internal error (a bug in {PROG}, please report it): {type(e).__name__}: "
                       f"{one_line(e)}{hint}")
            return EXIT_INTERNAL
        finally:
            args.progress.close()
            screen.paths_as_typed(())  # the next command (in this process) says which paths it was given




if __name__ == "__main__":
    sys.exit(main())
