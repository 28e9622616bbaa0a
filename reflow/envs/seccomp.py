"""The sandbox's second layer: a seccomp filter that bubblewrap loads (``bwrap --seccomp FD``) just before it
executes the sandboxed interpreter, so that every process of a run, and everything they start, carries it.

The filter is classic BPF, assembled here (no libseccomp needed at run time). It reads the system call's
architecture and number (and, for a few calls, one argument) and returns:

  kill     a call made through another ABI than this machine's (i386 through ``int 0x80`` or x32 on x86_64,
           32-bit ARM on aarch64): the numbers below would not mean the same calls there
  ENOSYS   clone3, whose flags sit in memory a filter cannot read; the C library then falls back to clone,
           whose flags it can
  EPERM    namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounts and the new mount API, chroot,
           device nodes (mknod), ptrace and other processes' memory (process_vm_readv/writev, kcmp,
           process_madvise, process_mrelease), process descriptors (pidfd_open, pidfd_getfd,
           pidfd_send_signal, clone with CLONE_PIDFD), resource limits of any process (prlimit64 with a
           pid other than 0; the run's own limits are set before it starts), inotify (a per-user
           counter the host shares), memfd_create and memfd_secret, io_uring, System V shared memory and
           message queues and POSIX message queues (memory outside the address-space limit), sockets of any
           family but AF_UNIX, terminal input injection (TIOCSTI, TIOCLINUX), and the kernel's own
           interfaces (modules, kexec, bpf, perf events, userfaultfd, keyrings, file handles, clocks,
           swap, accounting, reboot, syslog, personality, I/O ports)
  EOPNOTSUPP  extended attributes: "not supported" is what Python's shutil expects of a file system
           without them, so copying files keeps working
  allow    everything else

Syscall tables exist for x86_64 and aarch64 (little-endian: Grace and other Arm servers). aarch64 uses the
kernel's generic table, which has no legacy calls (mknod, inotify_init, iopl, ioperm, uselib): their *at and
*1 successors are denied instead; calls numbered from 424 on are numbered alike on both. Elsewhere
``program`` raises ``SeccompUnsupported`` and the sandbox refuses to start (``reflow.envs.isolation``).
"""

from __future__ import annotations

import errno
import platform
import struct
import sys
from dataclasses import dataclass

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7  # EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
LD_W_ABS = 0x20
JEQ_K = 0x15
JGE_K = 0x35
JSET_K = 0x45
RET_K = 0x06
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
OFFSET_NR = 0
OFFSET_ARCH = 4


def _arg_low(index: int) -> int:
    """Offset of the low 32 bits of argument ``index`` (little-endian)."""
    return 16 + 8 * index


CLONE_NAMESPACE_FLAGS = (
    0x00000080  # CLONE_NEWTIME
    | 0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x00001000  # CLONE_PIDFD: a process descriptor by another door
)
AF_UNIX = 1
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
SOL_SOCKET = 1
SOCKET_BUFFER_OPTIONS = (7, 8, 32, 33)
"""SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE: a socket keeps the kernel's default buffer sizes, so the
unread bytes a run can leave in socket buffers are at most processes x open files x net.core.wmem_default."""

X86_64_DENIED: dict[str, int] = {
    # namespaces and mounts
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "open_tree_attr": 467, "statmount": 457, "listmount": 458, "quotactl_fd": 443,
    # device nodes
    "mknod": 133, "mknodat": 259,
    # other processes
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "pidfd_open": 434, "pidfd_getfd": 438, "pidfd_send_signal": 424, "process_madvise": 440, "process_mrelease": 448,
    # memory outside the address-space limit, and io_uring (its operations bypass this filter)
    "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "shmat": 30, "msgget": 68, "mq_open": 240,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    # the kernel's own interfaces
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "lookup_dcookie": 212, "fanotify_init": 300,
    "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "reboot": 169, "syslog": 103,
    "personality": 135, "iopl": 172, "ioperm": 173, "vhangup": 153, "uselib": 134, "lsm_set_self_attr": 460,
    # counters of the host user, shared by every run (and by the rollout worker when it is not root)
    "inotify_init": 253, "inotify_init1": 294,
    # host-wide pools no namespace or limit counts: Linux AIO contexts (one fs.aio-max-nr for the machine), and
    # System V semaphores (kernel memory outside every per-process bound; shared memory and queues are above)
    "io_setup": 206, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
}
"""System calls refused with EPERM whatever their arguments."""

