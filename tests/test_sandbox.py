"""Sandbox tests: ordinary runs, the rlimits-only fallback, and attacks.

The attacks try to escape or harm the host. They run in a child process
(this file as a script) confined by its own pids+memory cgroups and a
timeout, so a sandbox bug fails a test instead of taking the machine down;
the sandbox nests each run's cgroups below that child's. After every attack
the child checks the host: a normal run works, no process of a sandbox uid
and no launcher is left, no run cgroup is left, no marker file exists.
"""

import ast
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from agentrl_jax.envs import sandbox as sandbox_lib
from agentrl_jax.envs.sandbox import Sandbox

REPO = pathlib.Path(__file__).resolve().parents[1]
LIMITS = dict(cpu_seconds=1, wall_seconds=2, memory_mb=128, max_processes=8,
              max_file_mb=2, disk_mb=8, max_files=128, output_bytes=1024)
# A CPU-bound attack must hit the CPU limit before the wall limit even when
# the machine is loaded (at a 5% CPU share, 1 CPU second takes 20 s of wall).
# A memory attack must hit the memory limit first: near it the kernel's
# reclaim charges CPU time to the process (CI saw memory_gradual take > 1 s).
ATTACK_LIMITS = {"infinite_loop": dict(wall_seconds=30),
                 **{name: dict(cpu_seconds=10, wall_seconds=30)
                    for name in ("memory_bomb", "memory_gradual", "memory_many_processes")}}
MARKERS = ["/tmp/escape_marker", "/var/tmp/escape_marker", "/dev/shm/escape_marker",
           "/root/escape_marker", "/escape_marker", "/etc/escape_marker",
           str(REPO / "escape_marker")]

# In each attack {runner_pid}, {pytest_pid}, {port}, {unix_socket}, {secret},
# {markers} and {repo} are replaced by their values.
# `try_(label, fn)` prints "label: ok" or "label: <error name>".
PRELUDE = """
import errno, os, signal, socket, subprocess, sys, time
def try_(label, fn):
  try:
    fn()
    print(label + ": ok", flush=True)
  except BaseException as e:
    print(label + ": " + (errno.errorcode.get(getattr(e, "errno", None) or 0) or type(e).__name__), flush=True)
"""
ATTACKS = {
    "fork_bomb": """
while True:
  try:
    os.fork()
  except OSError:
    pass
""",
    "infinite_loop": "while True: pass",
    "sleep_forever": "time.sleep(1000)",
    "daemon_left_behind": """
if os.fork() == 0:
  os.setsid()
  if os.fork() == 0:
    time.sleep(1000)
  os._exit(0)
print("parent done")
""",
    "memory_bomb": "x = bytearray(10**10)",
    "memory_gradual": "l = []\nwhile True: l.append(b'x' * 10**6)",
    "memory_many_processes": """
for _ in range(4):
  if os.fork() == 0:
    b = b'x' * (90 * 10**6)
    time.sleep(0.5)
    os._exit(0)
b = b'x' * (90 * 10**6)
for _ in range(4):
  print(os.wait(), flush=True)
""",
    "disk_fill": """
def big():
  with open("big", "wb") as f:
    f.write(b"x" * (50 << 20))
def many_mb():
  for i in range(100):
    with open(f"mb{i}", "wb") as f:
      f.write(b"x" * (1 << 20))
def many_files():
  for i in range(100000):
    open(f"/tmp/f{i}", "w").close()
def shm():
  with open("/dev/shm/fill", "wb") as f:
    f.write(b"x" * (2 << 20))
try_("big", big); try_("many_mb", many_mb)
for i in range(100): os.path.exists(f"mb{i}") and os.remove(f"mb{i}")
try_("many_files", many_files); try_("shm", shm)
""",
    "output_bomb": "while True: sys.stdout.write('x' * 100000)",
    "network": """
def connect(addr):
  s = socket.socket(); s.settimeout(1); s.connect(addr)
try_("host_listener", lambda: connect(("127.0.0.1", {port})))
try_("outside", lambda: connect(("1.1.1.1", 53)))
try_("dns", lambda: socket.getaddrinfo("example.com", 80))
# A world-writable Unix socket on the host (like /run/dbus/system_bus_socket
# or /dev/log): a read-only mount does not stop connect().
def connect_unix(path):
  s = socket.socket(socket.AF_UNIX); s.settimeout(1); s.connect(path)
try_("host_unix_socket", lambda: connect_unix("{unix_socket}"))
try_("socketpair", lambda: socket.socketpair())
print("interfaces:", [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]])
""",
    "write_outside": """
for path in {markers} + ["{secret}.new"]:
  try_(path, lambda: open(path, "w").write("escaped"))
try_("chmod_secret", lambda: os.chmod("{secret}", 0o666))
try_("remove_secret", lambda: os.remove("{secret}"))
try_("touch_repo", lambda: os.utime("{repo}/pyproject.toml"))
""",
    "read_secret": """
try_("secret", lambda: print(open("{secret}").read()))
try_("shadow", lambda: print(open("/etc/shadow").read()))
try_("root_home", lambda: print(os.listdir("/root")))
print("launcher:", open("/proc/1/cmdline").read().split(chr(0)))
""",
    "escalate": """
try_("setuid", lambda: os.setuid(0))
try_("remount", lambda: subprocess.run(["mount", "-o", "remount,rw", "/"], check=True,
                                       capture_output=True))
try_("cgroup_escape", lambda: open("/sys/fs/cgroup/pids/cgroup.procs", "w").write(str(os.getpid())))
try_("sysctl", lambda: open("/proc/sys/kernel/hostname", "w").write("x"))
# Root of a new user namespace still cannot unlock the read-only host mounts.
try_("userns_remount", lambda: subprocess.run(
    ["unshare", "-Urm", "sh", "-c", "mount -o remount,bind,rw / && touch /escape_marker"],
    check=True, capture_output=True))
try_("userns", lambda: subprocess.run(["unshare", "-U", "true"], check=True,
                                       capture_output=True))
print("uid", os.getuid(), "groups", os.getgroups())
""",
    "kill_parents": """
for label, pid in [("ppid", os.getppid()), ("init", 1), ("runner", {runner_pid}),
                   ("pytest", {pytest_pid})]:
  try_(label, lambda: os.kill(pid, signal.SIGKILL))
try_("everyone", lambda: os.kill(-1, signal.SIGKILL))
""",
}


