"""Imported first by the sweep's forkserver: it takes the terminal's Ctrl-C from here on by
ignoring it.

The sweep starts the forkserver with SIGINT blocked (:func:`executors._start_forkserver`), so a
Ctrl-C while this interpreter starts stays pending instead of printing a traceback here. Setting
SIGINT to ignored discards that pending signal, and unblocking it afterwards restores the normal
mask for the forkserver and the workers it forks (they ignore SIGINT too: Ctrl-C is the parent's
job, which stops them with SIGTERM).
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
