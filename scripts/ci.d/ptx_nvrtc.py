#!/usr/bin/env python3
"""Compiles the interpreter's CUDA C reference kernels (kernels/ptx-interp/tests/cuda/*.cu)
to PTX with NVRTC (PyPI nvidia-cuda-nvrtc-cu12, loaded through ctypes; no GPU needed) and
writes kernels/ptx-interp/tests/nvrtc/<name>.ptx, which the interpreter's tests load.

The PTX is committed so that `cargo test` needs neither Python nor NVRTC; `--check`
recompiles into memory and fails (exit 1, one line per file) when a committed file is
stale or missing, or one exists without its source. Usage: ptx_nvrtc.py [--check]
"""
import ctypes
import pathlib
import sys

import nvidia.cuda_nvrtc

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "kernels" / "ptx-interp" / "tests" / "cuda"
OUT = ROOT / "kernels" / "ptx-interp" / "tests" / "nvrtc"
# compute_80: the PTX ISA 8.x features our own kernels use (cp.async, ldmatrix, mma bf16).
OPTIONS = [b"--gpu-architecture=compute_80", b"--std=c++17", b"-default-device", b"--fmad=true"]


def nvrtc():
    lib_dir = pathlib.Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libnvrtc.so.12"))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def check(lib, status, what):
    if status != 0:
        sys.exit(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def version(lib):
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def compile_ptx(lib, path):
    prog = ctypes.c_void_p()
    src = path.read_bytes()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.name.encode(), 0, None, None), path.name)
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    status = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.exit(f"{path.name}: compilation failed:\n{log.value.decode()}")
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def main():
    check_only = "--check" in sys.argv[1:]
    lib = nvrtc()
    ver = version(lib)
    flags = " ".join(o.decode() for o in OPTIONS)
    problems = []
    sources = sorted(SRC.glob("*.cu"))
    for cu in sources:
        head = f"// Generated from tests/cuda/{cu.name} by scripts/ci.d/ptx_nvrtc.py (NVRTC {ver}, {flags}); do not edit.\n"
        text = head + compile_ptx(lib, cu)
        out = OUT / (cu.stem + ".ptx")
        if check_only:
            if not out.exists() or out.read_text() != text:
                problems.append(f"{out.relative_to(ROOT)} is stale: run scripts/ci.d/ptx_nvrtc.py")
        else:
            out.write_text(text)
    for ptx in sorted(OUT.glob("*.ptx")):
        if not (SRC / (ptx.stem + ".cu")).exists():
            problems.append(f"{ptx.relative_to(ROOT)} has no source tests/cuda/{ptx.stem}.cu")
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"{len(sources)} CUDA reference kernels {'fresh' if check_only else 'compiled'} (NVRTC {ver})")


if __name__ == "__main__":
    main()
