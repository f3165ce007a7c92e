"""The sandbox's launcher (see sandbox.py): `python -I -S /dev/fd/L C`.

It reads its own source from fd L and its JSON config from fd C, so the
command line of pid 1 (readable inside the sandbox as /proc/1/cmdline) shows
no host path and no config.

Mode "namespaces": runs as root, as pid 1 of the fresh namespaces `unshare`
made. It hides the host behind read-only mounts and small tmpfs, joins the
run's cgroups, forks the user program as an unprivileged uid, enforces the
wall-time limit, kills every process left in the namespace and reports the
outcome as JSON on the status fd. Staying root and alive as the supervisor
is what makes the kill reliable: the user program cannot signal it, and when
it exits the kernel kills whatever is left in the pid namespace.

The user program also runs under a seccomp filter (x86_64 and aarch64): no
AF_UNIX sockets (a pathname socket on the host, e.g. a world-writable one in
/run, is reachable through a read-only mount; `socketpair` still works), no
new user namespaces (`unshare`/`clone` with CLONE_NEWUSER; `clone3`, whose
flags a filter cannot read, answers ENOSYS so libc falls back to `clone`),
no io_uring (it could open sockets past the filter).

Mode "rlimits-only": sets the rlimits and execs the user program in place.

Stdlib only, and imports nothing from the package: it starts on every run.
"""

import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 1 << 14, 1 << 18, 1 << 21
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# Per machine: audit arch, then the syscall numbers of socket, clone,
# unshare, clone3 and io_uring_setup.
_SECCOMP_ABI = {"x86_64": (0xC000003E, 41, 56, 272, 435, 425),
                "aarch64": (0xC00000B7, 198, 220, 97, 435, 425)}
