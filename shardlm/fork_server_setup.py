"""Imported by the fork server alone, last of its preloads (processes.FORK_SERVER_PRELOAD).

- It ignores SIGINT and SIGTERM, and so do the engine cores and workers it forks: a signal to the
  whole process group (Ctrl-C, systemd's stop) is the server's to act on, and a drain needs them.
  The fork server still ends with its parent, and each child with the fork server.
- Once its parent has gone, it exits without the interpreter's teardown of torch and transformers
  (about 0.8 s of CPU for nothing: it holds no file or buffer to flush). Its children are not
  affected: a multiprocessing child ends with os._exit and never runs atexit handlers."""

import atexit
import os

from shardlm.utils import leave_stop_signals_to_the_parent

leave_stop_signals_to_the_parent()
atexit.register(os._exit, 0)
