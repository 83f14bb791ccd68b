"""``python -m bench._nofile PROGRAM ARGS...``: raise RLIMIT_NOFILE's soft limit to the hard
limit, then exec PROGRAM (same pid), for processes that do not raise it themselves (the
``dispatcher serve`` and ``dispatcher node`` daemons of the ``peer`` and ``streams`` sections)."""

from __future__ import annotations

import os
import resource
import sys


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m bench._nofile PROGRAM [ARGS...]")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is still capped by the kernel's nr_open: ask for 2**20 then.
    soft = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