# statvfs f_flag bits -> mount flags, so a read-only remount keeps the others.
_KEPT_FLAGS = ((os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
               (os.ST_RELATIME, MS_RELATIME))
# World-writable places get a fresh small tmpfs; /tmp also holds the work dir.
_SMALL_TMPFS = ("/var/tmp", "/dev/shm", "/run/lock")
WORK_DIR = "/tmp/work"

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points():
  points = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      # Field 5 is the mount point, with spaces etc. escaped as octal.
      point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
      if point not in points:
        points.append(point)
  return points


def _hide_host(cfg):
  """Private mounts; the host read-only and nosuid; fresh tmpfs where
  anyone may write. Only this mount namespace sees any of it."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  for point in _mount_points():
    if point == "/proc" or point.startswith("/proc/"):
      continue  # the pid namespace's own procfs, mounted by unshare
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    try:
      kept = os.statvfs(point).f_flag
      flags |= sum(ms for st, ms in _KEPT_FLAGS if kept & st)
      _mount(None, point, None, flags)
    except OSError:
      if point == "/":
        raise
  inodes = cfg["max_files"]
  _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={cfg['disk_mb']}m,nr_inodes={inodes},mode=1777")
  for point in _SMALL_TMPFS:
    if os.path.isdir(point):
      _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV,
             "size=1m,nr_inodes=64,mode=1777")


def _join_cgroups(paths):
  """paths: {controller: cgroup dir}; returns the controllers joined."""
  joined = []
  for controller, path in paths.items():
    try:
      with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")  # 0 = the writing process
      joined.append(controller)
    except OSError:
      pass  # best effort: the result's `isolation` says what was joined
  return joined


def _rlimits(cfg, nproc):
  cpu = int(cfg["cpu_seconds"] + 0.999)
  mb = 1 << 20
  limits = [(resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_AS, cfg["memory_mb"] * mb, None),
            (resource.RLIMIT_FSIZE, cfg["max_file_mb"] * mb, None),
            (resource.RLIMIT_NOFILE, 256, None),
            (resource.RLIMIT_CORE, 0, None)]
  if nproc is not None:
    limits.append((resource.RLIMIT_NPROC, nproc, None))
  for res, soft, hard in limits:
    # Never above the current hard limit: raising it needs CAP_SYS_RESOURCE,
    # which even root may lack (it does on our VMs).
    ceiling = resource.getrlimit(res)[1]
    clamp = lambda v: v if ceiling == resource.RLIM_INFINITY else min(v, ceiling)
    resource.setrlimit(res, (clamp(soft), clamp(soft if hard is None else hard)))


def _user_main(cfg, status_fd):
  """The forked child: limits, drop root for good, exec. Never returns."""
  try:
    os.close(status_fd)
    # The memory cgroup's OOM killer should pick the program, not the
    # supervisor (lowering the supervisor's score would need CAP_SYS_RESOURCE).
    _oom_score_adj(1000)
    uid = cfg["uid"]
    _rlimits(cfg, cfg["max_processes"])  # binds once we are not root
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # No setuid-root binary can give privileges back (the mounts are also
    # nosuid; this covers anything they miss).
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or os.getuid() == 0:
      raise OSError("could not drop privileges")
    if os.uname().machine in _SECCOMP_ABI:  # fail closed where we have one
      _install_seccomp(_SECCOMP_ABI[os.uname().machine])
    os.chdir(WORK_DIR)
    os.execve(cfg["python"], _user_argv(cfg), _user_env(WORK_DIR))
  except BaseException as e:  # pylint: disable=broad-except
    os.write(2, f"sandbox: could not start the program: {e}\n".encode())
  os._exit(127)


class _SockFilter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
              ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(abi):
  """The classic-BPF filter (code, jt, jf, k) over `struct seccomp_data`:
  nr at offset 0, arch at 4, the low 32 bits of args[0] at 16."""
  arch, socket_nr, clone_nr, unshare_nr, clone3_nr, io_uring_nr = abi
  ld = lambda offset: (0x20, 0, 0, offset)  # BPF_LD | BPF_W | BPF_ABS
  jeq = lambda k, jt, jf: (0x15, jt, jf, k)  # BPF_JMP | BPF_JEQ | BPF_K
  ret = lambda k: (0x06, 0, 0, k)  # BPF_RET | BPF_K
  allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, _KILL_PROCESS
  deny = lambda err: 0x00050000 | err  # SECCOMP_RET_ERRNO
  x32 = [(0x35, 0, 1, 0x40000000), ret(deny(errno.ENOSYS))] if arch == 0xC000003E else []
  head = [ld(4), jeq(arch, 1, 0), ret(kill), ld(0), *x32,
          jeq(clone3_nr, 0, 1), ret(deny(errno.ENOSYS)),
          jeq(io_uring_nr, 0, 1), ret(deny(errno.ENOSYS))]
  return head + [
      jeq(socket_nr, 3, 0),  # -> socket
      jeq(unshare_nr, 6, 0),  # -> flags
      jeq(clone_nr, 5, 0),  # -> flags
      ret(allow),
      ld(16), jeq(1, 0, 1), ret(deny(errno.EACCES)), ret(allow),  # socket: AF_UNIX?
      ld(16), (0x45, 0, 1, 0x10000000), ret(deny(errno.EPERM)), ret(allow),  # CLONE_NEWUSER?
  ]


def _install_seccomp(abi):
  program = seccomp_program(abi)
  filters = (_SockFilter * len(program))(*[_SockFilter(*insn) for insn in program])
  prog = _SockFprog(len(program), filters)
  if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "could not install the seccomp filter")


def _user_argv(cfg):
  return [cfg["python"], "-I", "main.py"]


def _user_env(home):
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home,
          "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _kill_namespace():
  """As pid 1, kill(-1) reaches every other process in the namespace; loop
  until all are reaped (a fork in flight may add one after a kill)."""
  while True:
    try:
      os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
      pass
    try:
      if os.waitpid(-1, os.WNOHANG)[0] == 0:
        time.sleep(0.001)
    except ChildProcessError:
      return


def _on_alarm(signum, frame):
  raise TimeoutError


def _oom_score_adj(value):
  try:
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write(str(value))
  except OSError:
    pass  # best effort


def _namespaces(cfg, code, status_fd):
  status = {"exit_code": None, "timed_out": False, "cpu": 0.0, "error": None,
            "seccomp": os.uname().machine in _SECCOMP_ABI}
  try:
    status["cgroups"] = _join_cgroups(cfg["cgroups"])
    _hide_host(cfg)
    os.mkdir(WORK_DIR, 0o700)
    with open(os.path.join(WORK_DIR, "main.py"), "wb") as f:
      f.write(code)
    for path in (WORK_DIR, os.path.join(WORK_DIR, "main.py")):
      os.chown(path, cfg["uid"], cfg["uid"])
  except OSError as e:
    status["error"] = f"setup failed: {e}"
    os.write(status_fd, json.dumps(status).encode())
    return
  signal.signal(signal.SIGALRM, _on_alarm)
  signal.setitimer(signal.ITIMER_REAL, cfg["wall_seconds"])
  try:
    pid = os.fork()
    if pid == 0:
      _user_main(cfg, status_fd)
    while True:  # reap orphans too: zombies count against RLIMIT_NPROC
      got, wait_status, usage = os.wait4(-1, 0)
      if got == pid:
        signal.setitimer(signal.ITIMER_REAL, 0)
        status["exit_code"] = os.waitstatus_to_exitcode(wait_status)
        status["cpu"] = usage.ru_utime + usage.ru_stime
        break
  except TimeoutError:
    status["timed_out"] = True
  _kill_namespace()
  os.write(status_fd, json.dumps(status).encode())


def _rlimits_only(cfg, code):
  with open(os.path.join(cfg["work_dir"], "main.py"), "wb") as f:
    f.write(code)
  os.chdir(cfg["work_dir"])
  _rlimits(cfg, cfg["nproc"])
  os.execve(cfg["python"], _user_argv(cfg), _user_env(cfg["work_dir"]))


def main():
  os.close(int(sys.argv[0].rsplit("/", 1)[1]))  # this file's fd (/dev/fd/L)
  with os.fdopen(int(sys.argv[1]), "rb") as f:
    cfg = json.loads(f.read())
  with os.fdopen(cfg["code_fd"], "rb") as f:
    code = f.read()
  if cfg["mode"] == "namespaces":
    _namespaces(cfg, code, cfg["status_fd"])
  else:
    _rlimits_only(cfg, code)


if __name__ == "__main__":
  main()
