"""Runs untrusted (model-written) Python code in an isolated child process.

    sandbox = Sandbox(cpu_seconds=2, wall_seconds=5, memory_mb=256)
    result = sandbox.run("print(1 + 1)")   # SandboxResult(stdout="2\\n", ...)

Failures of the code (exceptions, crashes, time limits, out of memory, a
killed process) come back in the result; `run` raises only for a broken
host setup. The mode is chosen once per process and named in
`result.isolation`:

"namespaces" (root and util-linux `unshare` work, e.g. our CI VMs). The code
  runs under `unshare --net --mount --pid --ipc --uts --fork --kill-child`
  and a launcher (`_sandbox_child.py`) that, as root inside the namespaces,
  sets up the mounts, then runs the code as a fresh unprivileged uid/gid
  (random per run from a range no account uses, no supplementary groups,
  no_new_privs) with `python3 -I`. Guarantees:
  - No network: an empty network namespace (a down loopback only); the
    host's sockets, even on 127.0.0.1, are unreachable. Host Unix sockets
    too: a seccomp filter (x86_64, aarch64; "+seccomp" in `isolation`)
    refuses AF_UNIX sockets, which a read-only mount would not stop, and new
    user namespaces.
  - Nothing of the host's setup in sight: the launcher gets its source and
    config by fd, so /proc/1/cmdline shows only the interpreter.
  - Read-only host: every host mount is remounted read-only and nosuid in the
    run's mount namespace; root-only files stay unreadable (we are not
    root). /tmp is a fresh tmpfs of `disk_mb` and `max_files` inodes holding
    the work dir; /var/tmp, /dev/shm and /run/lock get 1 MiB tmpfs. All of it
    vanishes with the namespace, so nothing written reaches the host.
  - Limits: RLIMIT_CPU (per process), RLIMIT_AS `memory_mb` (per process),
    RLIMIT_FSIZE `max_file_mb` (also bounds stdout/stderr on disk),
    RLIMIT_NPROC `max_processes` (binds: a non-root uid used by nobody else),
    RLIMIT_NOFILE 256, no core dumps. Wall time is enforced by the launcher,
    which stays root as pid 1 of the pid namespace (the code cannot signal
    it, and sees no host process to signal); on timeout or exit it kills
    every process of the namespace. If the launcher itself hangs, `run`
    kills `unshare` after a grace period and the kernel kills the rest.
  - Best effort, cgroups: where the `pids` and `memory` controllers are
    writable (v1), or enabled for the caller's children (v2, e.g. systemd
    `Delegate=`), each run gets its own cgroup below the caller's (whole-run
    totals: pids.max, memory.limit_in_bytes / memory.max, no swap), removed
    afterwards; the hierarchy and controllers used show in `isolation`, e.g.
    "namespaces+seccomp+cgroup(pids,memory)" (v1) or "...+cgroup2(pids,memory)".

"rlimits-only" (fallback: not root or no usable `unshare`, e.g. a laptop).
  The code runs as the calling user in a temporary directory (removed
  afterwards) with the same rlimits (RLIMIT_NPROC only when not root, as
  the user's current task count + `max_processes`), in its own session whose
  process group is killed when it ends or times out (a process that starts
  a new session escapes that). It is NOT isolated: it can read and
  write whatever the user can, use the network, and signal the user's other
  processes. A RuntimeWarning says so; `require_isolation=True` raises
  instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_UNSHARE = ("unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork",
            "--kill-child", "--mount-proc")
# Per-run uids/gids: above systemd's container range (which ends at
# 0x6fffffff) and below 2**31; no account or file on a normal host uses them.
UID_BASE, UID_SPAN = 0x70000000, 1 << 24
CGROUP_PREFIX = "agentrl-sandbox-"
_GRACE_SECONDS = 5.0  # launcher start-up and teardown, beyond wall_seconds


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str
  stderr: str
  exit_code: int | None  # < 0: killed by that signal; None: never ran
  timed_out: bool  # a CPU- or wall-time limit ended it
  killed_reason: str | None  # why it was stopped, if a limit or signal did
  truncated: bool  # stdout or stderr was cut to its head and tail
  isolation: str  # "namespaces[+seccomp][+cgroup(...)|+cgroup2(...)]" or "rlimits-only"

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


@dataclasses.dataclass(frozen=True)
class Sandbox:
  """Limits for one `run` (each run is independent: no state is shared)."""

  cpu_seconds: float = 2.0  # RLIMIT_CPU is whole seconds: rounded up
  wall_seconds: float = 5.0
  memory_mb: int = 256  # per process; the memory cgroup caps the whole run
  max_processes: int = 16  # processes and threads of the run
  max_file_mb: int = 8
  disk_mb: int = 32  # the /tmp tmpfs (namespaces mode)
  max_files: int = 1024  # its inodes
  output_bytes: int = 4096  # kept of each of stdout and stderr
  require_isolation: bool = False

  def __post_init__(self):
    user_python(self.isolation)  # fail now, not in every run
    if self.isolation == "namespaces":
      return
    if self.require_isolation:
      raise RuntimeError(
          "Sandbox(require_isolation=True) needs root and a working `unshare` "
          "(user namespaces are not used).")
    warnings.warn(
        "Sandbox: no namespace isolation here (needs root and `unshare`); "
        "running code with rlimits only, as the current user, WITH network "
        "and filesystem access. Do not run untrusted code like this.",
        RuntimeWarning, stacklevel=3)

  @property
  def isolation(self) -> str:
    return "namespaces" if namespaces_available() else "rlimits-only"

  @property
  def max_seconds(self) -> float:
    """The longest a `run` can take: the wall limit, the launcher's grace,
    then the wait for the killed process."""
    return 2 * self.wall_seconds + _GRACE_SECONDS

  def run(self, code: str, stdin: str = "") -> SandboxResult:
    """Runs `code` as a script (`python3 -I main.py`) with `stdin`."""
    with tempfile.TemporaryFile() as code_f, tempfile.TemporaryFile() as in_f, \
         tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
      for f, text in ((code_f, code), (in_f, stdin)):
        f.write(text.encode("utf-8", "replace"))
        f.seek(0)
      files = dict(stdin=in_f, stdout=out_f, stderr=err_f)
      if self.isolation == "namespaces":
        status, cgroup_note, hard_killed = self._run_namespaces(code_f, files)
      else:
        status, cgroup_note, hard_killed = self._run_rlimits_only(code_f, files)
      stdout, cut_out = _read_budget(out_f, self.output_bytes)
      stderr, cut_err = _read_budget(err_f, self.output_bytes)
    return self._result(status, cgroup_note, hard_killed, stdout, stderr,
                        cut_out or cut_err)

  def _config(self, mode, code_fd, **extra):
    return json.dumps(dict(
        mode=mode, code_fd=code_fd, python=user_python(mode), cpu_seconds=self.cpu_seconds,
        wall_seconds=self.wall_seconds, memory_mb=self.memory_mb,
        max_processes=self.max_processes, max_file_mb=self.max_file_mb,
        disk_mb=self.disk_mb, max_files=self.max_files, **extra))

  def _run_namespaces(self, code_f, files):
    status_r, status_w = os.pipe()
    cgroups = _make_cgroups(
        f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}",
        # +1 and the slack: the launcher lives in the cgroups too.
        pids_max=self.max_processes + 1,
        memory_bytes=(self.memory_mb + self.disk_mb + 64) << 20)
    uid = UID_BASE + secrets.randbelow(UID_SPAN)
    config = self._config("namespaces", code_f.fileno(), status_fd=status_w,
                          uid=uid, cgroups=cgroups)
    hard_killed = False
    try:
      with _launcher(config, user_python("namespaces")) as (launcher, fds):
        proc = subprocess.Popen([*_UNSHARE, *launcher], **files,
                                pass_fds=(code_f.fileno(), status_w, *fds),
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except OSError as e:
      os.close(status_r)
      proc, status = None, {"error": f"could not start the sandbox: {e}"}
    finally:
      os.close(status_w)
    if proc is not None:
      with os.fdopen(status_r, "rb") as f:
        try:
          proc.wait(timeout=self.wall_seconds + _GRACE_SECONDS)
        except subprocess.TimeoutExpired:
          # --kill-child: the launcher dies with unshare, and as pid 1 takes
          # the rest of the namespace with it.
          proc.kill()
          proc.wait()
          hard_killed = True
        status = _parse_status(f.read(), proc.returncode)
    status["oom_kills"] = _remove_cgroups(cgroups)
    joined = status.get("cgroups")  # e.g. "cgroup2(pids,memory)" in `isolation`
    note = f"cgroup{_cgroup_version()}({','.join(joined)})" if joined else ""
    return status, note, hard_killed

  def _run_rlimits_only(self, code_f, files):
    work_dir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
    nproc = None if os.geteuid() == 0 else _user_tasks(os.getuid()) + self.max_processes
    config = self._config("rlimits-only", code_f.fileno(), work_dir=work_dir, nproc=nproc)
    status, hard_killed = {}, False
    try:
      with _launcher(config, user_python("rlimits-only")) as (launcher, fds):
        proc = subprocess.Popen(launcher, **files, pass_fds=(code_f.fileno(), *fds),
                                start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
      try:
        proc.wait(timeout=self.wall_seconds)
      except subprocess.TimeoutExpired:
        hard_killed = True
      _kill_group(proc.pid)  # also whatever the program left running
      proc.wait()
      status["exit_code"] = None if hard_killed else proc.returncode
    except OSError as e:
      status["error"] = f"could not start the sandbox: {e}"
    finally:
      shutil.rmtree(work_dir, ignore_errors=True)
    return status, "", hard_killed

  def _result(self, status, cgroup_note, hard_killed, stdout, stderr, truncated):
    exit_code = status.get("exit_code")
    timed_out = hard_killed or bool(status.get("timed_out"))
    reason = None
    if timed_out:
      reason = f"wall time limit ({self.wall_seconds:g} s)"
    elif status.get("oom_kills"):
      reason = "memory limit (the run's memory cgroup ran out)"
    elif status.get("error"):
      reason = f"sandbox error: {status['error']}"
    elif exit_code is not None and exit_code < 0:
      sig = -exit_code
      cpu_limit = sig == signal.SIGXCPU or (
          sig == signal.SIGKILL and status.get("cpu", 0.0) >= self.cpu_seconds)
      if cpu_limit:
        timed_out, reason = True, f"cpu time limit ({self.cpu_seconds:g} s)"
      else:
        reason = f"killed by signal {signal.Signals(sig).name}"
    isolation = self.isolation
    if status.get("seccomp"):
      isolation += "+seccomp"
    if cgroup_note:
      isolation += f"+{cgroup_note}"
    return SandboxResult(stdout, stderr, exit_code, timed_out, reason, truncated, isolation)


@contextlib.contextmanager
def _launcher(config: str, python: str):
  """(argv, fds): `python -I -S /dev/fd/L C` with the launcher's source on
  fd L and its config on fd C, so pid 1's command line (which the sandboxed
  code can read) names nothing but the interpreter the code runs on too."""
  with open(_LAUNCHER, "rb") as source, tempfile.TemporaryFile() as config_f:
    config_f.write(config.encode())
    config_f.seek(0)
    yield ([python, "-I", "-S", f"/dev/fd/{source.fileno()}",
            str(config_f.fileno())], (source.fileno(), config_f.fileno()))


@functools.cache
def namespaces_available() -> bool:
  """Root, and `unshare` can make every namespace the sandbox uses."""
  if os.geteuid() != 0 or shutil.which("unshare") is None:
    return False
  try:
    return subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@functools.cache
def user_python(mode: str) -> str:
  """An interpreter the sandboxed uid can run: every directory above it must
  be world-searchable (a pyenv/venv under /root is not; /usr/bin/python3 is)."""
  candidates = [os.path.realpath(sys.executable)]
  if mode == "namespaces":
    candidates += [os.path.realpath(p) for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                   if os.path.exists(p)]
    candidates = [p for p in candidates if _world_executable(p)]
  if not candidates:
    raise RuntimeError("Sandbox: no python3 that an unprivileged user can run")
  return candidates[0]


def _world_executable(path):
  while True:
    try:
      if not os.stat(path).st_mode & 0o001:
        return False
    except OSError:
      return False
    parent = os.path.dirname(path)
    if parent == path:
      return True
    path = parent


def _parse_status(raw, returncode):
  try:
    return dict(json.loads(raw))
  except ValueError:
    return {"error": f"launcher exited with {returncode} and no status"}


def _read_budget(f, budget):
  """At most `budget` bytes of the file: all of it, or its head and tail (a
  traceback's last line is what a reader needs) around a marker."""
  size = f.seek(0, os.SEEK_END)
  f.seek(0)
  if size <= budget:
    return f.read().decode("utf-8", "replace"), False
  head = f.read(budget // 2)
  f.seek(size - (budget - len(head)))
  tail = f.read()
  cut = f"\n[... {size - budget} bytes cut ...]\n"
  return (head + cut.encode() + tail).decode("utf-8", "replace"), True


def _kill_group(pgid):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _user_tasks(uid):
  """Tasks (processes and threads) `uid` runs now: what RLIMIT_NPROC counts."""
  count = 0
  for pid in os.listdir("/proc"):
    try:
      if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
        count += len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
      pass
  return count


CGROUP_ROOT = "/sys/fs/cgroup"


def _proc_cgroups() -> list[tuple[str, str]]:
  """(controllers, path) of each line of /proc/self/cgroup ("" controllers:
  the cgroup v2 unified hierarchy)."""
  try:
    with open("/proc/self/cgroup") as f:
      return [tuple(line.split(":", 2)[1:]) for line in f.read().splitlines()]
  except OSError:
    return []


def _cgroup_version() -> str:
  """"" (v1: a hierarchy per controller) or "2" (the unified hierarchy)."""
  return "2" if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")) else ""


def _own_cgroup(controller):
  """Where this process's cgroups can get a per-run child limiting
  `controller`: the v1 dir of that controller, or the v2 dir whose
  `cgroup.subtree_control` enables it; None if not writable or not enabled.
  (Under v2 a cgroup holding processes cannot enable controllers for its
  children, so they must be delegated already, e.g. systemd `Delegate=`.)"""
  for controllers, path in _proc_cgroups():
    if _cgroup_version() == "2":
      if controllers:
        continue
      base = os.path.join(CGROUP_ROOT, path.lstrip("/"))
      try:
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
          enabled = f.read().split()
      except OSError:
        return None
      return base if controller in enabled and os.access(base, os.W_OK) else None
    if controller in controllers.split(","):
      base = os.path.join(CGROUP_ROOT, controller, path.lstrip("/"))
      return base if os.access(base, os.W_OK) else None
  return None


# The limit files of each controller, v1 then v2 (swap: only with swap accounting).
_LIMITS = {"": {"pids": ("pids.max",),
                "memory": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")},
           "2": {"pids": ("pids.max",), "memory": ("memory.max", "memory.swap.max")}}


def _make_cgroups(name, *, pids_max, memory_bytes):
  """{controller: dir} of fresh cgroups below ours, with their limits set
  (under v2 both controllers share one dir)."""
  made = {}
  values = {"pids.max": pids_max, "memory.limit_in_bytes": memory_bytes,
            "memory.memsw.limit_in_bytes": memory_bytes, "memory.max": memory_bytes,
            "memory.swap.max": 0}
  for controller, files in _LIMITS[_cgroup_version()].items():
    base = _own_cgroup(controller)
    if base is None:
      continue
    path = os.path.join(base, name)
    try:
      os.makedirs(path, exist_ok=True)
      for file in files:
        if file != files[0] and not os.path.exists(os.path.join(path, file)):
          continue  # no swap accounting in this kernel
        with open(os.path.join(path, file), "w") as f:
          f.write(str(values[file]))
      made[controller] = path
    except OSError:
      _remove_cgroups({controller: path})
  return made


def _remove_cgroups(cgroups):
  """Kills anything left in them, removes them; returns the OOM-kill count."""
  oom_kills = 0
  for path in dict.fromkeys(cgroups.values()):
    for file, key in (("memory.oom_control", "oom_kill "), ("memory.events", "oom_kill ")):
      try:
        with open(os.path.join(path, file)) as f:
          oom_kills += sum(int(line.split()[1]) for line in f if line.startswith(key))
      except OSError:
        pass
    deadline = time.monotonic() + 5.0
    while os.path.isdir(path):
      try:
        os.rmdir(path)
      except OSError:
        if time.monotonic() > deadline:
          warnings.warn(f"Sandbox: could not remove cgroup {path}", RuntimeWarning)
          break
        _kill_cgroup(path)
        time.sleep(0.01)
  return oom_kills


def _kill_cgroup(path):
  try:
    with open(os.path.join(path, "cgroup.procs")) as f:
      pids = [int(p) for p in f.read().split()]
  except OSError:
    return
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
