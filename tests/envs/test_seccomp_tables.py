"""The seccomp filter of each architecture, run by a classic-BPF interpreter on synthetic ``seccomp_data``
(the kernel's own run of the x86_64 filter is ``test_sandbox.py::test_seccomp_refuses_each_denied_call``;
no aarch64 machine is at hand, so this is what checks its filter): every call of the table gets its verdict,
the argument rules look at the right argument, other ABIs are killed, everything else is allowed. And each
table's numbers agree with the kernel headers where this machine has them."""

import errno
import os
import re
import struct

import pytest

from reflow.envs import seccomp

ALLOW, KILL = seccomp.RET_ALLOW, seccomp.RET_KILL_PROCESS
EPERM, ENOSYS, EOPNOTSUPP = (seccomp.RET_ERRNO | code for code in (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP))
BPF_MAXINSNS = 4096
# calls both tables leave alone: read, write, openat, exit_group
ALLOWED = {"x86_64": {"read": 0, "write": 1, "openat": 257, "exit_group": 231},
           "aarch64": {"read": 63, "write": 64, "openat": 56, "exit_group": 94}}


def run_filter(machine: str, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """The filter's return value for one call: a classic-BPF interpreter of the instructions the filter uses
    (absolute word loads, jumps on K, returns), over struct seccomp_data packed little-endian."""
    args = tuple(args) + (0,) * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    program = seccomp.instructions(machine)
    assert len(program) <= BPF_MAXINSNS
    accumulator, pc = 0, 0
    while True:
        assert 0 <= pc < len(program), "a jump out of the program: the kernel would refuse to load it"
        code, jt, jf, k = program[pc]
        if code == seccomp.LD_W_ABS:
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == seccomp.RET_K:
            return k
        elif code in (seccomp.JEQ_K, seccomp.JGE_K, seccomp.JSET_K):
            taken = {seccomp.JEQ_K: accumulator == k, seccomp.JGE_K: accumulator >= k, seccomp.JSET_K: accumulator & k}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"an instruction the interpreter does not know: {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(seccomp.TABLES))
def test_every_call_of_the_table_gets_its_verdict(machine):
    table = seccomp.TABLES[machine]
    verdict = lambda name, *args: run_filter(machine, table.audit_arch, numbers[name], args)  # noqa: E731
    numbers = {**table.denied, **table.xattr, **table.argument_rules, **ALLOWED[machine]}
    for name in table.denied:
        assert verdict(name) == EPERM, name
    for name in table.xattr:
        assert verdict(name) == EOPNOTSUPP, name
    for name in ALLOWED[machine]:
        assert verdict(name) == ALLOW, name
    assert verdict("clone3") == ENOSYS
    sigchld = 17
    assert verdict("clone", sigchld) == ALLOW  # fork
    assert verdict("clone", 0x003D0F00) == ALLOW  # a thread: CLONE_VM | CLONE_FS | CLONE_FILES | ... | CLONE_SETTLS
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000, 0x00001000):  # NEWUSER, NEWPID, NEWNET, NEWNS, PIDFD
        assert verdict("clone", sigchld | flag) == EPERM, hex(flag)
    assert verdict("prlimit64", 0) == ALLOW and verdict("prlimit64", 4242) == EPERM
    assert verdict("socket", seccomp.AF_UNIX) == ALLOW and verdict("socket", 2) == EPERM and verdict("socket", 10) == EPERM
    assert verdict("ioctl", 1, seccomp.TIOCSTI) == EPERM and verdict("ioctl", 1, seccomp.TIOCLINUX) == EPERM
    assert verdict("ioctl", 1, 0x5401) == ALLOW  # TCGETS: isatty() must keep working
    # setsockopt: socket buffers keep the kernel's default size; every other option is allowed
    for option in seccomp.SOCKET_BUFFER_OPTIONS:
        assert verdict("setsockopt", 3, seccomp.SOL_SOCKET, option) == EPERM, option
    assert verdict("setsockopt", 3, seccomp.SOL_SOCKET, 2) == ALLOW  # SO_REUSEADDR
    assert verdict("setsockopt", 3, 6, 7) == ALLOW  # level IPPROTO_TCP, option 7: not SO_SNDBUF's level
    # the argument rules read the argument they name, not another one
    assert verdict("socket", seccomp.AF_UNIX, 2) == ALLOW and verdict("ioctl", seccomp.TIOCSTI, 0x5401) == ALLOW
    assert verdict("setsockopt", seccomp.SOL_SOCKET, 7, 2) == ALLOW


@pytest.mark.parametrize("machine", sorted(seccomp.TABLES))
def test_calls_through_another_abi_are_killed(machine):
    table = seccomp.TABLES[machine]
    others = {seccomp.AUDIT_ARCH_X86_64, seccomp.AUDIT_ARCH_AARCH64, 0x40000003, 0x40000028} - {table.audit_arch}
    for arch in others:  # the other table's, i386, 32-bit ARM
        assert run_filter(machine, arch, ALLOWED[machine]["read"]) == KILL, hex(arch)
    if machine == "x86_64":  # x32: the x86_64 audit arch with the x32 bit in the number
        assert run_filter(machine, table.audit_arch, seccomp.X32_SYSCALL_BIT + 39) == KILL


def test_machine_names_and_an_unknown_machine():
    assert seccomp.table_for("AMD64") is seccomp.TABLES["x86_64"] and seccomp.table_for("arm64") is seccomp.TABLES["aarch64"]
    with pytest.raises(seccomp.SeccompUnsupported, match="riscv64"):
        seccomp.program("riscv64")
    # the same filter whichever name the machine goes by
    assert seccomp.program("aarch64") == seccomp.program("arm64") != seccomp.program("x86_64")


def _header_numbers(path: str) -> dict[str, int]:
    with open(path) as f:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", f.read())}


HEADERS = {
    "x86_64": ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
    "aarch64": ["/usr/include/asm-generic/unistd.h"],  # arm64's table is the generic one
}


@pytest.mark.parametrize("machine", sorted(seccomp.TABLES))
def test_numbers_agree_with_the_kernel_headers(machine):
    path = next((p for p in HEADERS[machine] if os.path.exists(p)), None)
    if path is None:
        pytest.skip(f"no kernel header for {machine} on this machine ({HEADERS[machine]})")
    header = _header_numbers(path)
    table = seccomp.TABLES[machine]
    numbers = {**table.denied, **table.xattr, **table.argument_rules, **ALLOWED[machine]}
    known = {name: number for name, number in numbers.items() if name in header}
    assert {name: header[name] for name in known} == known
    # calls newer than the header are numbered from 424 on, alike on every architecture but alpha
    newer = {name: number for name, number in numbers.items() if name not in header}
    assert all(number >= 424 for number in newer.values()), newer
    if machine != "x86_64":
        x86 = seccomp.TABLES["x86_64"]
        x86_numbers = {**x86.denied, **x86.xattr, **x86.argument_rules}
        assert {name: x86_numbers[name] for name in newer} == newer
