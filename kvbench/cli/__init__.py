"""The `kvbench` command line. Subcommand groups live in sibling modules and are attached here."""

from __future__ import annotations

import os
import signal
import sys
import warnings

import click
import pyarrow as pa

from kvbench import __version__
from kvbench.errors import KvbenchError, KvbenchWarning
from kvbench.registry import Registry

# Library errors that are the user's input, not kvbench's bug: a file (or folder) named on the command line
# that cannot be opened, read or written, and data that Arrow refuses on reading a user's file. kvbench's own
# readers turn most of these into TraceFormatError naming the file; these are the ones that reach the CLI.
USER_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
USER_ARROW_ERRORS = (pa.ArrowInvalid,)
INTERNAL_ERROR_EXIT = 70  # EX_SOFTWARE (sysexits.h): kvbench's bug, not the user's input


def _is_users_input(exc: BaseException) -> bool:
    """Whether `exc` is a library error caused by the user's input or environment (see USER_OS_ERRORS)."""
    if isinstance(exc, USER_OS_ERRORS + USER_ARROW_ERRORS):
        return True
    # any other OSError raised while opening or writing a named file (name too long, a loop of links, disk full)
    return isinstance(exc, OSError) and getattr(exc, "filename", None) is not None


class LazyGroup(click.Group):
    """A group whose subcommands come from a Registry (entry points, `Registry.add_lazy`) and are imported when
    one is used, not when `kvbench` starts. A simulator run then loads what it needs and not, say, the
    calibration's scipy (an import of every command took 1.4 s of a 2 s `kvbench replay`)."""

    def __init__(self, *args, registry: Registry | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.registry = registry if registry is not None else Registry(None, "command")

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *self.registry})

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.registry:
            self.add_command(self.registry[name], name)
        return super().get_command(ctx, name)


class BackendOptionsCommand(click.Command):
    """A command that also takes the options of the backends its command line names (replay's one, sweep's
    grid): `backend_options(args)` lists them; they are added for one invocation and dropped after it, so the
    command as declared (another invocation's --help, the docs site) never shows what an earlier one loaded."""

    def backend_options(self, args: list[str]) -> list[click.Option]:
        raise NotImplementedError

    def _drop_backend_options(self) -> None:
        self.params = [p for p in self.params if not getattr(p, "_from_backend", False)]

    def parse_args(self, ctx, args):
        self._drop_backend_options()
        for opt in self.backend_options(args):
            opt._from_backend = True
            self.params.append(opt)
        try:
            return super().parse_args(ctx, args)
        except BaseException:  # --help, a usage error: the invocation ends here
            self._drop_backend_options()
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        finally:
            self._drop_backend_options()


class FriendlyGroup(LazyGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvbenchError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click's own: usage errors, --help, Ctrl-C at a prompt
        except Exception as exc:
            if os.environ.get("KVBENCH_DEBUG"):
                raise
            if _is_users_input(exc):
                click.secho(f"error: {exc}", fg="red", err=True)
                sys.exit(2)
            click.secho(
                f"error: internal error ({type(exc).__name__}: {exc}) — please report it with KVBENCH_DEBUG=1 output",
                fg="red",
                err=True,
            )
            sys.exit(INTERNAL_ERROR_EXIT)


# kvbench's commands, the core's and those a plug-in provides (engine-sim's `calibrate`), are the
# `kvbench.commands` entry points: pyproject.toml declares them, and an installed plug-in adds its own.
COMMANDS: Registry[click.Command] = Registry(None, "command", group="kvbench.commands")


@click.group(
    cls=FriendlyGroup,
    registry=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, prog_name="kvbench")
def main() -> None:
    """kvbench: replay LLM-serving workload traces through KV-cache simulators, real tensors and live
    engines, and report hit rates, fairness and latency.

    Set KVBENCH_DEBUG=1 to see Python tracebacks instead of one-line errors.
    """
    _stop_like_ctrl_c(click.get_current_context())
    warnings.showwarning = _one_line_warnings(warnings.showwarning)
    _keep_freed_memory()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_freed_memory() -> None:
    """Let glibc reuse the memory of freed arrays instead of handing it back to the kernel at once. By default
    an array of a few MB is mapped fresh and unmapped when freed, so the next one of its size takes a page
    fault per 4 KiB again: a simulator allocating per-point work arrays spent more time faulting than
    computing (prepare on the Mooncake trace: 3.2 ms, 1.5 ms with this). Arrays of 4 MiB or more are still
    mapped and unmapped, and at most 16 MiB freed is kept, so a run's peak memory hardly moves (+10 MB of
    ~510 on a 300k-request chat trace). No-op off glibc."""
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    mallopt(_M_TRIM_THRESHOLD, 16 << 20)


def _one_line_warnings(show):
    """kvbench's own warnings as one line on stderr, like its errors (Python's format names a
    source line of kvbench, which means nothing to a user); any other warning as Python shows it."""
    if getattr(show, "kvbench", False):
        return show

    def one_line(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, KvbenchWarning):
            click.echo(f"kvbench: warning: {message}", err=True)
        else:
            show(message, category, filename, lineno, file, line)

    one_line.kvbench = True
    return one_line


STOP_SIGNALS = ("SIGTERM", "SIGHUP")  # a `kill`, a job scheduler's stop, a closed terminal


def _as_ctrl_c(signum, frame) -> None:
    """Handle a stop signal as Ctrl-C: through SIGINT's current handler (asyncio's, during a live run, which
    cancels the run's task so it records what it has) or as KeyboardInterrupt."""
    on_ctrl_c = signal.getsignal(signal.SIGINT)
    if callable(on_ctrl_c):
        on_ctrl_c(signal.SIGINT, frame)
    else:  # SIGINT ignored (a background job of a non-interactive shell): a stop signal still stops
        raise KeyboardInterrupt


def _stop_like_ctrl_c(ctx: click.Context) -> None:
    """SIGTERM and SIGHUP stop a command the way Ctrl-C does, so that an interrupted run records what it
    measured, merges its results and removes its temporary files, for this command (the handlers before
    are put back when it ends: `kvbench` may be called inside another program)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers
    for name in STOP_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is not signal.SIG_IGN:  # `nohup kvbench …` ignores HUP
            before = signal.signal(number, _as_ctrl_c)
            ctx.call_on_close(lambda n=number, h=before: signal.signal(n, signal.SIG_DFL if h is None else h))