X86_64_XATTR: dict[str, int] = {
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "getxattr": 191, "lgetxattr": 192, "fgetxattr": 193,
    "listxattr": 194, "llistxattr": 195, "flistxattr": 196, "removexattr": 197, "lremovexattr": 198,
    "fremovexattr": 199, "setxattrat": 463, "getxattrat": 464, "listxattrat": 465, "removexattrat": 466,
}
"""Extended attributes: refused with EOPNOTSUPP."""

X86_64_ARGUMENT_RULES = {"clone": 56, "clone3": 435, "prlimit64": 302, "socket": 41, "ioctl": 16, "setsockopt": 54}

AARCH64_DENIED: dict[str, int] = {
    # namespaces and mounts
    "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "open_tree_attr": 467, "statmount": 457, "listmount": 458, "quotactl_fd": 443,
    # device nodes
    "mknodat": 33,
    # other processes
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
    "pidfd_open": 434, "pidfd_getfd": 438, "pidfd_send_signal": 424, "process_madvise": 440, "process_mrelease": 448,
    # memory outside the address-space limit, and io_uring
    "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "shmat": 196, "msgget": 186, "mq_open": 180,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    # the kernel's own interfaces
    "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
    "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218,
    "open_by_handle_at": 265, "name_to_handle_at": 264, "lookup_dcookie": 18, "fanotify_init": 262,
    "settimeofday": 170, "clock_settime": 112, "adjtimex": 171, "clock_adjtime": 266,
    "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "reboot": 142, "syslog": 116,
    "personality": 92, "vhangup": 58, "lsm_set_self_attr": 460,
    # counters of the host user
    "inotify_init1": 26,
    # host-wide pools: AIO contexts, System V semaphores
    "io_setup": 0, "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
}
"""aarch64's ``X86_64_DENIED`` (the generic table: no mknod, inotify_init, iopl, ioperm or uselib)."""

AARCH64_XATTR: dict[str, int] = {
    "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "getxattr": 8, "lgetxattr": 9, "fgetxattr": 10,
    "listxattr": 11, "llistxattr": 12, "flistxattr": 13, "removexattr": 14, "lremovexattr": 15,
    "fremovexattr": 16, "setxattrat": 463, "getxattrat": 464, "listxattrat": 465, "removexattrat": 466,
}

AARCH64_ARGUMENT_RULES = {"clone": 220, "clone3": 435, "prlimit64": 261, "socket": 198, "ioctl": 29, "setsockopt": 208}


@dataclass(frozen=True)
class SyscallTable:
    """One architecture's numbers: what the filter checks the call's ABI against and which calls it refuses."""

    machine: str
    audit_arch: int
    denied: dict[str, int]
    xattr: dict[str, int]
    argument_rules: dict[str, int]
    """clone, clone3, prlimit64, socket and ioctl: refused or allowed by an argument (clone3 always ENOSYS)."""
    other_abi_from: int | None
    """Call numbers from this one on belong to another ABI on the same audit arch (x32's bit), killed."""


