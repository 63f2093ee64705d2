"""The operators' side against a real mokd: the Prometheus listener scraped
with real HTTP clients (urllib over TCP, http.client over the Unix socket,
curl when installed), mokctl health / sessions / evict, and a job id sent
from the environment."""

import http.client
import os
import re
import shutil
import socket
import subprocess
import time
import types
import unittest
import urllib.error
import urllib.request

import numpy as np

import mokd
from mokd_daemon import Daemon

MOKCTL = os.path.join(os.path.dirname(os.environ.get("MOKD_BIN", "build/mokd")), "mokctl")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(text):
    """{'name{labels}': value} of an exposition, checking each line's form."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) [a-z_]+ .+", line), line
            continue
        m = re.match(r'([a-z_]+(\{[a-z_]+="[^"\\\n]*"(,[a-z_]+="[^"\\\n]*")*\})?) (\S+)$', line)
        assert m, "not an exposition line: %r" % line
        out[m.group(1)] = float(m.group(4))
    return out


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def small_layer(c):
    rng = np.random.default_rng(3)
    H, I, E, K, T = 64, 32, 4, 2, 8
    layer = mokd.Layer(c, hidden=H, intermediate=I, experts=E, top_k=K)
    w = [mokd.to_bf16(rng.standard_normal(s).astype(np.float32) * 0.1)
         for s in ((E, I, H), (E, I, H), (E, H, I))]
    layer.set_weights(*w)
    x = mokd.to_bf16(rng.standard_normal((T, H)).astype(np.float32))
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    tw = rng.random((T, K)).astype(np.float32)
    return layer, x, ids, tw


class MetricsTest(unittest.TestCase):
    def setUp(self):
        self.port = free_port()
        self.d = Daemon("mokd-metrics-", ["--metrics", "127.0.0.1:%d" % self.port])
        self.url = "http://127.0.0.1:%d/metrics" % self.port

    def tearDown(self):
        self.d.stop()

    def scrape(self):
        with urllib.request.urlopen(self.url, timeout=10) as r:
            self.assertEqual(r.status, 200)
            self.assertEqual(r.headers["Content-Type"],
                             "text/plain; version=0.0.4; charset=utf-8")
            return parse(r.read().decode())

    def test_values_follow_requests(self):
        m0 = self.scrape()
        self.assertEqual(m0['mokd_build_info{version="0.1.0",protocol_min="1",'
                            'protocol_max="3",backend="cpu"}'], 1)
        self.assertEqual(m0["mokd_sessions"], 0)
        self.assertEqual(m0['mokd_requests_total{op="forward"}'], 0)
        os.environ["MOKD_JOB_ID"] = "job-42"
        try:
            c = mokd.Client(self.d.sock)
        finally:
            del os.environ["MOKD_JOB_ID"]
        sid = c.info()["session_id"]
        layer, x, ids, tw = small_layer(c)
        out, ctx = layer.forward(x, ids, tw)
        layer.backward(ctx, np.zeros_like(x))
        with self.assertRaises(mokd.MokError):
            c.destroy_arena(types.SimpleNamespace(id=123456))  # an error it counts
        m1 = self.scrape()
        self.assertEqual(m1["mokd_sessions"], 1)
        self.assertEqual(m1['mokd_requests_total{op="forward"}'], 1)
        self.assertEqual(m1['mokd_requests_total{op="backward"}'], 1)
        self.assertGreaterEqual(m1['mokd_requests_total{op="hello"}'], 1)
        self.assertEqual(m1['mokd_errors_total{op="destroy_arena"}'], 1)
        self.assertEqual(m1['mokd_errors_total{op="forward"}'], 0)
        self.assertEqual(m1["mokd_compute_seconds_count"], 2)
        self.assertEqual(m1['mokd_compute_seconds_bucket{le="+Inf"}'], 2)
        self.assertGreater(m1["mokd_compute_seconds_sum"], 0)
        held = m1['mokd_session_memory_bytes{session="%d",job="job-42",kind="arena"}' % sid]
        self.assertGreater(held, 0)
        self.assertEqual(m1['mokd_memory_bytes{kind="arena"}'], held)
        self.assertGreater(m1['mokd_session_memory_bytes{session="%d",job="job-42",'
                              'kind="context"}' % sid], 0)
        buckets = [v for k, v in m1.items() if k.startswith("mokd_queue_seconds_bucket")]
        self.assertEqual(buckets, sorted(buckets))  # cumulative
        c.close()
        time.sleep(0.2)
        m2 = self.scrape()
        self.assertEqual(m2["mokd_sessions"], 0)
        self.assertEqual(m2['mokd_memory_bytes{kind="arena"}'], 0)
        self.assertFalse([k for k in m2 if k.startswith("mokd_session_memory_bytes")])
        self.assertEqual(m2["mokd_scrapes_total"], m1["mokd_scrapes_total"] + 1)

    def test_tenants_are_counted(self):
        os.environ["MOKD_JOB_ID"] = "job-7"
        try:
            c = mokd.Client(self.d.sock)
        finally:
            del os.environ["MOKD_JOB_ID"]
        other = mokd.Client(self.d.sock)  # no job: its uid is the tenant
        steps = 'mokd_tenant_steps_total{tenant="job:job-7"}'
        queued = 'mokd_tenant_queued{tenant="job:job-7"}'
        m0 = self.scrape()
        self.assertEqual((m0[steps], m0[queued]), (0, 0))
        layer, x, ids, tw = small_layer(c)
        out, ctx = layer.forward(x, ids, tw)
        layer.backward(ctx, np.zeros_like(x))
        layer.forward(x, ids, tw, inference=True)
        m1 = self.scrape()
        self.assertEqual((m1[steps], m1[queued]), (3, 0))
        self.assertGreater(m1['mokd_tenant_memory_bytes{tenant="job:job-7"}'], 0)
        mine = 'mokd_tenant_steps_total{tenant="uid:%d"}' % os.getuid()
        self.assertEqual(m1[mine], 0)
        layer2, x, ids, tw = small_layer(other)
        layer2.forward(x, ids, tw, inference=True)
        m2 = self.scrape()
        self.assertEqual((m2[steps], m2[mine]), (3, 1))
        c.close()
        other.close()
        time.sleep(0.2)
        m3 = self.scrape()  # a tenant with no session, work or memory goes
        self.assertFalse([k for k in m3 if 'tenant="job:job-7"' in k])

    def test_quota_rejections_are_counted(self):
        self.d.stop()
        self.d = Daemon("mokd-metrics-", ["--metrics", "localhost:%d" % self.port,
                                          "--session-quota-bytes", "1M",
                                          "--tenant-quota-bytes", "uid:%d=1M" % os.getuid()])
        c = mokd.Client(self.d.sock)
        with self.assertRaises(mokd.MokError) as e:
            c.arena(4 << 20)
        self.assertIn("quota", str(e.exception))
        self.assertEqual(self.scrape()["mokd_quota_rejections_total"], 1)
        c2 = mokd.Client(self.d.sock)
        c.arena(768 << 10)
        with self.assertRaises(mokd.MokError) as e:
            c2.arena(768 << 10)  # under its session quota, over its uid's together
        self.assertIn("tenant uid:%d would hold" % os.getuid(), str(e.exception))
        self.assertEqual(self.scrape()["mokd_quota_rejections_total"], 2)
        c2.close()
        c.close()

    def raw(self, data, shut=True):
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
            return s.recv(65536).decode(errors="replace")

    def test_bad_requests_get_http_errors(self):
        for method, code in (("POST", 405), ("PUT", 405)):
            req = urllib.request.Request(self.url, method=method, data=b"x")
            with self.assertRaises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            self.assertEqual(e.exception.code, code)
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(self.url.replace("/metrics", "/"), timeout=10)
        self.assertEqual(e.exception.code, 404)
        self.assertTrue(self.raw(b"garbage\r\n\r\n").startswith("HTTP/1.1 400 "))
        line = b"GET /metrics HTTP/1.1\r\n"  # and headers up to the bound, never ending
        self.assertTrue(self.raw(line + b"X" * (4096 - len(line)), shut=False)
                        .startswith("HTTP/1.1 431 "))
        head = self.raw(b"HEAD /metrics HTTP/1.1\r\n\r\n")
        self.assertTrue(head.startswith("HTTP/1.1 200 ") and head.endswith("\r\n\r\n"))
        self.scrape()  # and it still serves

    def test_slow_and_many_clients_do_not_block_it(self):
        idle = []
        for _ in range(20):  # more than it keeps open: the rest are closed at once
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.sendall(b"GET /metr")  # and never more
            idle.append(s)
        c = mokd.Client(self.d.sock)  # the daemon still serves its clients
        c.ping()
        c.close()
        for s in idle:
            s.close()
        time.sleep(0.1)
        self.scrape()
        # a client that stalls is cut off at the deadline
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            t0 = time.monotonic()
            self.assertEqual(s.recv(100), b"")
            self.assertLess(time.monotonic() - t0, 8)

    def test_curl_scrapes_it(self):
        if shutil.which("curl") is None:
            self.skipTest("curl is not installed (deploy/install-deps.sh installs it)")
        out = subprocess.run(["curl", "-sf", self.url], capture_output=True, text=True,
                             timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("mokd_sessions 0", out.stdout)


class UnixMetricsTest(unittest.TestCase):
    def test_scrape_over_a_unix_socket(self):
        d = Daemon("mokd-metrics-unix-", [])
        path = os.path.join(d.dir, "metrics.sock")
        d.stop()
        d = Daemon("mokd-metrics-unix-", ["--metrics", path])
        try:
            conn = UnixHTTP(path)
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            self.assertEqual(r.status, 200)
            self.assertEqual(parse(r.read().decode())["mokd_sessions"], 0)
            conn.close()
        finally:
            d.stop()
        self.assertFalse(os.path.exists(path))  # removed at the stop

    def test_a_bad_listener_stops_start_up(self):
        out = subprocess.run([os.environ.get("MOKD_BIN", "build/mokd"), "--config",
                              "/dev/null", "--metrics", "0.0.0.0:9464"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 2)
        self.assertIn("metrics: \"0.0.0.0:9464\" is neither an absolute Unix socket path "
                      "nor 127.0.0.1:PORT or localhost:PORT", out.stderr)
        d = Daemon("mokd-metrics-bad-", [])  # only for a fresh directory
        d.stop()
        out = subprocess.run([os.environ.get("MOKD_BIN", "build/mokd"), "--config",
                              "/dev/null", "--backend", "cpu", "--socket",
                              os.path.join(d.dir, "s.sock"), "--metrics",
                              os.path.join(d.dir, "no", "m.sock")],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 1)
        self.assertIn("metrics: cannot listen on %s/no/m.sock" % d.dir, out.stderr)
        self.assertFalse(os.path.exists(os.path.join(d.dir, "s.sock")))


class MokctlTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon("mokd-mokctl-ops-", ["--allow-uids", "65534"])

    def tearDown(self):
        self.d.stop()

    def mokctl(self, *args, **kw):
        return subprocess.run([MOKCTL, "--socket", self.d.sock, *args], capture_output=True,
                              text=True, timeout=60, **kw)

    def test_health(self):
        out = self.mokctl("health")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertRegex(out.stdout, r"^ready: mokd 0\.1\.0, backend cpu, executor round "
                                     r"trip [0-9.]+ us\n$")
        out = subprocess.run([MOKCTL, "--socket", self.d.sock + ".none", "health"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 1)
        self.assertTrue(out.stdout.startswith("not ready: cannot connect to mokd"), out.stdout)

    def test_health_times_out_on_a_silent_daemon(self):
        path = os.path.join(self.d.dir, "silent.sock")
        with socket.socket(socket.AF_UNIX) as s:  # accepts, never answers
            s.bind(path)
            s.listen(1)
            t0 = time.monotonic()
            out = subprocess.run([MOKCTL, "--socket", path, "health", "--timeout", "1"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 1)
        self.assertEqual(out.stdout, "not ready: mokd did not answer within 1 s\n")
        self.assertLess(time.monotonic() - t0, 10)

    def test_sessions_and_evict(self):
        os.environ["SLURM_JOB_ID"] = "9001"
        try:
            a, b = mokd.Client(self.d.sock, name="trainer"), mokd.Client(self.d.sock)
        finally:
            del os.environ["SLURM_JOB_ID"]
        other = mokd.Client(self.d.sock)
        sid = a.info()["session_id"]
        layer, x, ids, tw = small_layer(a)
        out, ctx = layer.forward(x, ids, tw)
        table = self.mokctl("sessions")
        self.assertEqual(table.returncode, 0, table.stderr)
        rows = [r.split() for r in table.stdout.splitlines()[1:]]
        jobs = sorted(r[3] for r in rows)
        self.assertEqual(jobs, ["-", "-", "9001", "9001"])  # mokctl's own session, other
        mine = [r for r in rows if r[0] == str(sid)][0]
        self.assertEqual((mine[1], mine[3], mine[4]), (str(os.getpid()), "9001", "trainer"))
        self.assertGreater(int(mine[6]), 0)   # arena bytes
        self.assertEqual(mine[9], "1")        # one context
        del out, ctx
        ev = self.mokctl("evict", "--job", "9001")
        self.assertEqual(ev.returncode, 0, ev.stdout + ev.stderr)
        self.assertEqual(ev.stdout, "evicted job 9001: 2 sessions closed, their memory freed\n")
        with self.assertRaises(mokd.MokError) as e:
            a.ping()
        self.assertIn("evicted by uid %d (job 9001)" % os.getuid(), str(e.exception))
        other.ping()  # another job's session is untouched
        st = other.stats()
        self.assertEqual(st["daemon"]["sessions"], 1)
        self.assertEqual(st["daemon"]["arena_bytes"], 0)
        self.assertEqual(st["daemon"]["contexts"], 0)
        ev = self.mokctl("evict", "--job", "9001")
        self.assertEqual(ev.stdout, "evicted job 9001: 0 sessions closed, their memory freed\n")
        other.close()
        for c in (a, b):
            c.close()
        # every line about those sessions names the session and the job
        with open(os.path.join(self.d.dir, "mokd.log")) as f:
            log = f.read()
        for what in ('hello from "trainer"', "evicted by uid %d (job 9001)" % os.getuid(),
                     "closed (pid %d" % os.getpid()):
            self.assertIn("[sess] session %d job 9001: %s" % (sid, what), log)

    def test_evict_is_for_root_and_the_daemon_uid(self):
        if os.getuid() != 0:
            self.skipTest("needs root to run mokctl as another uid")
        os.chmod(self.d.dir, 0o755)
        os.chmod(self.d.sock, 0o666)
        ev = self.mokctl("evict", "--job", "1", preexec_fn=lambda: os.setuid(65534))
        self.assertEqual(ev.returncode, 1)
        self.assertIn("evict: only root or the daemon's uid (%d) may evict; this peer is "
                      "uid 65534" % os.geteuid(), ev.stderr)
        ls = self.mokctl("sessions", preexec_fn=lambda: os.setuid(65534))
        self.assertEqual(ls.returncode, 0, ls.stderr)
        self.assertEqual(len(ls.stdout.splitlines()), 2)  # its own session only

    def test_bad_job_ids_are_refused_at_hello(self):
        os.environ["MOKD_JOB_ID"] = "a b"
        try:
            with self.assertRaises(mokd.MokError) as e:
                mokd.Client(self.d.sock)
        finally:
            del os.environ["MOKD_JOB_ID"]
        self.assertIn("job_id has byte 0x20 at 1; a job id is letters, digits and ._:@+-",
                      str(e.exception))


if __name__ == "__main__":
    unittest.main()
