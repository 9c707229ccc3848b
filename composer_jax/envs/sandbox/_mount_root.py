"""Builds the unshare backend's root inside fresh namespaces, then runs the command there.

`isolation.unshare_argv` runs `unshare ... python3 -I -S -B -c <this source> ROOT STEPS... --
COMMAND...`: one interpreter making the mount(2) calls itself, where a shell script ran mount(8)
once per step (about 25 processes, some 60 ms a command). Each step is a name and a fixed number
of arguments (paths are host paths; targets are inside ROOT):

  mount SOURCE TARGET FSTYPE FLAGS DATA   mount(2); FLAGS: comma-separated names of `_MS`, or "-"
  readonly TARGET                        remount a bind read-only, keeping its locked flags
  mkdir PATH                             with parents
  file PATH MODE TEXT                    write a file (MODE in octal)
  symlink TARGET PATH

Then ROOT is made read-only and becomes "/" (pivot_root onto ROOT/.old, which the steps create,
then detached) and the command is exec'd in /workspace. Any failure exits with status 125 and the reason on stderr. Standard library only:
this file is shipped as source text.
"""

import ctypes
import os
import sys

_MS = {
    "rdonly": 1,
    "nosuid": 2,
    "nodev": 4,
    "noexec": 8,
    "remount": 32,
    "noatime": 1024,
    "nodiratime": 2048,
    "bind": 4096,
    "rec": 16384,
    "relatime": 1 << 21,
}
# statvfs flags -> the mount flags a read-only remount must repeat: in a user namespace the
# kernel refuses a remount that would clear a flag locked by the mount's owner.
_KEPT = ((2, _MS["nosuid"]), (4, _MS["nodev"]), (8, _MS["noexec"]), (1024, _MS["noatime"]))
_KEPT += ((2048, _MS["nodiratime"]), (4096, _MS["relatime"]))
_MNT_DETACH = 2
_ARITY = {"mount": 5, "readonly": 1, "mkdir": 1, "file": 3, "symlink": 2}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source: str, target: str, fstype: str, flags: str, data: str) -> None:
    bits = 0 if flags == "-" else sum(_MS[name] for name in flags.split(","))
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype != "-" else None,
            ctypes.c_ulong(bits),
            data.encode() if data != "-" else None,
        ),
        f"mount {source} on {target}",
    )


def _readonly(target: str) -> None:
    current = os.statvfs(target).f_flag
    bits = _MS["remount"] | _MS["bind"] | _MS["rdonly"]
    bits |= sum(ms for st, ms in _KEPT if current & st)
    _check(_libc.mount(None, target.encode(), None, ctypes.c_ulong(bits), None), f"{target}")


def _file(path: str, mode: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, int(mode, 8))


_STEPS = {
    "mount": _mount,
    "readonly": _readonly,
    "mkdir": lambda path: os.makedirs(path, exist_ok=True),
    "file": _file,
    "symlink": os.symlink,
}


def _pivot(root: str, pivot_root: str) -> None:
    """`root` becomes "/" (util-linux pivot_root: glibc has no wrapper for the system call) and
    the old root is detached, so nothing of the host outside the bound paths stays reachable."""
    os.chdir(root)
    pid = os.posix_spawn(pivot_root, [pivot_root, ".", ".old"], {})
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"pivot_root exited with {os.waitstatus_to_exitcode(status)}")
    _check(_libc.umount2(b"/.old", _MNT_DETACH), "umount /.old")
    os.chdir("/workspace")


def main(argv: list[str]) -> None:
    """argv: ROOT PIVOT_ROOT STEPS... -- COMMAND..."""
    root, pivot_root = argv[0], argv[1]
    split = argv.index("--")
    steps, command = argv[2:split], argv[split + 1 :]
    try:
        i = 0
        while i < len(steps):
            name = steps[i]
            arity = _ARITY[name]
            _STEPS[name](*steps[i + 1 : i + 1 + arity])
            i += 1 + arity
        _readonly(root)
        _pivot(root, pivot_root)
        os.execv(command[0], command)
    except (OSError, KeyError, ValueError, IndexError) as error:
        sys.stderr.write(f"sandbox setup failed: {error}\n")
        sys.stderr.flush()
        os._exit(125)
