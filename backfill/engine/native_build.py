"""Building backfill's C++ CPU kernels with torch.utils.cpp_extension, on first use.

Each kernel is compiled for the host CPU (-march=native) and cached on disk under a name keyed by
the CPU's feature flags, so a cache carried to another machine is rebuilt rather than run with
instructions that machine lacks. A compiler and ninja are needed; callers treat a failed build as
"this kernel is unavailable" and keep their portable path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def cpu_key() -> str:
    """A short hash of the CPU's feature flags and of the ISA PyTorch is held to: a -march=native
    build only runs where they match, and a build for a lowered ISA is a build of its own."""
    flags = " ".join(sorted(cpu_flags())) or torch.backends.cpu.get_cpu_capability()
    if isa_capped_below_avx512():
        flags += " capped:" + torch.backends.cpu.get_cpu_capability()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def isa_capped_below_avx512() -> bool:
    """Whether PyTorch is held below AVX-512 on a CPU that has it (ATEN_CPU_CAPABILITY=avx2, e.g. to
    measure how an AVX2-only machine runs): backfill's own kernels then keep to AVX2 as well."""
    return "avx512f" in cpu_flags() and torch.backends.cpu.get_cpu_capability() != "AVX512"


def kernel_headers(source: Path) -> list[Path]:
    """The headers beside a kernel's source, which it may include (shared by several kernels)."""
    return sorted(source.parent.glob("*.h"))


def source_digest(source: Path) -> str:
    """A short hash of a kernel's source and the headers beside it: step-time profiles measured with
    one version of a kernel do not describe another."""
    h = hashlib.sha256(source.read_bytes())
    for header in kernel_headers(source):
        h.update(header.read_bytes())
    return h.hexdigest()[:8]


def put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip-installed one lives in the venv, which a
    `.venv/bin/python ...` run does not put on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def vector_capability_flags() -> list[str]:
    """The macros that pick ATen's Vectorized<float> width (as PyTorch's own kernels and inductor do):
    AVX-512 or AVX2 where this CPU and build have them, else the portable scalar version."""
    capability = torch.backends.cpu.get_cpu_capability()
    # -march=native would still emit AVX-512 where PyTorch is held below it.
    capped = ["-mno-avx512f"] if isa_capped_below_avx512() else []
    if capability not in ("AVX512", "AVX2"):
        return ["-DCPU_CAPABILITY=DEFAULT", *capped]
    return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *capped]


def build_cpu_extension(name: str, source: Path, *, python_module: bool = True):
    """Compile (or load from the disk cache) one C++ source for this CPU; raises where it cannot.

    With python_module=False the library only registers operators (torch.ops) and None is returned.
    """
    from torch.utils import cpp_extension

    put_ninja_on_path()
    full_name = f"{name}_{cpu_key()}"
    build_dir = Path(cpp_extension._get_build_directory(full_name, verbose=False))
    with exclusive_build(build_dir):
        # Compiling takes half a minute or more (ninja decides whether it must: a first use, a
        # changed source, a checkout in another folder), so say what may be happening.
        log.info("loading backfill's C++ kernel %s (compiled for this CPU when needed, cached in %s)", name,
                 build_dir)
        # Compiled from a copy in the cache, not from the checkout: ninja rebuilds whenever the source
        # path changes, so two checkouts (a fresh clone beside another) would recompile each other's
        # build at every switch though the source is the same. The copy changes only with the content.
        for file in (source, *kernel_headers(source)):
            stable = build_dir / file.name
            if not stable.exists() or stable.read_bytes() != file.read_bytes():
                shutil.copyfile(file, stable)
        stable = build_dir / source.name
        return cpp_extension.load(name=full_name, sources=[str(stable)], build_directory=str(build_dir),
                                  extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp",
                                                *vector_capability_flags()],
                                  extra_ldflags=["-fopenmp"], is_python_module=python_module, verbose=False)


@contextlib.contextmanager
def exclusive_build(build_dir: Path):
    """Serialise builds of one extension under an flock, which the kernel drops when its holder dies.

    torch's own baton is a plain `lock` file: a build killed mid-way leaves it behind and every later
    load waits on it forever. Holding our flock, no other builder is alive, so such a file is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "backfill-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