TABLES = {
    "x86_64": SyscallTable("x86_64", AUDIT_ARCH_X86_64, X86_64_DENIED, X86_64_XATTR, X86_64_ARGUMENT_RULES, X32_SYSCALL_BIT),
    "aarch64": SyscallTable("aarch64", AUDIT_ARCH_AARCH64, AARCH64_DENIED, AARCH64_XATTR, AARCH64_ARGUMENT_RULES, None),
}
MACHINE_NAMES = {"x86_64": "x86_64", "AMD64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


class SeccompUnsupported(RuntimeError):
    """No syscall table for this machine's architecture."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return code, jt, jf, k


def _instructions(table: SyscallTable) -> list[tuple[int, int, int, int]]:
    eperm, enosys, eopnotsupp = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS, RET_ERRNO | errno.EOPNOTSUPP
    load_nr = _op(LD_W_ABS, OFFSET_NR)
    program = [
        _op(LD_W_ABS, OFFSET_ARCH),
        _op(JEQ_K, table.audit_arch, jt=1),
        _op(RET_K, RET_KILL_PROCESS),
        load_nr,
    ]
    if table.other_abi_from is not None:
        program += [_op(JGE_K, table.other_abi_from, jf=1), _op(RET_K, RET_KILL_PROCESS)]
    for number in table.denied.values():  # each: "if nr == number: return EPERM"
        program += [_op(JEQ_K, number, jf=1), _op(RET_K, eperm)]
    for number in table.xattr.values():
        program += [_op(JEQ_K, number, jf=1), _op(RET_K, eopnotsupp)]
    rules = table.argument_rules
    program += [_op(JEQ_K, rules["clone3"], jf=1), _op(RET_K, enosys)]
    # each block below: "if nr == N: load an argument; test it; return EPERM or fall through", then the number
    # is loaded again for the next block (both paths of a block end on that load)
    program += [  # clone(flags, ...): no CLONE_NEW* flag
        _op(JEQ_K, rules["clone"], jf=3), _op(LD_W_ABS, _arg_low(0)), _op(JSET_K, CLONE_NAMESPACE_FLAGS, jf=1),
        _op(RET_K, eperm), load_nr,
    ]
    program += [  # prlimit64(pid, ...): pid 0 (this process) only; the kernel reads pid as a 32-bit int
        _op(JEQ_K, rules["prlimit64"], jf=3), _op(LD_W_ABS, _arg_low(0)), _op(JEQ_K, 0, jt=1),
        _op(RET_K, eperm), load_nr,
    ]
    program += [  # socket(domain, ...): AF_UNIX only (the network namespace has no route out either)
        _op(JEQ_K, rules["socket"], jf=3), _op(LD_W_ABS, _arg_low(0)), _op(JEQ_K, AF_UNIX, jt=1),
        _op(RET_K, eperm), load_nr,
    ]
    program += [  # setsockopt(fd, level, name, ...): no larger socket buffers (level and name are ints)
        _op(JEQ_K, rules["setsockopt"], jf=9), _op(LD_W_ABS, _arg_low(1)), _op(JEQ_K, SOL_SOCKET, jf=5),
        _op(LD_W_ABS, _arg_low(2)),
        *[_op(JEQ_K, option, jt=len(SOCKET_BUFFER_OPTIONS) - k) for k, option in enumerate(SOCKET_BUFFER_OPTIONS)],
        _op(RET_K, RET_ALLOW),  # another option: allowed (setsockopt is the last rule before ioctl's)
        _op(RET_K, eperm),
    ]
    program += [  # ioctl(fd, request, ...): no terminal input injection (request is a 32-bit unsigned int)
        _op(JEQ_K, rules["ioctl"], jf=4), _op(LD_W_ABS, _arg_low(1)), _op(JEQ_K, TIOCSTI, jt=1),
        _op(JEQ_K, TIOCLINUX, jf=1), _op(RET_K, eperm),
    ]
    program.append(_op(RET_K, RET_ALLOW))
    return program


def table_for(machine: str | None = None) -> SyscallTable:
    """This machine's (or ``machine``'s) syscall table; ``SeccompUnsupported`` where there is none."""
    machine = machine or platform.machine()
    if machine not in MACHINE_NAMES or sys.byteorder != "little":
        raise SeccompUnsupported(
            f"the sandbox's seccomp filter has system-call tables for little-endian x86_64 and aarch64 only (this "
            f"machine is {machine}, {sys.byteorder}-endian)"
        )
    return TABLES[MACHINE_NAMES[machine]]


def instructions(machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions, for ``machine`` (default: this one)."""
    return _instructions(table_for(machine))


def program(machine: str | None = None) -> bytes:
    """The filter as the bytes of its ``struct sock_filter`` array (what ``bwrap --seccomp`` reads)."""
    return b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in instructions(machine))
