"""The sandbox's bootstrap: the program the sandboxed interpreter runs.

:func:`plainrl.rollout.sandbox.run_python` does not import this module: it reads its
source text and runs it as P0 ("keeper") with ``python -I -B -X utf8 -c <source>
<config>``; the sandboxed interpreter never imports plainrl. It only uses the standard
library; ``sys.argv[1]`` is the JSON config written by the parent. Importing the
module defines the functions and runs nothing.

P0 unshare()s the namespaces and builds the private mounts, then forks P1 (the PID
namespace's init, or a child subreaper without one), which forks P2 (limits,
privilege drop, audit hook, then the user code). The outcome goes to the parent as
JSON lines on the status pipe (``status_fd``).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

# The run's state, set by main(). Module globals because the SIGTERM handler and the
# forked children read them.
CFG = {}
SFD = -1
libc = None
SOURCE = b""
WORK = ""
UID = GID = -1
got = 0  # CLONE_NEW* flags of the namespaces we are in
userns = False
P1 = None


def load_libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.unshare.argtypes = [ctypes.c_int]
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def report(**kw):
    try:
        os.write(SFD, (json.dumps(kw) + "\n").encode())
    except OSError:
        pass


def fail(msg):
    report(setup_error=msg)
    os._exit(70)


def mount(src, dst, fstype, flags, data=None):
    def enc(s):
        return None if s is None else os.fsencode(s)

    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s on %s: %s" % (src, dst, os.strerror(e)))


def devnull_stdio():
    fd = os.open(os.devnull, os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    if fd > 2:
        os.close(fd)


def on_term(signum, frame):
    if P1:
        try:  # with a PID namespace, killing its init kills everything in it
            os.kill(P1, signal.SIGKILL if got & CLONE_NEWPID else signal.SIGTERM)
        except OSError:
            pass
    else:
        os._exit(72)


def enter_namespaces(iso):
    """Namespaces: all at once (root), else through a user namespace, else one by one."""
    global got, userns
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not CFG["namespaces"]:
        pass
    elif libc.unshare(flags) == 0:
        got = flags
    else:
        got = 0
        if CFG["userns"] and not CFG["drop"] and libc.unshare(flags | CLONE_NEWUSER) == 0:
            try:
                for name, data in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (os.getuid(), os.getuid())),
                                   ("gid_map", "%d %d 1" % (os.getgid(), os.getgid()))):
                    with open("/proc/self/" + name, "w") as f:
                        f.write(data)
            except OSError as e:
                fail("user namespace id maps: %s" % e)
            got, userns = flags, True
            iso.append("userns")
        else:
            for fl in (CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUTS):
                if libc.unshare(fl) == 0:
                    got |= fl
    for fl, name in ((CLONE_NEWPID, "pidns"), (CLONE_NEWNET, "netns"), (CLONE_NEWNS, "mntns"),
                     (CLONE_NEWIPC, "ipcns"), (CLONE_NEWUTS, "utsns")):
        if got & fl:
            iso.append(name)
    if got & CLONE_NEWUTS:
        libc.sethostname(b"sandbox", 7)


def build_mounts(iso):
    """Private mounts (only in our own mount namespace, after making every mount private
    so nothing propagates back to the host). Returns whether mounts could be made."""
    mounts_ok = False
    if got & CLONE_NEWNS:
        try:
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            mounts_ok = True
        except OSError:
            pass
    if mounts_ok:
        try:
            owner = ",uid=%d,gid=%d" % (UID, GID) if (CFG["drop"] or userns) else ""
            st = WORK  # an empty directory of our own: each mask is built there, then moved
            for m in CFG["masks"]:
                opts = "mode=%o,size=%dk,nr_inodes=4096" % (m["mode"], m["size_kb"])
                mount("tmpfs", st, "tmpfs", MS_NOSUID | MS_NODEV, opts)
                for rel, mode in m["dirs"]:
                    d = os.path.join(st, rel)
                    os.makedirs(d, 0o755, exist_ok=True)
                    os.chmod(d, mode)
                for rel, target in m["links"]:
                    os.symlink(target, os.path.join(st, rel))
                for src, rel, ro in m["binds"]:
                    dst = os.path.join(st, rel)
                    if os.path.isdir(src):
                        os.makedirs(dst, 0o755, exist_ok=True)
                    else:
                        os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
                        open(dst, "a").close()
                    mount(src, dst, None, MS_BIND | MS_REC)
                    if ro:
                        mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
                mount(st, m["path"], None, MS_MOVE)  # run_python put the mask hiding WORK last
                if m["path"] == "/dev":
                    iso.append("private_dev")
            mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV,
                  "mode=700,size=%dk,nr_inodes=8192%s" % (CFG["work_kb"], owner))
            if CFG["masks"]:
                iso.append("private_tmp")
        except OSError as e:
            fail("private mounts: %s" % e)
    return mounts_ok


def run_user():
    """P2: limits, privilege drop, then the user code. Never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(WORK)
    path = os.path.join(WORK, "main.py")
    try:
        with open(path, "wb") as f:
            f.write(SOURCE)
        if CFG["drop"]:
            os.chown(path, UID, GID)
    except OSError:
        pass
    lim = CFG["limits"]
    for res, val in ((resource.RLIMIT_CORE, (0, 0)),
                     (resource.RLIMIT_FSIZE, (lim["fsize"], lim["fsize"])),
                     (resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"])),
                     (resource.RLIMIT_AS, (lim["as"], lim["as"])),
                     (resource.RLIMIT_CPU, (lim["cpu"], lim["cpu"] + 1)),
                     (resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"])),
                     (resource.RLIMIT_MEMLOCK, (0, 0)),
                     (resource.RLIMIT_MSGQUEUE, (0, 0))):
        try:
            resource.setrlimit(res, val)
        except (OSError, ValueError) as e:
            if res not in (resource.RLIMIT_MEMLOCK, resource.RLIMIT_MSGQUEUE):
                fail("setrlimit(%d): %s" % (res, e))
    mine = []
    if CFG["drop"]:
        # Probe with the effective ids first: the interpreter must stay readable.
        try:
            os.setgroups([])
            os.setegid(GID)
            os.seteuid(UID)
            try:
                os.listdir(os.path.dirname(os.__file__))
                os.stat(sys.executable)
                readable = True
            except OSError:
                readable = False
            os.seteuid(0)
            os.setegid(0)
            if readable:
                os.setresgid(GID, GID, GID)
                os.setresuid(UID, UID, UID)
                try:
                    os.setuid(0)
                except PermissionError:
                    mine.append("uid_drop")
                else:
                    fail("privilege drop did not stick")
        except OSError as e:
            fail("privilege drop: %s" % e)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        mine.append("no_new_privs")
    if userns:  # drop the capabilities the user namespace gave us
        class Hdr(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]

        if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), ctypes.byref((Data * 2)())) != 0:
            fail("capset: %s" % os.strerror(ctypes.get_errno()))

    def hook(event, args, _blocked=(2, 10, 17)):  # AF_INET, AF_INET6, AF_PACKET
        if event == "socket.__new__":
            if args[1] in _blocked:
                raise PermissionError(13, "network access is disabled in this sandbox")
        elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            if isinstance(args[1], tuple):
                raise PermissionError(13, "network access is disabled in this sandbox")

    sys.addaudithook(hook)
    mine.append("audit_hook")
    report(iso2=mine)
    os.close(SFD)
    sys.argv[:] = [path]
    sys.path.insert(0, WORK)
    module = type(sys)("__main__")  # a clean __main__ (pickle looks classes up there)
    module.__file__, module.__builtins__ = path, __builtins__
    sys.modules["__main__"] = module
    try:
        code = compile(SOURCE, path, "exec")
        del globals()["SOURCE"]
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # hide the bootstrap frame
        try:
            e.__traceback__ = tb
            sys.__excepthook__(type(e), e, tb)
        except BaseException:
            pass
        if isinstance(e, MemoryError):
            for s in (sys.stdout, sys.stderr):
                try:
                    s.flush()
                except BaseException:
                    pass
            os._exit(CFG["oom_exit"])
        sys.exit(1)
    sys.exit(0)