# ---- the confined runner (this file run as a script) ----

def _host_leftovers():
  """Processes of a sandbox uid or launcher, and run cgroups, left now."""
  procs = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      uid = os.stat(f"/proc/{pid}").st_uid
      cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
      continue
    if (sandbox_lib.UID_BASE <= uid < sandbox_lib.UID_BASE + sandbox_lib.UID_SPAN
        or b"_sandbox_child" in cmd):
      procs.append(pid)
  cgroups = [str(p) for c in ("pids", "memory") if sandbox_lib._own_cgroup(c)
             for p in pathlib.Path(sandbox_lib._own_cgroup(c)).glob(sandbox_lib.CGROUP_PREFIX + "*")]
  return procs, cgroups


def _run_attacks(args):
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen()
  listener.setblocking(False)
  unix_listener = socket.socket(socket.AF_UNIX)
  unix_listener.bind(args["unix_socket"])
  os.chmod(args["unix_socket"], 0o777)
  unix_listener.listen()
  unix_listener.setblocking(False)
  fmt = dict(runner_pid=os.getpid(), pytest_pid=args["pytest_pid"], secret=args["secret"],
             port=listener.getsockname()[1], unix_socket=args["unix_socket"],
             markers=MARKERS, repo=str(REPO))
  report = {}
  for name in args["attacks"]:
    box = Sandbox(**{**LIMITS, **ATTACK_LIMITS.get(name, {})}, require_isolation=True)
    code = ATTACKS[name]
    for key, value in fmt.items():
      code = code.replace("{" + key + "}", str(value))
    result = box.run(PRELUDE + code)
    after = box.run("print(1 + 1)")
    procs, cgroups = _host_leftovers()
    accepted = False
    for server in (listener, unix_listener):
      try:
        server.accept()
        accepted = True
      except BlockingIOError:
        pass
    report[name] = dict(result=dataclasses.asdict(result), after=dataclasses.asdict(after),
                        procs=procs, cgroups=cgroups, accepted=accepted,
                        markers=[m for m in MARKERS if os.path.lexists(m)])
  print(json.dumps(report))


# ---- the outer test process ----

