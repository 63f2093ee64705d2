"""A mokd on a temporary socket: on the cpu backend for the numpy client's
suites (Daemon), on the cuda backend for the PyTorch ones (CudaDaemon)."""

import os
import subprocess
import tempfile
import time

import mokd

MOKD = os.environ.get("MOKD_BIN", "build/mokd")


class Daemon:
    def __init__(self, prefix, args=()):
        self.spawn(prefix, ["--cpu-threads", "2", *args])
        for _ in range(400):
            if os.path.exists(self.sock):
                try:
                    mokd.Client(self.sock).close()
                    return
                except mokd.MokError:
                    pass
            assert self.proc.poll() is None, "mokd exited; see %s" % self.log.name
            time.sleep(0.01)
        raise AssertionError("mokd did not come up on %s" % self.sock)

    def spawn(self, prefix, args):
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.sock = os.path.join(self.dir, "mokd.sock")
        self.log = open(os.path.join(self.dir, "mokd.log"), "w")
        self.proc = subprocess.Popen([MOKD, "--socket", self.sock, "--config", "/dev/null",
                                      *args], stderr=self.log)

    def stop(self):
        self.proc.terminate()
        rc = self.proc.wait(timeout=30)
        self.log.close()
        assert rc == 0, "mokd exited with %d" % rc


class CudaDaemon(Daemon):
    """Waits only until the socket is there or mokd has exited: whether a
    mokd that did not start fails the suite or skips it is the suite's call
    (proc.poll() is not None)."""

    def __init__(self, prefix):
        self.spawn(prefix, ["--backend", "cuda"])
        for _ in range(500):
            if os.path.exists(self.sock) or self.proc.poll() is not None:
                break
            time.sleep(0.01)
