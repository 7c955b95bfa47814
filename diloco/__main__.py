"""``python -m diloco`` and the ``diloco`` command: the SIGTERM handler first, then the CLI."""

import gc
import os
import signal
import sys


def _exit_while_importing(signum: int, frame: object) -> None:
    # 75: restart me (diloco.runtime.ops.exit_codes.RESTART; not imported: this runs before any import)
    os.write(2, b"diloco: SIGTERM while starting (imports); exit 75 (restart me)\n")
    os._exit(75)


def entry() -> None:
    """Run the ``diloco`` command and exit with its code. A SIGTERM during the imports (a pod deleted
    while it starts) exits 75 at once: without a handler, a container's PID 1 drops it and the pod
    ends in the kubelet's SIGKILL; ``diloco.cli.main`` puts its own start-up handler in place next."""
    signal.signal(signal.SIGTERM, _exit_while_importing)
    from diloco.cli import main

    code = main()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it ends now, with main()'s code, whatever comes
    # The process ends here. Its last garbage collection would walk every object torch's import made
    # (seconds of CPU for each worker, agent and coordinator, on every exit and restart): skip it; the
    # exit frees the memory, and what main() had to close, flush or save it has.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
