"""The sandbox's syscall filter: a seccomp BPF program built once with libseccomp (through ctypes).

A calculator never needs to debug other processes, mount file systems, use the kernel keyring, load BPF
or kernel modules, open perf events or make namespaces; those syscalls are a large share of the kernel
attack surface reachable by unprivileged code. They fail with EPERM (a normal error the program can
report) instead of killing it. ``clone3`` fails with ENOSYS: its flags live in memory a filter cannot read,
and ENOSYS makes glibc fall back to ``clone``, whose flags are checked. Syscalls of other ABIs (i386
``int 0x80``, x32) kill the process (libseccomp's default for a foreign architecture).

bwrap loads the program from ``--seccomp FD`` just before it starts the bootstrap; the unshare backend's
bootstrap loads the same bytes itself with ``prctl(PR_SET_SECCOMP)`` (see ``bootstrap.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_codes
import functools
import os

# Grouped by why a calculator never needs them (the tests check each group).
DENIED_SYSCALLS: dict[str, tuple[str, ...]] = {
    "debugging other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp"),
    "mounting": ("mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
                 "fspick", "mount_setattr"),
    "kernel keyring": ("add_key", "request_key", "keyctl"),
    "bpf and perf": ("bpf", "perf_event_open"),
    "namespaces": ("unshare", "setns"),
    "kernel images and modules": ("kexec_load", "kexec_file_load", "init_module", "finit_module",
                                  "delete_module"),
    "machine state": ("reboot", "swapon", "swapoff"),
    # Common ingredients of kernel exploits, never used by ordinary Python code.
    "exploit helpers": ("userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"),
}
# clone() with any of these flags makes a namespace (CLONE_NEWTIME is only valid for unshare/clone3).
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def build_filter(deny_errno: int = errno_codes.EPERM) -> bytes:
    """The raw BPF program (``struct sock_filter[]``). Raises OSError/RuntimeError when it cannot be built.

    ``deny_errno`` exists for the tests: a distinctive value proves a syscall failed because of this filter.
    """
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise RuntimeError("seccomp_init failed")
    try:
        deny = _act_errno(deny_errno)

        def add(name: str, action: int, *conditions: _ArgCmp) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                return  # unknown on this architecture (e.g. kexec_file_load on some): nothing to deny
            array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
            rc = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")

        for names in DENIED_SYSCALLS.values():
            for name in names:
                add(name, deny)
        for flag in CLONE_NAMESPACE_FLAGS.values():
            # flags are clone's first argument on x86_64 and aarch64
            add("clone", deny, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        add("clone3", _act_errno(errno_codes.ENOSYS))
        read_fd, write_fd = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, write_fd)
            os.close(write_fd)
            write_fd = -1
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            chunks = []
            while chunk := os.read(read_fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        program = b"".join(chunks)
        if not program or len(program) % 8:
            raise RuntimeError(f"libseccomp exported a malformed filter ({len(program)} bytes)")
        return program
    finally:
        lib.seccomp_release(ctx)


@functools.lru_cache(maxsize=1)
def sandbox_filter() -> tuple[bytes | None, str]:
    """(the filter every call gets, or None; why not). Built once per process (~1 ms)."""
    try:
        return build_filter(), ""
    except (OSError, RuntimeError, AttributeError) as exc:
        return None, (f"the seccomp filter could not be built ({exc}); install libseccomp2, or set "
                      "'seccomp: false' to run without it")


def filter_memfd(program: bytes) -> int:
    """A fresh fd holding ``program`` from offset 0, for bwrap's ``--seccomp FD`` (one per call: bwrap reads
    it to the end, so a shared fd would leave the next call an empty file)."""
    fd = os.memfd_create("arpo-seccomp", 0)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
