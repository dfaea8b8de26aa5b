"""The line to one engine core, as its client sees it: messages to it, messages from it (read
by a thread of its own) and its death. The core is a process of this node (CoreProcess) or a
process on a headless node that joined over the network (RemoteCore)."""

from __future__ import annotations

import threading
from multiprocessing.connection import wait

import msgspec

from shardlm.config import EngineConfig
from shardlm.engine.core_process import run_engine_core
from shardlm.engine.errors import EngineDeadError
from shardlm.messages import EngineCoreOutputs, Failed, FromEngineCore, Ready, StartupFailed, UtilityResult, WaveStarted
from shardlm.processes import InParentEnvironment, clean_process_context


class CoreChannel:
    """One engine core as its client sees it: messages to it, messages from it, and its death.
    A reader thread hands each message to `on_message(index, msg)` and the death (a Failed
    message, the connection closing or the process exiting) to `on_death(index, reason)`."""

    def __init__(self, config: EngineConfig, index: int, send_conn, recv_conn, sentinels: list):
        self.index = index
        self.config = config
        self._send_conn, self._recv_conn, self._sentinels = send_conn, recv_conn, sentinels
        self._decode = msgspec.msgpack.Decoder(FromEngineCore).decode
        self._send_lock = threading.Lock()
        self.closing = False
        self.dead_reason: str | None = None
        self.in_failed_steps: set[str] = set()    # requests of the steps running when it failed
        self._reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        par = self.config.parallel
        if par.data_parallel_size == 1:
            return "The engine core"
        first = par.rank_offset
        ranks = f"world rank {first}" if par.world_size == 1 else f"world ranks {first}-{first + par.world_size - 1}"
        return f"Data parallel replica {par.data_parallel_rank} ({ranks})"

    def _gone(self) -> str:
        """Why the channel ended without a Failed message."""
        raise NotImplementedError

    def wait_ready(self) -> int:
        """Its KV cache blocks once it started; raises why it did not."""
        msg = self._next_message()
        if isinstance(msg, Ready):
            return msg.num_blocks
        if isinstance(msg, StartupFailed):
            raise RuntimeError(f"{self.name} failed to start: {msg.error}")
        raise EngineDeadError(f"{self.name} ended during start-up: {self._gone()}")

    def _next_message(self):
        """The next message from the core; None when its connection closed or its process ended."""
        if self._recv_conn not in wait([self._recv_conn, *self._sentinels]):
            return None
        try:
            return self._decode(self._recv_conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def start_reader(self, on_message, on_death) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_message, on_death),
                                        name=f"shardlm-core-outputs-{self.index}", daemon=True)
        self._reader.start()

    def _read(self, on_message, on_death) -> None:
        while True:
            msg = self._next_message()
            if isinstance(msg, (EngineCoreOutputs, UtilityResult, WaveStarted)):
                on_message(self.index, msg)
                continue
            if isinstance(msg, Failed):
                self.in_failed_steps = set(msg.in_failed_steps)
                self.dead_reason = f"{self.name} stopped: {msg.error}"
                on_death(self.index, self.dead_reason)
                return
            if not self.closing:
                self.dead_reason = f"{self.name} {self._gone()}"
                on_death(self.index, self.dead_reason)
            return

    def send(self, data: bytes) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        with self._send_lock:
            try:
                self._send_conn.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError(self.dead_reason or f"{self.name} is gone.") from e

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        self.closing = True
        try:
            self.send(shutdown_msg)
        except EngineDeadError:
            pass

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.join(5)
        for conn in {id(c): c for c in (self._send_conn, self._recv_conn)}.values():
            conn.close()


class CoreProcess(CoreChannel):
    """An engine core in a process of this node, behind two pipes."""

    def __init__(self, config: EngineConfig, index: int, node_address: str | None = None):
        ctx = clean_process_context()
        req_recv, req_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        # not daemonic: it starts the worker processes itself; the client stops it
        self.process = ctx.Process(target=InParentEnvironment(run_engine_core), name=f"shardlm-engine-core-{index}",
                                   args=(config, req_recv, out_send, node_address))
        self.process.start()
        req_recv.close()
        out_send.close()
        super().__init__(config, index, req_send, out_recv, [self.process.sentinel])

    def _gone(self) -> str:
        self.process.join(1)
        return f"process (pid {self.process.pid}) died (exit code {self.process.exitcode})."

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        if self.process.is_alive():
            super().shutdown(shutdown_msg, timeout)
            self.process.join(timeout)
        self.closing = True
        if self.process.is_alive():       # it ignores SIGTERM (leave_stop_signals_to_the_parent)
            self.process.kill()
            self.process.join()
        self._close()


class RemoteCore(CoreChannel):
    """An engine core on a headless node, behind the socket it joined through (dp_remote.py)."""

    def __init__(self, config: EngineConfig, index: int, conn):
        super().__init__(config, index, conn, conn, [])

    def _gone(self) -> str:
        return "closed its connection (its node or process is gone)."

    def shutdown(self, shutdown_msg: bytes, timeout: float) -> None:
        super().shutdown(shutdown_msg, timeout)
        # it exits after Shutdown; the reader sees the connection close
        if self._reader is not None:
            self._reader.join(timeout)
        self._close()
