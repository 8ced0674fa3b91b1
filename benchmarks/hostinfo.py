"""What machine a result came from: the CPU model with family/model/stepping (AMD's Zen 4 and
Zen 5 share the name "AMD EPYC" on these hosts) and the SIMD extensions the kernels choose
between, and the xctx commit that ran. Shared by the benchmark scripts."""
import os
import subprocess

ISA = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_identity():
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    isa = "/".join(x for x in ISA if x in flags) or "no AVX2"
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')} "
            f"stepping {fields.get('stepping', '?')}), {os.cpu_count()} cores, {isa}")


def xctx_commit():
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"
