"""
runtime/command.py -- what every command shares at its edges: an error a user can fix is one
`error:` line, an interruption is one line saying what was kept, and no file is ever half
written.

    if __name__ == "__main__":
        run(main, errors=(ValueError,), interrupted="nothing was written")

Ctrl-C (SIGINT) and SIGTERM end a command the same way: its files are whole (each is written to
a temporary name beside it and renamed in one step, the temporary removed if the write is cut
short), one line on stderr says what was saved and how to go on, and the exit status is the
shell's for that signal: 130 for Ctrl-C, 143 for SIGTERM.
"""

import contextlib
import os
import re
import signal
import sys
import traceback

from speculative import DrafterError


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python is when it arrives, as Ctrl-C is: every cleanup that runs
    for one runs for the other."""


def _terminate(signum, frame):
    raise Terminated()


def sigterm_as_interrupt():
    """From here on SIGTERM raises Terminated wherever Python is, as Ctrl-C raises
    KeyboardInterrupt; returns the handler it replaces."""
    return signal.signal(signal.SIGTERM, _terminate)


def ending(code=1):
    """The command is ending on an error, its line printed or on its way: from here an interrupt
    (Ctrl-C, or the SIGTERM torchrun sends every other rank when one fails) ends it at once with
    exit status `code` and nothing more, instead of a second traceback from wherever it is
    waiting or tearing down."""
    def quietly(signum, frame):
        raise SystemExit(code)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, quietly)


def run(main, errors=(), interrupted="nothing was written"):
    """main() as a command. An exception of `errors` ends in 'error: ...' and exit status 1 (a
    speculative.DrafterError too, then the drafter's own traceback); an
    interruption in 'interrupted: <interrupted>' (a string, or a function giving one then) and
    exit status 130 (Ctrl-C) or 143 (SIGTERM)."""
    previous = sigterm_as_interrupt(), signal.getsignal(signal.SIGINT)
    try:
        return main()
    except DrafterError as e:  # a drafter's bug: its name first, then where in its code
        ending()
        print(f"error: {e}", file=sys.stderr)
        if e.__cause__ is not None:
            traceback.print_exception(e.__cause__, file=sys.stderr)
        raise SystemExit(1) from None
    except errors as e:
        ending()
        raise SystemExit(f"error: {e}") from None
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        ending()
        asked = re.search(r"allocate (\d+) bytes", str(e))
        size = f"{int(asked.group(1)) / 2 ** 30:,.1f} GiB at once" if asked else str(e)[:100]
        raise SystemExit("error: what the flags ask for does not fit in this machine's memory "
                         f"({size}): lower the sizes") from None
    except KeyboardInterrupt as e:
        note = interrupted() if callable(interrupted) else interrupted
        print(f"interrupted: {note}", file=sys.stderr)
        raise SystemExit(status(e)) from None
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def out_of_memory(e):
    """Did an allocation fail (a size too large for the machine's memory)?"""
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text or "out of memory" in text


def status(interruption):
    """The exit status of a command ended by this interruption: the shell's, 128 + the signal."""
    return 128 + int(signal.SIGTERM if isinstance(interruption, Terminated) else signal.SIGINT)


@contextlib.contextmanager
def replacing(path):
    """A temporary name beside `path` to write to; when the block ends it becomes `path` in one
    rename, and if the block fails or is interrupted it is removed: a reader finds the old file
    or the new one, never half of one, and no temporary is left behind."""
    tmp = f"{path}.tmp{os.getpid()}"  # the same folder, so os.replace is an atomic rename
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def atomic_write(path, data: bytes | str):
    """Write `data` to `path` whole or not at all."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
