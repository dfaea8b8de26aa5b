"""Imported by the fork server alone, last of its preloads (processes.FORK_SERVER_PRELOAD): once its
parent has gone, it exits without the interpreter's teardown of torch and transformers (about
0.8 s of CPU for nothing: it holds no file or buffer to flush). Its children are not affected: a
multiprocessing child ends with os._exit and never runs atexit handlers."""

import atexit
import os

atexit.register(os._exit, 0)
