#!/usr/bin/env python3
"""The instruction mix of a kernel's straight-line blocks, from its SASS: compiles a kernel source with
NVRTC with the backend's options (plus `--ptxas-options=-v`), disassembles one entry point with
cuobjdump, cuts the code at branches and branch targets, and prints each block holding at least
`--min-ffma` FFMAs or HMMAs: its address, its instruction count and its counts of the usual
arithmetic, logic and memory operations. A block of a dot loop shows what a unit of values costs to
issue (a GPU runs none of this).

    scripts/sass_blocks.py --cuda-dir NVRTC_DIR --cuobjdump CUOBJDUMP --nvdisasm NVDISASM \\
        kernels/moe_layer.cu moe_layer_m1_q4_s6_u2 [--arch sm_90] [--min-ffma 12]

NVRTC_DIR holds lib/libnvrtc.so* and include/ (a CUDA toolkit, or the nvidia-cuda-nvrtc and
nvidia-cuda-runtime wheels' nvidia/cu13); CUOBJDUMP and NVDISASM are the two tools' executables.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

OPS = ["FFMA", "FADD", "FMUL", "HFMA2", "HMMA", "PRMT", "LOP3", "IMAD", "SHF", "IADD3", "ISETP", "SEL",
       "LDS", "LDG", "STS", "STG", "SHFL", "MUFU"]


def compile_cubin(cuda_dir, src, arch):
    lib_dir = os.path.join(cuda_dir, "lib")
    name = sorted(f for f in os.listdir(lib_dir) if f.startswith("libnvrtc.so"))[0]
    nvrtc = ctypes.CDLL(os.path.join(lib_dir, name))
    prog = ctypes.c_void_p()
    text = open(src, "rb").read()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text, os.path.basename(src).encode(), 0, None, None):
        sys.exit(f"{src}: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"-I{os.path.dirname(os.path.abspath(src))}",
            f"-I{os.path.join(cuda_dir, 'include')}", "-lineinfo", "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"{src}: NVRTC failed:\n{log.value.decode()}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log.value.decode()


def blocks(sass):
    ins = []
    for line in sass.splitlines():
        m = re.match(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    cuts = {0}
    for i, (_, s) in enumerate(ins):
        if "BRA" in s or "EXIT" in s:
            cuts.add(i + 1)
            t = re.search(r"0x([0-9a-f]+)", s.split("BRA")[-1])
            if "BRA" in s and t and int(t.group(1), 16) in index:
                cuts.add(index[int(t.group(1), 16)])
    cuts = sorted(c for c in cuts if c < len(ins))
    for i, c in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < len(cuts) else len(ins)
        ops = [re.sub(r"^@!?U?P[T0-9]+\s+", "", s).split()[0].split(".")[0] for _, s in ins[c:end]]
        yield ins[c][0], ops


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda-dir", required=True)
    p.add_argument("--cuobjdump", required=True)
    p.add_argument("--nvdisasm", required=True)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--min-ffma", type=int, default=12)
    p.add_argument("source")
    p.add_argument("function")
    a = p.parse_args()
    cubin, log = compile_cubin(a.cuda_dir, a.source, a.arch)
    log = log.splitlines()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        env = dict(os.environ, NVDISASM_PATH=os.path.dirname(os.path.abspath(a.nvdisasm)))
        out = subprocess.run([a.cuobjdump, "-sass", "-fun", a.function, f.name], env=env,
                             capture_output=True, text=True)
    if out.returncode or "Function" not in out.stdout:
        sys.exit(f"cuobjdump found no {a.function}: {out.stderr.strip()}")
    total = Counter()
    print(f"{a.function} ({a.arch})")
    for i, line in enumerate(log):
        if line.endswith("Function properties for " + a.function):
            print("  " + " / ".join(l.split(":", 1)[-1].strip() for l in log[i + 1:i + 3]))
    for addr, ops in blocks(out.stdout):
        total.update(ops)
        c = Counter(ops)
        if c["FFMA"] + c["HMMA"] >= a.min_ffma:
            mix = " ".join(f"{k}={c[k]}" for k in OPS if c[k])
            print(f"  block {addr:#07x}: {len(ops)} instructions, {mix}")
    print(f"  whole function: {sum(total.values())} instructions, "
          + " ".join(f"{k}={total[k]}" for k in OPS if total[k]))


if __name__ == "__main__":
    main()