def _confinement_skip_reason():
  if os.geteuid() != 0:
    return "attack tests need root (cgroups, namespaces)"
  if not sandbox_lib.namespaces_available():
    return "attack tests need `unshare` namespaces"
  if sandbox_lib._cgroup_version() == "2":
    # The runner would hold processes in the cgroup its runs' cgroups go
    # below, which v2 forbids; per-run v2 cgroups have their own tests.
    return "the confined attack runner needs cgroup v1 (this host has v2)"
  if not (sandbox_lib._own_cgroup("pids") and sandbox_lib._own_cgroup("memory")):
    return "attack tests need writable cgroup v1 pids and memory controllers"
  return None


@pytest.fixture(scope="module")
def secret():
  """A root-only (0600) file in a world-readable directory, outside /tmp."""
  directory = tempfile.mkdtemp(prefix="agentrl-secret-", dir="/run" if os.access("/run", os.W_OK) else None)
  os.chmod(directory, 0o755)
  path = os.path.join(directory, "secret")
  with open(path, "w") as f:
    f.write("TOP-SECRET-7f3a")
  os.chmod(path, 0o600)
  yield path
  for name in os.listdir(directory):
    os.remove(os.path.join(directory, name))
  os.rmdir(directory)


@pytest.fixture(scope="module")
def attacks(secret):
  reason = _confinement_skip_reason()
  if reason:
    pytest.skip(reason)
  name = f"agentrl-confine-{uuid.uuid4().hex[:8]}"
  dirs = []
  try:
    for controller, file, value in (("pids", "pids.max", 300),
                                    ("memory", "memory.limit_in_bytes", 2 << 30)):
      path = os.path.join(sandbox_lib._own_cgroup(controller), name)
      os.mkdir(path)
      dirs.append(path)
      pathlib.Path(path, file).write_text(str(value))
    # sh joins the cgroups, then becomes the runner: nothing runs outside them.
    join = " && ".join(f'echo $$ > "{d}/cgroup.procs"' for d in dirs)
    # Next to the secret: a world-readable host directory outside /tmp.
    unix_socket = os.path.join(os.path.dirname(secret), "listener.sock")
    args = json.dumps(dict(pytest_pid=os.getpid(), secret=secret, attacks=list(ATTACKS),
                           unix_socket=unix_socket))
    proc = subprocess.run(["sh", "-c", f'{join} && exec "$@"', "sh", sys.executable, __file__, args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    with open(secret) as f:
      report["secret_after"] = (f.read(), oct(os.stat(secret).st_mode & 0o777))
    report["secret"] = secret
    os.remove(unix_socket)
    report["secret_dir_after"] = sorted(os.listdir(os.path.dirname(secret)))
    return report
  finally:
    for path in dirs:
      sandbox_lib._remove_cgroups({"": path})
    for path in dirs:
      assert not os.path.exists(path), f"confinement cgroup {path} left behind"


def _contained(report, name):
  """The invariants every attack must leave intact; returns its result."""
  entry = report[name]
  after = entry["after"]
  assert after["stdout"] == "2\n" and after["exit_code"] == 0, after
  assert entry["procs"] == [], f"{name} left processes {entry['procs']}"
  assert entry["cgroups"] == [], f"{name} left cgroups {entry['cgroups']}"
  assert entry["markers"] == [], f"{name} left marker files {entry['markers']}"
  assert not entry["accepted"], f"{name} reached a host socket"
  assert entry["result"]["isolation"] == "namespaces+seccomp+cgroup(pids,memory)"  # v1
  return entry["result"]


def _lines(result):
  return dict(line.split(": ", 1) for line in result["stdout"].splitlines() if ": " in line)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(attacks, name):
  _contained(attacks, name)


def test_time_limits(attacks):
  for name in ("fork_bomb", "infinite_loop", "sleep_forever"):
    assert _contained(attacks, name)["timed_out"], name
  assert "cpu" in _contained(attacks, "infinite_loop")["killed_reason"]
  assert "wall" in _contained(attacks, "sleep_forever")["killed_reason"]


def test_daemon_is_killed_with_the_run(attacks):
  result = _contained(attacks, "daemon_left_behind")
  assert result["exit_code"] == 0 and result["stdout"] == "parent done\n"


def test_memory_limits(attacks):
  for name in ("memory_bomb", "memory_gradual"):
    result = _contained(attacks, name)
    assert result["exit_code"] == 1 and "MemoryError" in result["stderr"], result
  many = _contained(attacks, "memory_many_processes")
  # 5 x 90 MB exceeds the run's memory cgroup (128 + 8 + 64 MB).
  assert "memory" in many["killed_reason"], many


def test_disk_fill_is_bounded(attacks):
  lines = _lines(_contained(attacks, "disk_fill"))
  assert lines == {"big": "EFBIG", "many_mb": "ENOSPC", "many_files": "ENOSPC",
                   "shm": "ENOSPC"}, lines


def test_output_bomb_is_truncated(attacks):
  result = _contained(attacks, "output_bomb")
  assert result["truncated"] and "bytes cut ...]" in result["stdout"]
  # RLIMIT_FSIZE stopped it at max_file_mb; we kept its head and tail.
  budget, cut = LIMITS["output_bytes"], (LIMITS["max_file_mb"] << 20) - LIMITS["output_bytes"]
  assert result["stdout"] == "x" * (budget // 2) + f"\n[... {cut} bytes cut ...]\n" + "x" * (budget // 2)
  assert "File too large" in result["stderr"]


def test_no_network(attacks):
  result = _contained(attacks, "network")
  lines = _lines(result)
  assert all(lines[k] != "ok" for k in ("host_listener", "outside", "dns")), lines
  assert lines["host_unix_socket"] == "EACCES" and lines["socketpair"] == "ok"
  assert "interfaces: ['lo']" in result["stdout"]


def _expected_write_error(path):
  """What writing `path` from inside the sandbox must give."""
  tmpfs = ("/tmp", "/var/tmp", "/dev/shm")
  if os.path.dirname(path) in tmpfs:
    return "ok"  # the run's own tmpfs: writable, never the host's
  if path.startswith(tuple(t + "/" for t in tmpfs)):
    return "ENOENT"  # e.g. a checkout under /tmp: hidden by that tmpfs
  return "EACCES" if path.startswith("/root/") else "EROFS"


def test_host_is_read_only(attacks):
  lines = _lines(_contained(attacks, "write_outside"))
  # /tmp, /var/tmp and /dev/shm are the run's own tmpfs: writable, never the
  # host's. Elsewhere EROFS (the read-only remount) comes before permissions;
  # /root (0700) cannot even be entered.
  for path in MARKERS + [attacks["secret"] + ".new"]:
    assert lines[path] == _expected_write_error(path), (path, lines[path])
  assert (lines["chmod_secret"], lines["remove_secret"]) == ("EROFS",) * 2
  assert lines["touch_repo"] == _expected_write_error(str(REPO / "pyproject.toml"))
  assert attacks["secret_after"] == ("TOP-SECRET-7f3a", "0o600")
  assert attacks["secret_dir_after"] == ["secret"]


def test_root_only_files_are_unreadable(attacks):
  result = _contained(attacks, "read_secret")
  lines = _lines(result)
  assert {k: lines[k] for k in ("secret", "shadow", "root_home")} == {
      "secret": "EACCES", "shadow": "EACCES", "root_home": "EACCES"}
  assert "TOP-SECRET" not in result["stdout"] + result["stderr"]
  # Pid 1's command line: the interpreter, then its source and config by fd.
  argv = ast.literal_eval(lines["launcher"])
  assert argv[1:] == ["-I", "-S", argv[3], argv[4], ""] and argv[3].startswith("/dev/fd/")
  assert argv[0] == sandbox_lib.user_python("namespaces") and argv[4].isdigit()


def test_no_privilege_escalation(attacks):
  result = _contained(attacks, "escalate")
  lines = _lines(result)
  assert all(lines[k] != "ok" for k in ("setuid", "remount", "cgroup_escape", "sysctl",
                                        "userns_remount", "userns")), lines
  uid = int(result["stdout"].split("uid ")[1].split()[0])
  assert sandbox_lib.UID_BASE <= uid < sandbox_lib.UID_BASE + sandbox_lib.UID_SPAN
  assert "groups []" in result["stdout"]


def test_cannot_kill_parents(attacks):
  result = _contained(attacks, "kill_parents")
  # kill(-1) signals every process it may except itself: there are none.
  assert _lines(result) == {"ppid": "EPERM", "init": "EPERM", "runner": "ESRCH",
                            "pytest": "ESRCH", "everyone": "ESRCH"}, result
  assert result["exit_code"] == 0


# ---- ordinary runs (benign code, no confinement needed) ----

@pytest.fixture(scope="module")
def box():
  if not sandbox_lib.namespaces_available():
    pytest.skip("namespace mode needs root and `unshare` (the fallback has its own test)")
  return Sandbox(**LIMITS, require_isolation=True)


def test_runs_code_with_stdin(box):
  result = box.run("import sys\nprint(sys.stdin.read().upper(), 'é')", stdin="abc")
  assert (result.stdout, result.exit_code, result.ok) == ("ABC é\n", 0, True)
  assert not result.timed_out and result.killed_reason is None and not result.truncated


_HIERARCHY = "cgroup-v2" if sandbox_lib._cgroup_version() == "2" else "cgroup-v1"


@pytest.mark.parametrize("hierarchy", [_HIERARCHY])  # the test id says which was tested
def test_each_run_gets_its_own_cgroup(box, hierarchy):
  if not (sandbox_lib._own_cgroup("pids") and sandbox_lib._own_cgroup("memory")):
    pytest.skip(f"{hierarchy}: pids and memory are not writable (v1) or not enabled "
                "for this process's children (v2)")
  result = box.run("print(open('/proc/self/cgroup').read())")
  version = "2" if hierarchy == "cgroup-v2" else ""
  assert result.isolation == f"namespaces+seccomp+cgroup{version}(pids,memory)"
  lines = [line.split(":", 2) for line in result.stdout.split()]
  wanted = [("",)] if version else [("pids",), ("memory",)]
  for (controllers,) in wanted:
    [path] = [p for _, c, p in lines if controllers in c.split(",") or c == controllers]
    assert path.rsplit("/", 1)[1].startswith(sandbox_lib.CGROUP_PREFIX), result.stdout


def test_cgroup_v2_runs_get_a_child_with_their_limits(tmp_path, monkeypatch):
  """On a fake unified hierarchy: a child of our cgroup with pids.max and
  memory.max, only where our cgroup enables those controllers for children."""
  (tmp_path / "cgroup.controllers").write_text("cpu io memory pids")
  own = tmp_path / "system.slice" / "trainer.service"
  own.mkdir(parents=True)
  monkeypatch.setattr(sandbox_lib, "CGROUP_ROOT", str(tmp_path))
  monkeypatch.setattr(sandbox_lib, "_proc_cgroups",
                      lambda: [("", "/system.slice/trainer.service")])
  assert sandbox_lib._cgroup_version() == "2"
  (own / "cgroup.subtree_control").write_text("cpu\n")  # not delegated: no cgroup
  assert sandbox_lib._make_cgroups("run", pids_max=9, memory_bytes=2048) == {}
  (own / "cgroup.subtree_control").write_text("memory pids\n")
  made = sandbox_lib._make_cgroups("run", pids_max=9, memory_bytes=2048)
  assert made == {"pids": str(own / "run"), "memory": str(own / "run")}
  assert (own / "run" / "pids.max").read_text() == "9"
  assert (own / "run" / "memory.max").read_text() == "2048"


def test_exceptions_and_exit_codes_are_results(box):
  result = box.run("raise ValueError('boom')")
  assert result.exit_code == 1 and "ValueError: boom" in result.stderr and not result.ok
  assert box.run("import sys; sys.exit(3)").exit_code == 3
  killed = box.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
  assert killed.exit_code == -signal.SIGSEGV and killed.killed_reason == "killed by signal SIGSEGV"


def test_each_run_starts_fresh(box):
  box.run("open('state', 'w').write('x'); open('/tmp/state', 'w').write('x')")
  assert box.run("import os; print(os.listdir('.'), os.listdir('/tmp'))").stdout == "['main.py'] ['work']\n"


def test_concurrent_runs_are_independent(box):
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(box.run, [f"import time; time.sleep(0.2); print({i})" for i in range(4)]))
  assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


def test_rlimits_only_fallback(monkeypatch):
  monkeypatch.setattr(sandbox_lib, "namespaces_available", lambda: False)
  with pytest.raises(RuntimeError, match="require_isolation"):
    Sandbox(require_isolation=True)
  with pytest.warns(RuntimeWarning, match="rlimits only"):
    box = Sandbox(**{**LIMITS, "wall_seconds": 1})
  result = box.run("import os, sys; print(sys.stdin.read(), os.path.basename(os.getcwd())[:16])",
                   stdin="hi")
  assert (result.stdout, result.isolation) == ("hi agentrl-sandbox-\n", "rlimits-only")
  slow = box.run("import time; time.sleep(30)")
  assert slow.timed_out and "wall" in slow.killed_reason
  assert box.run("print('y' * 5000)").truncated


if __name__ == "__main__":
  _run_attacks(json.loads(sys.argv[1]))