def run_init(p0, mounts_ok):
    """P1: init of the PID namespace (or a child subreaper without one). Never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != p0 and not got & CLONE_NEWPID:
        os._exit(73)  # the keeper is already gone
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    pidns = bool(got & CLONE_NEWPID)
    P2 = None
    if pidns and mounts_ok:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            report(iso2=["private_proc"])
        except OSError:
            pass
    if not pidns:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

        def on_term_p1(signum, frame):  # asked to stop: kill the code, then clean up below
            if P2:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(P2, signal.SIGKILL)
                    except OSError:
                        pass

        signal.signal(signal.SIGTERM, on_term_p1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    P2 = os.fork()
    if P2 == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        try:
            run_user()
        except SystemExit:
            raise
        except BaseException as e:
            fail("bootstrap: %r" % (e,))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if not pidns:
        report(p2=P2)
    devnull_stdio()
    while True:
        pid, st = os.waitpid(-1, 0)
        if pid == P2:
            break
    if os.WIFSIGNALED(st):
        report(signal=os.WTERMSIG(st))
    else:
        report(exit=os.waitstatus_to_exitcode(st))
    if not pidns:  # no namespace to die with us: kill and reap what is left below us
        me = str(os.getpid())
        for _ in range(1000):
            kids = []
            for d in os.listdir("/proc"):
                if d.isdigit():
                    try:
                        with open("/proc/%s/stat" % d, "rb") as f:
                            fields = f.read().rsplit(b")", 1)[1].split()
                    except OSError:
                        continue
                    if fields[1].decode() == me:
                        kids.append(int(d))
            for k in kids:
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                if not kids:
                    break
    os._exit(0)


def main():
    """P0, the keeper: namespaces and mounts, fork P1, wait for it. Never returns."""
    global CFG, SFD, libc, SOURCE, WORK, UID, GID, P1
    CFG = json.loads(sys.argv[1])
    SFD = CFG["status_fd"]
    libc = load_libc()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != CFG["parent_pid"]:
        os._exit(71)
    P1 = None
    signal.signal(signal.SIGTERM, on_term)
    with open(CFG["code_path"], "rb") as f:
        SOURCE = f.read()
    WORK = CFG["work"]
    UID, GID = CFG["uid"], CFG["gid"]
    iso = []
    enter_namespaces(iso)
    mounts_ok = build_mounts(iso)
    report(iso=iso)

    p0 = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop request between fork and P1 = ...
    P1 = os.fork()
    if P1 == 0:
        run_init(p0, mounts_ok)

    report(p1=P1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending stop request runs now
    os.close(SFD)
    devnull_stdio()
    while True:
        try:
            os.waitpid(P1, 0)
            break
        except ChildProcessError:
            break
    os._exit(0)


if __name__ == "__main__":
    main()
