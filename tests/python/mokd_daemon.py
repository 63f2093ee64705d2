"""A mokd on a temporary socket (cpu backend) for the numpy client's suites."""

import os
import subprocess
import tempfile
import time

import mokd

MOKD = os.environ.get("MOKD_BIN", "build/mokd")


class Daemon:
    def __init__(self, prefix, args=()):
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.sock = os.path.join(self.dir, "mokd.sock")
        self.log = open(os.path.join(self.dir, "mokd.log"), "w")
        self.proc = subprocess.Popen([MOKD, "--socket", self.sock, "--config", "/dev/null",
                                      "--cpu-threads", "2", *args], stderr=self.log)
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

    def stop(self):
        self.proc.terminate()
        rc = self.proc.wait(timeout=30)
        self.log.close()
        assert rc == 0, "mokd exited with %d" % rc
